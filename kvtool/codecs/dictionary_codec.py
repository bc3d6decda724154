"""What ``ctxans`` and ``ctxtans`` share: a model dictionary named by id, [heads, tokens, dim] blocks, and
chunks coded by the C core or, without it, by a numpy reference that writes and reads the same bytes.

A subclass says which reference module and which core functions code its chunks, and how a dictionary
becomes the tables the reference reads and the model the core reads (``_coders``).
"""

from __future__ import annotations

import abc
from types import ModuleType
from typing import Callable, ClassVar, cast

import numpy as np

from kvtool import _native
from kvtool.codecs.base import BufferLike, NativeArrayCodec, as_memoryview
from kvtool.dtypes import dtype_of
from kvtool.errors import DecodeError, UsageError
from kvtool.modeldict import registry
from kvtool.modeldict.format import Dictionary

_CORE_ERRORS = {1: "malformed chunk", 3: "the chunk was coded with another dictionary"}


class DictionaryCodec(NativeArrayCodec):
    params = ("dict",)
    spec_param = "dict"
    uses_dictionary = True
    #: encode(block, name, tables, tag) and decode(buf, name, shape, tables, tag): the numpy reference.
    reference_module: ClassVar[ModuleType]
    #: The core's functions that encode and decode one chunk with a model.
    core_encode: ClassVar[str]
    core_decode: ClassVar[str]
    #: The most tokens a block may hold (the core's sums stay within 32 bits).
    max_tokens: ClassVar[int] = 1 << 22

    def __init__(self, dict: str | None = None):  # "dict": the config key users write
        if dict is None:
            dict = registry.default_id()
        if not isinstance(dict, str) or not registry.ID_PATTERN.match(dict):
            raise UsageError(f"codec {self.codec_id!r}: dict must be a dictionary id (32 hex digits), not {dict!r}")
        self.dict = dict

    @classmethod
    def spec_value(cls, arg: str) -> str:
        return registry.resolve(arg)

    @abc.abstractmethod
    def dictionary(self) -> Dictionary:
        """The dictionary this codec codes with (looked up on first use)."""

    @abc.abstractmethod
    def _coders(self) -> tuple[Dictionary, object, object | None]:
        """The dictionary, the tables the reference codes with, and the core's model (None without the core)."""

    def _name(self, dtype: np.dtype, shape: tuple[int, ...]) -> str:
        if not self.supports(dtype):
            raise UsageError(f"codec {self.codec_id!r} codes {', '.join(self.families)} tensors, not {np.dtype(dtype)}")
        if len(shape) != 3:
            raise UsageError(f"codec {self.codec_id!r} takes [heads, tokens, dim] blocks, not shape {list(shape)}")
        if shape[1] > self.max_tokens:
            raise UsageError(f"codec {self.codec_id!r} takes blocks of at most {self.max_tokens} tokens")
        return dtype_of(np.dtype(dtype)).name

    def encode_array(self, block: np.ndarray) -> bytes:
        name = self._name(block.dtype, block.shape)
        dictionary, tables, model = self._coders()
        core = _native.core()
        if core is None or model is None:
            chunk: bytes = self.reference_module.encode(block, name, tables, dictionary.tag)
            return chunk
        contiguous = np.ascontiguousarray(block)
        encode: Callable[..., bytes] = getattr(core, self.core_encode)  # NativeCore.ctxans_encode or ctxtans_encode
        return encode(_native.byte_view(contiguous), model, _native.DTYPE_CODES[name], *block.shape)

    def decode_array(self, buf: BufferLike, shape: tuple[int, ...], dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
        name = self._name(dtype, shape)
        if out is None:
            out = np.empty(shape, dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != np.dtype(dtype) or not out.flags.c_contiguous:
            raise UsageError(f"{self.codec_id} decodes into a C-contiguous {list(shape)} {np.dtype(dtype)} array")
        dictionary, tables, model = self._coders()
        core = _native.core()
        if core is None or model is None:
            block = self.reference_module.decode(as_memoryview(buf), name, cast(tuple[int, int, int], tuple(shape)), tables, dictionary.tag)
            out.view(f"u{out.itemsize}")[...] = block
            return out
        decode: Callable[..., int] = getattr(core, self.core_decode)  # NativeCore.ctxans_decode or ctxtans_decode
        status = decode(as_memoryview(buf), _native.byte_view(out), model, _native.DTYPE_CODES[name], *shape)
        if status:
            raise DecodeError(f"{self.codec_id}: {_CORE_ERRORS.get(status, f'decoder status {status}')}")
        return out
