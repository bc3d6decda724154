"""Model dictionaries kept beside a store's entries, so every reader of a shared store finds them.

An entry coded with ``ctxans:ID`` needs dictionary ``ID`` to decode. A writer
``publish``es the dictionary into the store under ``kvd/ID`` (the key is its
content hash, so it is stored once however many entries use it, and a copy
is never wrong); a reader ``attach``es the store, and from then on
``kvtool.modeldict.registry.lookup`` fetches any dictionary it does not know
from there. Only the public ``get``/``put``/``contains`` of ``Store`` are used.
If the store evicts a dictionary, the entries that need it fail to decode
(a miss with a clear reason), until a writer publishes it again.
"""

from __future__ import annotations

from kvtool.modeldict import registry
from kvtool.modeldict.format import Dictionary, DictionaryError
from kvtool.recipe import Recipe
from kvtool.store.base import Store

#: Keys under this prefix hold dictionaries, not KV cache entries.
PREFIX = "kvd/"


def key_of(dictionary_id: str) -> str:
    return PREFIX + dictionary_id


def publish(store: Store, dictionary: Dictionary) -> bool:
    """Keep ``dictionary`` in ``store`` (once: nothing is written when it is there); ``False`` if it could not be stored."""
    key = key_of(dictionary.id)
    if store.contains(key):
        return True
    return store.put(key, dictionary.to_bytes(), {"kind": "kvtool-dictionary"})


def publish_for(store: Store, recipe: Recipe | str) -> bool:
    """Publish the dictionaries ``recipe`` codes with (none for most recipes)."""
    recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
    coders = [recipe.codec, *recipe.plane_codecs.values()]
    return all(publish(store, coder.dictionary()) for coder in coders if hasattr(coder, "dictionary"))


def fetch(store: Store, dictionary_id: str) -> Dictionary | None:
    """The dictionary ``dictionary_id`` from ``store``; None when it is missing or damaged."""
    data = store.get(key_of(dictionary_id))
    if data is None:
        return None
    try:
        dictionary = Dictionary.from_bytes(data)
    except DictionaryError:
        return None
    return dictionary if dictionary.id == dictionary_id else None


class _StoreSource:
    """``registry.attach``'s view of a store: the bytes of a dictionary, by id."""

    def __init__(self, store: Store):
        self.store = store

    def __call__(self, dictionary_id: str) -> bytes | None:
        if self.store.closed:
            return None
        dictionary = fetch(self.store, dictionary_id)
        return None if dictionary is None else dictionary.to_bytes()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _StoreSource) and other.store is self.store

    def __hash__(self) -> int:
        return id(self.store)


def attach(store: Store) -> None:
    """Let dictionary lookups in this process fall back to ``store``."""
    registry.attach(_StoreSource(store))


def detach(store: Store) -> None:
    registry.detach(_StoreSource(store))
