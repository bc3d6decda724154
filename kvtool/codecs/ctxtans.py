"""``ctxtans``: KV blocks coded with a model dictionary's context models, a channel per SIMD lane.

The models of ``ctxans`` (each value's sign, exponent and top mantissa bit as
one symbol, coded in the context of its channel's previous token with the
models of the channel's dictionary class; repeated rows named; the other
mantissa bits raw), brought to 11-bit frequencies once, when the dictionary is
first used, so no table is built per chunk. Chunks of version 3 (what it
writes) give every channel of a head's groups of 64 its own rANS state, so the
core decodes 16 channels per AVX-512 register (8 per AVX2 one) side by side;
versions 1 and 2 (tANS, eight states in turn) still decode. A chunk the
dictionary codes worse than a Huffman code of the chunk's own statistics would
is written as an ``exphuff`` chunk (the fallback for a dictionary that does
not fit the model).

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
from kvtool._native.batch import BatchCodec
from kvtool._native.core_api import CoderModel, NativeCore
from kvtool._native.ctxtans_tables import TansTables
from kvtool.codecs.dictionary_codec import DictionaryCodec
from kvtool.modeldict import registry
from kvtool.modeldict.format import Dictionary

#: The most tokens a block may hold (the core's sums stay within 32 bits).
MAX_TOKENS = 1 << 22
_tables_lock = threading.Lock()
_tables: dict[str, tuple[TansTables, object]] = {}  # dictionary id -> its tables and their core model


def tables_of(dictionary: Dictionary) -> tuple[TansTables, object]:
    """A dictionary's tables (11-bit models; tANS tables for chunk versions 1 and 2) and the core's copy of them
    (None without the core), built once per process."""
    with _tables_lock:
        if dictionary.id not in _tables:
            t = TansTables.of(dictionary.tables)
            core = _native.core()
            _tables[dictionary.id] = (t, None if core is None else core_model(core, t, dictionary.tag))
        return _tables[dictionary.id]


def core_model(core: NativeCore, t: TansTables, tag: bytes) -> CoderModel:
    """The core's copy of the tables; its kernels run the process's instruction set (``_native.isa_here()``)."""
    ct = t.coder
    return core.ctxtans_model(
        t.g.astype("<u2").tobytes(), t.start.astype("<u2").tobytes(), t.symbol.astype(np.uint8).tobytes(),
        t.nbits.astype(np.uint8).tobytes(), t.base.astype("<u2").tobytes(), t.cost.astype("<i4").tobytes(),
        t.class_cost.astype("<i4").tobytes(), ct.context_of.tobytes(), ct.start_context, ct.classes, ct.contexts, tag,
    )


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

    def batch_kernel(self, dtype: np.dtype) -> BatchCodec | None:
        return BatchCodec.of(dtype, coded=True, model=self.model()) if self.supports(dtype) else None

    def _coders(self) -> tuple[Dictionary, object, object | None]:
        dictionary = self.dictionary()
        tables, model = tables_of(dictionary)
        return dictionary, tables, model
