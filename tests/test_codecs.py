"""Every registered codec through the shared conformance suite."""

from __future__ import annotations

import pytest

from kvtool.cache import KVCache
from kvtool.codecs import get_codec, registry
from kvtool.testing import ArrayCodecTests, CodecTests

SPECS = ["none", "zstd:1", "zstd:3", "zstd:-5", "zstd:huff", "lz4:0", "lz4:9", "zlib:1", "zlib:6", "qat", "isal:1", "rans:1", "rans:3"]
ARRAY_SPECS = ["exphuff", "ctxans"]


def test_every_registered_codec_is_covered():
    assert {spec.partition(":")[0] for spec in SPECS + ARRAY_SPECS} == set(registry.ids())


class TestArrayCodecs(ArrayCodecTests):
    @pytest.fixture(params=ARRAY_SPECS)
    def codec(self, request):
        return get_codec(request.param)

    @pytest.fixture
    def block(self, samples):
        return KVCache.load(samples[0], layers=[5]).keys[0]


class TestRegisteredCodecs(CodecTests):
    @pytest.fixture(params=SPECS)
    def codec(self, request):
        return get_codec(request.param)
