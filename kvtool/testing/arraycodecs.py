"""``ArrayCodecTests``: the conformance suite for a codec that takes whole KV blocks.

Subclasses provide an ``codec`` fixture (an ``ArrayCodec``) and may override
``block`` with real sample data. The suite checks bit-exact round trips for
every dtype the codec supports and many shapes (empty, one token, odd sizes,
strided views), decoding into a caller's array, config round trips, and that
truncated or flipped chunks raise ``DecodeError`` or decode to other values,
never crash or write outside the output.
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from kvtool.codecs import ArrayCodec, codec_from_config
from kvtool.errors import DecodeError, UsageError
from kvtool.testing.data import kv_like_bf16

DTYPES = {
    "bf16": ml_dtypes.bfloat16,
    "fp16": np.float16,
    "fp32": np.float32,
    "fp8_e4m3": ml_dtypes.float8_e4m3fn,
    "fp8_e5m2": ml_dtypes.float8_e5m2,
}
SHAPES = [(3, 257, 64), (1, 1, 1), (2, 0, 8), (0, 4, 4), (1, 5, 3), (4, 33, 7), (2, 1000, 1)]


def bits_of(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array).view(f"u{array.itemsize}")


class ArrayCodecTests:
    """Base class; subclasses define a ``codec`` fixture returning an ``ArrayCodec``."""

    @pytest.fixture
    def codec(self) -> ArrayCodec:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError("subclasses of ArrayCodecTests provide a `codec` fixture")

    @pytest.fixture
    def block(self) -> np.ndarray:
        """The bf16 block the tests start from; subclasses may return real sample data."""
        return kv_like_bf16()

    @staticmethod
    def round_trip(codec: ArrayCodec, block: np.ndarray) -> np.ndarray:
        encoded = codec.encode_array(block)
        assert isinstance(encoded, bytes)
        decoded = codec.decode_array(encoded, block.shape, block.dtype)
        assert decoded.shape == block.shape and decoded.dtype == block.dtype
        return decoded

    @pytest.mark.parametrize("dtype", list(DTYPES))
    def test_round_trip_every_dtype(self, codec: ArrayCodec, block: np.ndarray, dtype: str):
        cast = block.astype(np.float32).astype(DTYPES[dtype])
        if not codec.supports(cast.dtype):
            with pytest.raises(UsageError):
                codec.encode_array(cast)
            return
        assert np.array_equal(bits_of(self.round_trip(codec, cast)), bits_of(cast))

    @pytest.mark.parametrize("shape", SHAPES)
    def test_shapes(self, codec: ArrayCodec, shape):
        block = kv_like_bf16(heads=shape[0], tokens=shape[1], dim=shape[2], seed=sum(shape))
        assert np.array_equal(bits_of(self.round_trip(codec, block)), bits_of(block))

    def test_special_values(self, codec: ArrayCodec):
        """Zeros, signed zeros, subnormals, infinities and NaN payloads are bits like any other."""
        bits = np.array([0, 0x8000, 1, 0x807F, 0x7F80, 0xFF80, 0x7FC1, 0xFFFF, 0x3F80, 0x0080], np.uint16)
        block = np.tile(bits, 7).reshape(1, 7, 10).view(ml_dtypes.bfloat16)
        assert np.array_equal(bits_of(self.round_trip(codec, block)), bits_of(block))

    def test_constant_block(self, codec: ArrayCodec):
        block = np.zeros((2, 64, 16), ml_dtypes.bfloat16)
        assert np.array_equal(bits_of(self.round_trip(codec, block)), bits_of(block))

    def test_strided_views(self, codec: ArrayCodec, block: np.ndarray):
        for view in (block[:, 5:77, :], block[::2], block[:, ::3, :], block.transpose(0, 2, 1)):
            assert np.array_equal(bits_of(self.round_trip(codec, view)), bits_of(view))

    def test_decode_into_a_given_array(self, codec: ArrayCodec, block: np.ndarray):
        out = np.full(block.shape, 7, block.dtype)
        result = codec.decode_array(codec.encode_array(block), block.shape, block.dtype, out=out)
        assert result is out and np.array_equal(bits_of(out), bits_of(block))
        with pytest.raises(UsageError):
            codec.decode_array(codec.encode_array(block), block.shape, block.dtype, out=out[:, :-1])

    def test_config_round_trip(self, codec: ArrayCodec):
        config = codec.get_config()
        assert config["id"] == codec.codec_id
        assert json.loads(json.dumps(config)) == config
        assert codec_from_config(config) == codec

    def test_plain_bytes_are_refused(self, codec: ArrayCodec):
        with pytest.raises(UsageError):
            codec.encode(b"plain bytes")

    def test_wrong_geometry_is_an_error(self, codec: ArrayCodec, block: np.ndarray):
        encoded = codec.encode_array(block)
        heads, tokens, dim = block.shape
        for shape in [(heads, tokens + 1, dim), (heads, tokens - 1, dim), (heads + 1, tokens, dim)]:
            with pytest.raises(DecodeError):
                codec.decode_array(encoded, shape, block.dtype)

    def test_truncated_chunks(self, codec: ArrayCodec, block: np.ndarray):
        encoded = codec.encode_array(block)
        for cut in sorted({0, 1, 2, len(encoded) // 2, len(encoded) - 1}):
            with pytest.raises(DecodeError):
                codec.decode_array(encoded[:cut], block.shape, block.dtype)

    def test_bit_flips_never_crash(self, codec: ArrayCodec, block: np.ndarray):
        """A flipped chunk raises DecodeError or decodes to other values (the container's checksums catch those)."""
        encoded = codec.encode_array(block)
        rng = np.random.default_rng(11)
        for pos in sorted({0, 1, len(encoded) // 3, len(encoded) - 1, *rng.integers(0, len(encoded), 40).tolist()}):
            corrupt = bytearray(encoded)
            corrupt[pos] ^= 1 << int(rng.integers(0, 8))
            guard = np.full((block.shape[0] + 2,) + block.shape[1:], 3, block.dtype)
            try:
                codec.decode_array(bytes(corrupt), block.shape, block.dtype, out=guard[1:-1])
            except (DecodeError, UsageError):
                continue
            finally:
                # nothing written outside the output
                assert np.all(bits_of(guard[0]) == bits_of(np.full(block.shape[1:], 3, block.dtype)))
                assert np.all(bits_of(guard[-1]) == bits_of(np.full(block.shape[1:], 3, block.dtype)))
