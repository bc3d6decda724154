"""``ctxans``: KV blocks coded with a model dictionary's context models and rANS.

The best-ratio array codec. Where ``exphuff`` gives every block one order-0
code, ``ctxans`` brings its models from a *model dictionary* (``.kvd``,
``kvtool train``): each channel of a block picks the dictionary class that
codes it best, and each value's sign, exponent and top mantissa bit are coded
as one symbol in the context of the channel's previous token. Rows that repeat
an earlier row of the block are named instead of coded. The low mantissa bits
are stored raw.

``ctxans`` alone uses the dictionary kvtool ships (learnt from its samples);
``ctxans:FILE.kvd`` or ``ctxans:ID`` names another. The recipe in a ``.kvz``
records the dictionary's id; decoding looks it up by that id
(``kvtool.modeldict.registry``) and fails with ``MissingDictionaryError`` where
it is not found, never with wrong data. The C core does the work; without it
the numpy reference (``kvtool.modeldict.ctxans_reference``) writes and reads the
same bytes, slowly. docs/FORMAT.md has the format.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import ClassVar

from kvtool import _native
from kvtool.codecs.dictionary_codec import DictionaryCodec
from kvtool.modeldict import ctxans_reference as reference
from kvtool.modeldict import registry
from kvtool.modeldict.format import Dictionary

MAX_TOKENS = reference.MAX_TOKENS


class CtxAnsCodec(DictionaryCodec):
    codec_id = "ctxans"
    families = reference.FAMILIES
    reference_module: ClassVar[ModuleType] = reference
    core_encode, core_decode = "ctxans_encode", "ctxans_decode"
    max_tokens = MAX_TOKENS

    def __init__(self, dict: str | None = None):  # "dict": the config key users write
        super().__init__(dict)
        self._lock = threading.Lock()
        self._state: tuple[Dictionary, object] | None = None

    def dictionary(self) -> Dictionary:
        """The dictionary this codec codes with (looked up on first use)."""
        return self._loaded()[0]

    def _loaded(self) -> tuple[Dictionary, object]:
        with self._lock:
            if self._state is None:
                dictionary = registry.context_models(self.dict)
                core = _native.core()
                model = None
                if core is not None:
                    t = dictionary.tables
                    model = core.ctxans_model(
                        t.freq.astype("<u2").tobytes(), t.cum.astype("<u2").tobytes(), t.cost.astype("<i4").tobytes(),
                        t.class_cost.astype("<i4").tobytes(), t.context_of.tobytes(), t.start_context, t.classes,
                        t.contexts, dictionary.tag,
                    )
                self._state = (dictionary, model)
            return self._state

    def _coders(self) -> tuple[Dictionary, object, object | None]:
        dictionary, model = self._loaded()
        return dictionary, dictionary.tables, model
