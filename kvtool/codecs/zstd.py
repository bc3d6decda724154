"""Zstandard, through the ``zstandard`` package (libzstd).

Frames are written with their content size and a checksum, so decode can refuse
an oversized frame before allocating and detects corruption.

Encoder tuning (``strategy``, ``min_match``, ``hash_log``, ``window_log``)
overrides what the level picks; it changes speed and ratio, never the format:
every frame is plain zstd. The ``huff`` preset (``zstd:huff``) is for planes
that are low in entropy but have few repeats, such as a float exponent plane:
the fast strategy with a minimum match of 7 and a tiny hash table finds almost
no matches, so the time goes to zstd's Huffman literal coder.
"""

from __future__ import annotations

import threading
from typing import Any

import zstandard

from kvtool.codecs.base import Availability, BufferLike, Codec, as_memoryview, check_output_size
from kvtool.errors import DecodeError, UsageError


STRATEGIES = {
    "fast": zstandard.STRATEGY_FAST,
    "dfast": zstandard.STRATEGY_DFAST,
    "greedy": zstandard.STRATEGY_GREEDY,
    "lazy": zstandard.STRATEGY_LAZY,
    "lazy2": zstandard.STRATEGY_LAZY2,
    "btlazy2": zstandard.STRATEGY_BTLAZY2,
    "btopt": zstandard.STRATEGY_BTOPT,
    "btultra": zstandard.STRATEGY_BTULTRA,
    "btultra2": zstandard.STRATEGY_BTULTRA2,
}
#: Encoder parameters and their allowed ranges; ``None`` leaves the level's choice.
TUNING = {
    "min_match": (zstandard.MINMATCH_MIN, zstandard.MINMATCH_MAX),
    "hash_log": (zstandard.HASHLOG_MIN, zstandard.HASHLOG_MAX),
    "window_log": (zstandard.WINDOWLOG_MIN, zstandard.WINDOWLOG_MAX),
}
#: How much one input byte can become: a 4-byte block of one repeated byte stands for 128 KiB.
_MAX_EXPANSION = 1 << 15
#: Named tunings a spec can use in place of a level (``zstd:huff``).
PRESETS: dict[str, dict[str, Any]] = {"huff": {"level": 1, "strategy": "fast", "min_match": 7, "hash_log": 6, "window_log": 17}}


def _tuning(name: str, value: int | None) -> int | None:
    """An encoder parameter checked against its range in ``TUNING``; None leaves the level's choice."""
    low, high = TUNING[name]
    if value is not None and not low <= int(value) <= high:
        raise UsageError(f"zstd {name} must be in {low}..{high}, not {value}")
    return None if value is None else int(value)


