"""The codec interface: bytes in, bytes out, rebuilt from a JSON config.

A codec names a wire format. Its ``get_config()`` is all a reader needs to
rebuild it through the registry; nothing else about the encoder is part of the
format.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar, Collection, Union

import numpy as np

from kvtool import _native
from kvtool._native.batch import BatchCodec
from kvtool.component import Component
from kvtool.dtypes import dtype_of
from kvtool.errors import OutputTooLargeError, UsageError

BufferLike = Union[bytes, bytearray, memoryview, np.ndarray]


def as_memoryview(buf: BufferLike) -> memoryview:
    """A flat, contiguous byte view of ``buf`` (copies only non-contiguous arrays)."""
    view = np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data if isinstance(buf, np.ndarray) else memoryview(buf)
    if not view.contiguous:
        view = memoryview(view.tobytes())
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def check_output_size(size: int, max_size: int) -> None:
    if size > max_size:
        raise OutputTooLargeError(f"decoded data is larger than the allowed {max_size} bytes")


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""  # why not, when not ok
    implementation: str = ""  # e.g. "QAT hardware", "QATzip software fallback", "libzstd 1.5.7"


class Codec(Component, abc.ABC):
    """A lossless bytes-to-bytes transform.

    Subclasses set ``codec_id`` and ``params`` (the names of their config keys),
    take those as keyword arguments, and implement ``encode``/``decode``.
    """

    kind = "codec"
    id_attr = "codec_id"
    codec_id: ClassVar[str]
    #: The name of the parameter that ``ID:ARG`` in a spec sets, usually the level.
    spec_param: ClassVar[str | None] = "level"
    #: First bytes of every encoded stream, used to recognise plain compressed files.
    magic: ClassVar[bytes | None] = None
    #: True when the format carries its own checksum, so corrupt input raises.
    self_checking: ClassVar[bool] = True
    # What the codec can do beyond encode/decode, asked by the pipelines, the GPU path and the integrations
    # (which never list codec ids):
    #: A model dictionary decides the coding; a recipe names it as ``CODEC:ID`` (``kvtool train`` makes one).
    uses_dictionary: ClassVar[bool] = False
    #: The GPU decoder (``kvtool.gpu``) reads this codec's chunks straight into paged KV blocks.
    gpu_decodes: ClassVar[bool] = False
    #: ``decode`` releases the GIL and is cheap to call per plane: a layout's batch kernel may take its planes.
    plane_batch: ClassVar[bool] = False

    def batch_kernel(self, dtype: np.dtype) -> BatchCodec | None:
        """The native kernel that codes whole tensors of ``dtype`` and decodes runs of this codec's chunks straight
        into a destination's rows (``kvtool._native.batch``), where the codec has one and the core runs; else None."""
        return None

    @abc.abstractmethod
    def encode(self, buf: BufferLike) -> bytes:
        """Compress ``buf``."""

    @abc.abstractmethod
    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        """Decompress ``buf``; raise ``DecodeError`` on bad input and never produce more than ``max_size`` bytes."""

    @classmethod
    def available(cls) -> Availability:
        """Whether this codec can run here, and through which implementation."""
        return Availability(True)

    @classmethod
    def spec_value(cls, arg: str) -> int | str:
        try:
            return int(arg)
        except ValueError:
            raise UsageError(f"codec {cls.codec_id!r}: {cls.spec_param} must be an integer, not {arg!r}") from None


class ArrayCodec(Codec):
    """A codec that takes a whole KV block ``[heads, tokens, dim]`` of a float dtype, not plain bytes.

    It is the one array-to-bytes stage of a recipe (as in zarr v3): knowing the
    dtype and the channels lets it split each float and model each channel,
    which a bytes codec cannot. A recipe that ends with one has no layouts
    before it. ``decode_array`` writes into a caller's array when given one.
    Its chunks need not carry a checksum: the container verifies every chunk.
    """

    self_checking = False

    @abc.abstractmethod
    def encode_array(self, block: np.ndarray) -> bytes:
        """Encode a block ``[heads, tokens, dim]`` (any strides)."""

    @abc.abstractmethod
    def decode_array(self, buf: BufferLike, shape: tuple[int, ...], dtype: np.dtype, out: np.ndarray | None = None) -> np.ndarray:
        """Decode a block of ``shape`` and ``dtype``, into ``out`` when given; ``DecodeError`` on bad input."""

    @abc.abstractmethod
    def supports(self, dtype: np.dtype) -> bool:
        """Whether blocks of ``dtype`` can be coded."""

    def encode(self, buf: BufferLike) -> bytes:
        raise UsageError(f"codec {self.codec_id!r} codes KV tensors, not plain bytes: use it as a recipe (--recipe {self.codec_id})")

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        raise UsageError(f"codec {self.codec_id!r} decodes KV tensors inside a .kvz file, not plain streams")


class NativeArrayCodec(ArrayCodec):
    """An array codec of kvtool's native core (numpy reference without it) for the dtype families it names."""

    families: Collection[str] = ()  # dtype names, as kvtool.dtypes names them

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=_native.status())

    def supports(self, dtype: np.dtype) -> bool:
        try:
            return dtype_of(np.dtype(dtype)).name in self.families
        except UsageError:
            return False
