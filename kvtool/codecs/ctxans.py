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
from typing import cast

import numpy as np

from kvtool import _native
from kvtool.cache import dtype_of
from kvtool.codecs.base import NativeArrayCodec, BufferLike, as_memoryview
from kvtool.errors import DecodeError, UsageError
from kvtool.modeldict import registry
from kvtool.modeldict import ctxans_reference as reference
from kvtool.modeldict.format import Dictionary

MAX_TOKENS = reference.MAX_TOKENS
_CORE_ERRORS = {1: "malformed chunk", 3: "the chunk was coded with another dictionary"}


class CtxAnsCodec(NativeArrayCodec):
    codec_id = "ctxans"
    params = ("dict",)
    spec_param = "dict"
    families = reference.FAMILIES

    def __init__(self, dict: str | None = None):  # "dict": the config key users write
        if dict is None:
            dict = registry.default_id()
        if not isinstance(dict, str) or not registry.ID_PATTERN.match(dict):
            raise UsageError(f"codec 'ctxans': dict must be a dictionary id (32 hex digits), not {dict!r}")
        self.dict = dict
        self._lock = threading.Lock()
        self._state: tuple[Dictionary, object] | None = None

    @classmethod
    def spec_value(cls, arg: str) -> str:
        return registry.resolve(arg)


    def dictionary(self) -> Dictionary:
        """The dictionary this codec codes with (looked up on first use)."""
        return self._loaded()[0]

    def _loaded(self) -> tuple[Dictionary, object]:
        with self._lock:
            if self._state is None:
                dictionary = registry.lookup(self.dict)
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

    def _name(self, dtype: np.dtype, shape) -> str:
        if not self.supports(dtype):
            raise UsageError(f"codec 'ctxans' codes {', '.join(reference.FAMILIES)} tensors, not {np.dtype(dtype)}")
        if len(shape) != 3:
            raise UsageError(f"codec 'ctxans' takes [heads, tokens, dim] blocks, not shape {list(shape)}")
        if shape[1] > MAX_TOKENS:
            raise UsageError(f"codec 'ctxans' takes blocks of at most {MAX_TOKENS} tokens")
        return dtype_of(np.dtype(dtype)).name

    def encode_array(self, block: np.ndarray) -> bytes:
        name = self._name(block.dtype, block.shape)
        dictionary, model = self._loaded()
        if model is None:
            return reference.encode(block, name, dictionary.tables, dictionary.tag)
        contiguous = np.ascontiguousarray(block)
        return _native_core().ctxans_encode(_native.byte_view(contiguous), model, _native.DTYPE_CODES[name], *block.shape)

    def decode_array(self, buf: BufferLike, shape: tuple[int, ...], dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
        name = self._name(dtype, shape)
        if out is None:
            out = np.empty(shape, dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise UsageError(f"ctxans decodes into a C-contiguous {list(shape)} {np.dtype(dtype)} array")
        dictionary, model = self._loaded()
        if model is None:
            out.view(f"u{out.itemsize}")[...] = reference.decode(as_memoryview(buf), name, cast(tuple[int, int, int], tuple(shape)), dictionary.tables, dictionary.tag)
            return out
        status = _native_core().ctxans_decode(as_memoryview(buf), _native.byte_view(out), model, _native.DTYPE_CODES[name], *shape)
        if status:
            raise DecodeError(f"ctxans: {_CORE_ERRORS.get(status, f'decoder status {status}')}")
        return out


def _native_core() -> ModuleType:
    """The native core, which a loaded model implies (models are built only when it is there)."""
    core = _native.core()
    assert core is not None
    return core