class ZstdCodec(Codec):
    codec_id = "zstd"
    params = ("level", "threads", "strategy", *TUNING)
    magic = b"\x28\xb5\x2f\xfd"
    plane_batch = True  # zstandard releases the GIL while it decompresses

    def __init__(
        self,
        level: int = 3,
        threads: int = 0,
        strategy: str | None = None,
        min_match: int | None = None,
        hash_log: int | None = None,
        window_log: int | None = None,
    ):
        lo, hi = -(1 << 17), zstandard.MAX_COMPRESSION_LEVEL
        if not lo <= int(level) <= hi:
            raise UsageError(f"zstd level must be in {lo}..{hi}, not {level}")
        if int(threads) < 0:
            raise UsageError(f"zstd threads must be >= 0, not {threads}")
        if strategy is not None and strategy not in STRATEGIES:
            raise UsageError(f"zstd strategy must be one of {', '.join(STRATEGIES)}, not {strategy!r}")
        self.level = int(level)
        self.threads = int(threads)
        self.strategy = strategy
        self.min_match = _tuning("min_match", min_match)
        self.hash_log = _tuning("hash_log", hash_log)
        self.window_log = _tuning("window_log", window_log)
        self._local = threading.local()  # zstd contexts are not thread-safe

    @classmethod
    def from_spec_arg(cls, arg: str) -> "ZstdCodec":
        """``zstd:LEVEL`` or ``zstd:PRESET`` (a name from ``PRESETS``)."""
        if arg in PRESETS:
            return cls(**PRESETS[arg])
        try:
            return cls(level=int(arg))
        except ValueError:
            raise UsageError(f"codec 'zstd': give a level or one of {', '.join(PRESETS)}, not {arg!r}") from None

    def get_config(self) -> dict:
        """The level and threads, plus only the tuning parameters that are set."""
        config = super().get_config()
        return {k: v for k, v in config.items() if v is not None}

    def spec(self) -> str:
        tuning = {k: v for k, v in self.get_config().items() if k not in ("id", "threads")}
        preset = next((name for name, p in PRESETS.items() if p == tuning and self.threads == 0), None)
        return f"zstd:{preset}" if preset else super().spec()

    def _tuned(self) -> bool:
        return self.strategy is not None or any(v is not None for v in (self.min_match, self.hash_log, self.window_log))

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, implementation=f"libzstd {zstandard.ZSTD_VERSION[0]}.{zstandard.ZSTD_VERSION[1]}.{zstandard.ZSTD_VERSION[2]} ({zstandard.backend})")

    def _cctx(self) -> zstandard.ZstdCompressor:
        cctx = getattr(self._local, "cctx", None)
        if cctx is None:
            if self._tuned():
                base = zstandard.ZstdCompressionParameters.from_level(self.level)
                params = zstandard.ZstdCompressionParameters(
                    window_log=self.window_log or base.window_log,
                    chain_log=base.chain_log,
                    hash_log=self.hash_log or base.hash_log,
                    search_log=base.search_log,
                    min_match=self.min_match or base.min_match,
                    target_length=base.target_length,
                    strategy=STRATEGIES[self.strategy] if self.strategy else base.strategy,
                    threads=self.threads,
                    write_checksum=True,
                    write_content_size=True,
                )
                cctx = zstandard.ZstdCompressor(compression_params=params)
            else:
                cctx = zstandard.ZstdCompressor(
                    level=self.level, threads=self.threads, write_checksum=True, write_content_size=True
                )
            self._local.cctx = cctx
        return cctx

    def _dctx(self) -> zstandard.ZstdDecompressor:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def encode(self, buf: BufferLike) -> bytes:
        return self._cctx().compress(as_memoryview(buf))

    def decode(self, buf: BufferLike, max_size: int) -> bytes:
        view = as_memoryview(buf)
        try:
            size = zstandard.frame_content_size(view)
        except zstandard.ZstdError as exc:
            raise DecodeError(f"not a zstd frame: {exc}") from None
        try:
            if size >= 0:
                check_output_size(size, max_size)
                return self._dctx().decompress(view, allow_extra_data=False)
            return self._decode_unknown_size(view, max_size)
        except zstandard.ZstdError as exc:
            raise DecodeError(f"corrupt zstd data: {exc}") from None

    def _decode_unknown_size(self, view: memoryview, max_size: int) -> bytes:
        """A frame without its content size (a stream from another tool), decoded in steps.

        libzstd's own cap would reserve all of ``max_size`` up front. The input
        is fed in slices small enough that one slice cannot expand far past
        what ``max_size`` still allows.
        """
        dobj = self._dctx().decompressobj()
        out, pos = bytearray(), 0
        while pos < len(view) and not dobj.eof:
            step = max(64, min(1 << 16, (max_size - len(out)) // _MAX_EXPANSION))
            out += dobj.decompress(view[pos : pos + step])
            pos += step
            check_output_size(len(out), max_size)
        if not dobj.eof:
            raise DecodeError("truncated zstd data")
        if dobj.unused_data or pos < len(view):
            raise DecodeError("trailing data after the zstd frame")
        return bytes(out)
