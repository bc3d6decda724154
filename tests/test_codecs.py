"""Every registered codec through the shared conformance suite."""

from __future__ import annotations

import pytest

from kvtool.cache import KVCache
from kvtool.codecs import get_codec, registry
from kvtool.testing import ArrayCodecTests, CodecTests

SPECS = ["none", "zstd:1", "zstd:3", "zstd:-5", "zstd:huff", "lz4:0", "lz4:9", "zlib:1", "zlib:6", "gzip:1", "gzip:9", "qat", "isal:1", "rans:1", "rans:3"]
ARRAY_SPECS = ["exphuff", "exphuff-lanes", "exphuff-lanes:16", "ctxans", "ctxtans"]


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


def test_a_package_claiming_a_built_in_id_does_not_override_it(monkeypatch):
    """A third-party entry point named "zstd" must not change how zstd files decode: the built-in wins."""
    from importlib import metadata

    from kvtool import registry as registry_module
    from kvtool.codecs.zstd import ZstdCodec
    from kvtool.registry import ComponentRegistry

    impostor = metadata.EntryPoint(name="zstd", value="impostor.codecs:Zstd", group="kvtool.codecs")
    extra = metadata.EntryPoint(name="brotli", value="impostor.codecs:Brotli", group="kvtool.codecs")
    monkeypatch.setattr(registry_module.metadata, "entry_points", lambda group: [impostor, extra] if group == "kvtool.codecs" else [])
    fresh = ComponentRegistry("codec", "kvtool.codecs", {"zstd": "kvtool.codecs.zstd:ZstdCodec"})
    with pytest.warns(UserWarning, match="'zstd' is built into kvtool; the built-in is used"):
        assert fresh.ids() == ["brotli", "zstd"]
    assert fresh.get("zstd") is ZstdCodec
    codec = fresh.build("zstd:3")
    assert codec.decode(codec.encode(b"kv" * 500), max_size=1000) == b"kv" * 500
