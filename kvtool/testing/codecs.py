"""``CodecTests``: the conformance suite for a codec.

Subclasses provide a ``codec`` fixture. The suite checks a bit-exact round trip
on every buffer type and many sizes, config round trips through the registry,
the output cap, and that truncated or flipped input raises ``DecodeError``
(for codecs whose format carries a checksum) instead of crashing or returning
silently wrong bytes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtool.codecs import BufferLike, Codec, codec_from_config
from kvtool.errors import DecodeError
from kvtool.testing.data import kv_like_bf16

SIZES = [0, 1, 2, 3, 7, 255, 4096, 65_537, 1_000_003, 4 * 1024 * 1024 + 5]


def _payload(size: int, seed: int = 1) -> bytes:
    """Compressible but not trivial bytes: KV-like bf16 with a random tail."""
    kv = kv_like_bf16(tokens=max(1, size // 384 + 1), seed=seed).tobytes()
    reps = size // len(kv) + 1
    return (kv * reps)[:size]


def require_available(*specs: Codec | str) -> None:
    """Skip the calling test, with the codec's own reason, where a codec cannot run here.

    ``specs`` are codecs, codec specs (``qat:9``) or recipes (``byteplane|qat``,
    whose every codec is checked). A codec is unavailable when its library is
    missing (QATzip for ``qat``); the reason names what to install.
    """
    from kvtool.recipe import Recipe

    for spec in specs:
        if isinstance(spec, str):
            recipe = Recipe.parse(spec)
            codecs = [recipe.codec, *recipe.plane_codecs.values()]
        else:
            codecs = [spec]
        for codec in codecs:
            availability = type(codec).available()
            if not availability.ok:
                pytest.skip(f"codec {codec.codec_id!r} is unavailable here: {availability.reason}")


class CodecTests:
    """Base class; subclasses define a ``codec`` fixture returning a ``Codec``.

    Where the codec is unavailable (its library is missing), every test that
    encodes is skipped with the codec's reason; the decode-only tests still run.
    """

    #: Tests that never encode, so they run where the codec's library is missing.
    DECODE_ONLY = ("test_config_round_trip", "test_garbage_input")

    @pytest.fixture
    def codec(self) -> Codec:  # pragma: no cover - replaced by subclasses
        raise NotImplementedError("subclasses of CodecTests provide a `codec` fixture")

    @pytest.fixture(autouse=True)
    def _skip_where_unavailable(self, request, codec: Codec) -> None:
        if request.function.__name__ not in self.DECODE_ONLY:
            require_available(codec)

    @pytest.fixture
    def kv_bytes(self) -> bytes:
        """The data the round trip tests use; subclasses may return real samples."""
        return kv_like_bf16().tobytes()

    def test_available(self, codec: Codec):
        avail = type(codec).available()
        assert avail.ok, f"{codec.codec_id} unavailable: {avail.reason}"

    @pytest.mark.parametrize("size", SIZES)
    def test_round_trip_sizes(self, codec: Codec, size: int):
        data = _payload(size)
        encoded = codec.encode(data)
        assert isinstance(encoded, bytes)
        assert codec.decode(encoded, max_size=size) == data

    @pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy", "numpy-strided"])
    def test_buffer_types(self, codec: Codec, kind: str, kv_bytes: bytes):
        arr = np.frombuffer(kv_bytes, dtype=np.uint16).reshape(-1, 2)
        expected = kv_bytes
        buf: BufferLike
        if kind == "bytearray":
            buf = bytearray(kv_bytes)
        elif kind == "memoryview":
            buf = memoryview(kv_bytes)
        elif kind == "numpy":
            buf = arr
        elif kind == "numpy-strided":
            buf = arr[:, ::-1]  # not contiguous: encode must see the logical order
            expected = np.ascontiguousarray(buf).tobytes()
        else:
            buf = kv_bytes
        encoded = codec.encode(buf)
        assert codec.decode(encoded, max_size=len(expected)) == expected
        assert codec.decode(memoryview(encoded), max_size=len(expected)) == expected

    def test_real_kv_data(self, codec: Codec, kv_bytes: bytes):
        encoded = codec.encode(kv_bytes)
        assert codec.decode(encoded, max_size=len(kv_bytes)) == kv_bytes

    def test_config_round_trip(self, codec: Codec):
        config = codec.get_config()
        assert config["id"] == codec.config_id()
        assert json.loads(json.dumps(config)) == config
        rebuilt = codec_from_config(config)
        assert rebuilt == codec
        assert type(rebuilt).from_config(config).get_config() == config

    def test_decode_respects_max_size(self, codec: Codec, kv_bytes: bytes):
        encoded = codec.encode(kv_bytes)
        with pytest.raises(DecodeError):
            codec.decode(encoded, max_size=len(kv_bytes) - 1)

    def test_truncated_input(self, codec: Codec, kv_bytes: bytes):
        encoded = codec.encode(kv_bytes)
        for cut in sorted({1, len(encoded) // 2, len(encoded) - 1}):
            truncated = encoded[:cut]
            if codec.self_checking:
                with pytest.raises(DecodeError):
                    codec.decode(truncated, max_size=len(kv_bytes))
            else:
                assert codec.decode(truncated, max_size=len(kv_bytes)) != kv_bytes

    def test_bit_flips(self, codec: Codec, kv_bytes: bytes):
        encoded = codec.encode(kv_bytes)
        rng = np.random.default_rng(7)
        positions = {0, len(encoded) // 2, len(encoded) - 1, *rng.integers(0, len(encoded), 12).tolist()}
        for pos in sorted(positions):
            corrupt = bytearray(encoded)
            corrupt[pos] ^= 1 << int(rng.integers(0, 8))
            try:
                out = codec.decode(bytes(corrupt), max_size=len(kv_bytes))
            except DecodeError:
                continue
            # A checked format may only accept a flip that leaves the content intact
            # (a flag bit that does not matter); an unchecked one must not hide it.
            if codec.self_checking:
                assert out == kv_bytes, f"flip at byte {pos} decoded to different bytes without an error"
            else:
                assert out != kv_bytes

    @pytest.mark.parametrize("garbage", [b"", b"\x00", b"not compressed data at all" * 3])
    def test_garbage_input(self, codec: Codec, garbage: bytes):
        """Input that was never encoded raises DecodeError; only an unchecked codec may pass it through."""
        if codec.self_checking:
            with pytest.raises(DecodeError):
                codec.decode(garbage, max_size=1 << 16)
        else:
            assert codec.decode(garbage, max_size=1 << 16) == garbage
