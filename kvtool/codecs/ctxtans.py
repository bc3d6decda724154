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
from typing import cast

import numpy as np

from kvtool import _native
from kvtool._native import ctxtans_reference as reference
from kvtool._native.ctxtans_tables import TansTables
from kvtool.codecs.base import BufferLike, NativeArrayCodec, as_memoryview
from kvtool.dtypes import dtype_of
from kvtool.errors import DecodeError, UsageError
from kvtool.modeldict import registry
from kvtool.modeldict.format import Dictionary

#: The most tokens a block may hold (the core's sums stay within 32 bits).
MAX_TOKENS = 1 << 22
_CORE_ERRORS = {1: "malformed chunk", 3: "the chunk was coded with another dictionary"}
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


class CtxTansCodec(NativeArrayCodec):
    codec_id = "ctxtans"
    params = ("dict",)
    spec_param = "dict"
    families = reference.FAMILIES

    def __init__(self, dict: str | None = None):  # "dict": the config key users write
        if dict is None:
            dict = registry.default_id()
        if not isinstance(dict, str) or not registry.ID_PATTERN.match(dict):
            raise UsageError(f"codec 'ctxtans': dict must be a dictionary id (32 hex digits), not {dict!r}")
        self.dict = dict

    @classmethod
    def spec_value(cls, arg: str) -> str:
        return registry.resolve(arg)

    def dictionary(self) -> Dictionary:
        """The dictionary this codec codes with (looked up on first use)."""
        return registry.lookup(self.dict)

    def model(self) -> object | None:
        """The core's copy of the dictionary's tables (None without the core): what the batch path codes with."""
        return tables_of(self.dictionary())[1]

    def _name(self, dtype: np.dtype, shape) -> str:
        if not self.supports(dtype):
            raise UsageError(f"codec 'ctxtans' codes {', '.join(reference.FAMILIES)} tensors, not {np.dtype(dtype)}")
        if len(shape) != 3:
            raise UsageError(f"codec 'ctxtans' takes [heads, tokens, dim] blocks, not shape {list(shape)}")
        if shape[1] > MAX_TOKENS:
            raise UsageError(f"codec 'ctxtans' takes blocks of at most {MAX_TOKENS} tokens")
        return dtype_of(np.dtype(dtype)).name

    def encode_array(self, block: np.ndarray) -> bytes:
        name = self._name(block.dtype, block.shape)
        dictionary = self.dictionary()
        tables, model = tables_of(dictionary)
        core = _native.core()
        if core is None or model is None:
            return reference.encode(block, name, tables, dictionary.tag)
        contiguous = np.ascontiguousarray(block)
        return core.ctxtans_encode(_native.byte_view(contiguous), model, _native.DTYPE_CODES[name], *block.shape)

    def decode_array(self, buf: BufferLike, shape: tuple[int, ...], dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
        name = self._name(dtype, shape)
        if out is None:
            out = np.empty(shape, dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise UsageError(f"ctxtans decodes into a C-contiguous {list(shape)} {np.dtype(dtype)} array")
        dictionary = self.dictionary()
        tables, model = tables_of(dictionary)
        core = _native.core()
        if core is None or model is None:
            block = reference.decode(as_memoryview(buf), name, cast(tuple[int, int, int], tuple(shape)), tables, dictionary.tag)
            out.view(f"u{out.itemsize}")[...] = block
            return out
        status = core.ctxtans_decode(as_memoryview(buf), _native.byte_view(out), model, _native.DTYPE_CODES[name], *shape)
        if status:
            raise DecodeError(f"ctxtans: {_CORE_ERRORS.get(status, f'decoder status {status}')}")
        return out
