"""``ctxtans``: KV blocks coded with a model dictionary's context models and tANS, at the default's speed.

The models of ``ctxans`` (each value's sign, exponent and top mantissa bit as
one symbol, coded in the context of its channel's previous token with the
models of the channel's dictionary class; repeated rows named; the other
mantissa bits raw), coded with tANS instead of rANS: every model of the
dictionary becomes a table of 2^11 states once, when the dictionary is first
used, so no table is built per chunk and a value decodes in one table step.
A chunk the dictionary codes worse than a Huffman code of the chunk's own
statistics would is written as an ``exphuff`` chunk (the fallback for a
dictionary that does not fit the model).

``ctxtans`` alone uses the dictionary kvtool ships; ``ctxtans:FILE.kvd`` or
``ctxtans:ID`` names another (``kvtool train`` learns one). The C core does
the work; without it the numpy reference (``kvtool._native.ctxtans_reference``)
writes and reads the same bytes, slowly. docs/FORMAT.md has the format.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import ClassVar

import numpy as np

from kvtool import _native
from kvtool._native import ctxtans_reference as reference
from kvtool._native.ctxtans_tables import TansTables
from kvtool.codecs.dictionary_codec import DictionaryCodec
from kvtool.modeldict import registry
from kvtool.modeldict.format import Dictionary

#: The most tokens a block may hold (the core's sums stay within 32 bits).
MAX_TOKENS = 1 << 22
_tables_lock = threading.Lock()
_tables: dict[str, tuple[TansTables, object]] = {}  # dictionary id -> its tables and their core model


def tables_of(dictionary: Dictionary) -> tuple[TansTables, object]:
    """A dictionary's tANS tables and the core's copy of them (None without the core), built once per process."""
    with _tables_lock:
        if dictionary.id not in _tables:
            t = TansTables.of(dictionary.tables)
            core = _native.core()
            model = None
            if core is not None:
                ct = t.coder
                model = core.ctxtans_model(
                    t.g.astype("<u2").tobytes(), t.start.astype("<u2").tobytes(), t.symbol.astype(np.uint8).tobytes(),
                    t.nbits.astype(np.uint8).tobytes(), t.base.astype("<u2").tobytes(), t.encode.astype("<u2").tobytes(),
                    t.cost.astype("<i4").tobytes(), t.class_cost.astype("<i4").tobytes(), ct.context_of.tobytes(),
                    ct.start_context, ct.classes, ct.contexts, dictionary.tag,
                )
            _tables[dictionary.id] = (t, model)
        return _tables[dictionary.id]


class CtxTansCodec(DictionaryCodec):
    codec_id = "ctxtans"
    families = reference.FAMILIES
    reference_module: ClassVar[ModuleType] = reference
    core_encode, core_decode = "ctxtans_encode", "ctxtans_decode"
    max_tokens = MAX_TOKENS

    def dictionary(self) -> Dictionary:
        """The dictionary this codec codes with (looked up on first use)."""
        return registry.context_models(self.dict)

    def model(self) -> object | None:
        """The core's copy of the dictionary's tables (None without the core): what the batch path codes with."""
        return tables_of(self.dictionary())[1]

    def _coders(self) -> tuple[Dictionary, object, object | None]:
        dictionary = self.dictionary()
        tables, model = tables_of(dictionary)
        return dictionary, tables, model
