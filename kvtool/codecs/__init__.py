"""Codecs: lossless bytes-to-bytes compressors, found through a registry.

>>> from kvtool.codecs import get_codec
>>> codec = get_codec("zstd:3")
>>> codec.decode(codec.encode(b"abc" * 100), max_size=300) == b"abc" * 100
True
"""

from __future__ import annotations

from typing import Any

from kvtool.codecs.base import ArrayCodec, Availability, BufferLike, Codec
from kvtool.registry import ComponentRegistry

registry: ComponentRegistry[Codec] = ComponentRegistry(
    "codec",
    "kvtool.codecs",
    {
        "none": "kvtool.codecs.none:NoneCodec",
        "zstd": "kvtool.codecs.zstd:ZstdCodec",
        "lz4": "kvtool.codecs.lz4:Lz4Codec",
        "zlib": "kvtool.codecs.zlib:ZlibCodec",
        "gzip": "kvtool.codecs.gzip:GzipCodec",
        "qat": "kvtool.codecs.qat:QatCodec",  # gzip through QATzip, forced; "qat" configs of older files

        "isal": ("kvtool.codecs.isal:IsalCodec", "isal"),  # gzip through ISA-L, forced; older "isal" configs
        "rans": ("kvtool.codecs.rans:RansCodec", "rans"),
        "exphuff": "kvtool.codecs.exphuff:ExpHuffCodec",
        "exphuff-lanes": "kvtool.codecs.exphuff_lanes:ExpHuffLanesCodec",
        "ctxans": "kvtool.codecs.ctxans:CtxAnsCodec",
        "ctxtans": "kvtool.codecs.ctxtans:CtxTansCodec",
    },
)


def get_codec(spec: str) -> Codec:
    """Build a codec from a spec: ``ID`` or ``ID:ARG``."""
    return registry.build(spec)


def codec_from_config(config: Any) -> Codec:
    """Rebuild a codec from its ``get_config()`` output, through the registry only."""
    return registry.from_config(config)


def sniff_codec(head: bytes) -> Codec | None:
    """The codec whose stream magic starts ``head``, if any (decoding needs no optional library)."""
    for id_ in registry.ids():
        try:
            cls = registry.get(id_)
        except Exception:  # noqa: BLE001, S112 - a broken plug-in must not stop recognising the others
            continue
        if cls.magic and head.startswith(cls.magic):
            return cls()
    return None


__all__ = ["ArrayCodec", "Availability", "BufferLike", "Codec", "codec_from_config", "get_codec", "registry", "sniff_codec"]
