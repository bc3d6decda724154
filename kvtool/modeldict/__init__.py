"""Model dictionaries (``.kvd``): what the ``ctxans`` codec learns about a model's KV caches ahead of time.

``train`` learns one from real caches; ``Dictionary`` reads and writes the
format; ``lookup`` finds one by its id (registered in this process, on the
dictionary path, or in an attached store).
"""

from kvtool.modeldict.filehead import DictionaryError
from kvtool.modeldict.format import Dictionary

__all__ = ["Dictionary", "DictionaryError"]
