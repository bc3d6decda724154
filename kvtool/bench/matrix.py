"""Run recipes over caches through the .kvz container and measure them.

For each (cache, recipe): the .kvz bytes once, for the ratio and the sizes per
K/V, layer and plane (``KvzReader.sizes()``), checked to decode to the same
bits (a lossy recipe: to values within its stated error bound, and labelled
lossy); then compression and decompression timed, best of ``repeat``, on one
thread and on ``threads``. Compression writes to a sink that only counts, so
what is timed is the container's work (layout, codecs, checksums, index) and
not the growth of an output buffer. Throughput is MB/s of original data
(10**6 bytes); CPU time (``time.process_time``, all threads) is per GB of
original data, from the single-thread runs.

A recipe that cannot run here is a result too: ``unavailable`` (a codec's
library is missing) or ``not applicable`` (the recipe does not fit the
cache's dtype), with the reason.
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Callable, Sequence, cast

from kvtool.bench import peers as peer_tools
from kvtool.bench.bounds import entropy_limits
from kvtool.cache import KVCache
from kvtool.kvz import DEFAULT_CHUNK_TOKENS, KvzReader, encode_cache, write_cache
from kvtool.errors import KvtoolError, UnavailableError
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import bound_violation
from kvtool.recipe import Recipe

OK, UNAVAILABLE, NOT_APPLICABLE = "ok", "unavailable", "not applicable"


@dataclass
class Result:
    recipe: str  # a recipe spec, or "peer: NAME" for another tool on the same blocks
    status: str
    reason: str = ""
    lossy: bool = False  # decodes to an approximation within the recipe's stated bound, not the same bits
    raw_bytes: int = 0
    stored_bytes: int = 0
    ratio: float | None = None
    by_kind: dict[str, float] = field(default_factory=dict)  # original bytes over stored chunk bytes
    by_layer: dict[str, float] = field(default_factory=dict)
    by_plane: dict[str, float] = field(default_factory=dict)  # a plane's bytes over its stored bytes
    compress_mbps: dict[str, float] = field(default_factory=dict)  # by thread count, as a string for JSON
    decompress_mbps: dict[str, float] = field(default_factory=dict)
    compress_cpu_s_per_gb: float | None = None
    decompress_cpu_s_per_gb: float | None = None


@dataclass
class FileReport:
    path: str
    dtype: str
    layers: int
    tokens: int
    shape: list[int]
    raw_bytes: int
    limits: dict[str, dict[str, float | None]]
    results: list[Result]


@dataclass
class Report:
    machine: dict[str, Any]
    settings: dict[str, Any]
    files: list[FileReport]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _CountingSink:
    """A binary file that keeps nothing and counts what it is given."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        self.size += len(data)
        return len(data)


def machine() -> dict[str, Any]:
    """CPU model and core count, from /proc/cpuinfo where there is one."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version()}


def measure(
    cache: KVCache, spec: str, threads: int, repeat: int, chunk_tokens: int = DEFAULT_CHUNK_TOKENS
) -> Result:
    """One recipe on one cache: sizes, a bit-exact check, and best-of-``repeat`` timings."""
    try:
        recipe = Recipe.parse(spec)
    except UnavailableError as exc:
        return Result(spec, UNAVAILABLE, str(exc))
    missing = [
        f"{c.codec_id}: {c.available().reason}"
        for c in {recipe.codec, *recipe.plane_codecs.values()}
        if not c.available().ok
    ]
    if missing:
        return Result(spec, UNAVAILABLE, "; ".join(sorted(missing)))
    try:
        if cache.keys:
            recipe.plan(PlaneSpec.of(cache.keys[0][:, :1]))
    except KvtoolError as exc:
        return Result(spec, NOT_APPLICABLE, str(exc))

    original: dict[str, dict] = {"kind": {}, "layer": {}}
    for layer, kind, array in cache.tensors():
        original["kind"][kind] = original["kind"].get(kind, 0) + array.nbytes
        original["layer"][layer] = original["layer"].get(layer, 0) + array.nbytes
    blob = encode_cache(cache, recipe, chunk_tokens=chunk_tokens, threads=1)
    with KvzReader.from_bytes(blob) as reader:
        sizes = reader.sizes()
        restored = reader.read(threads=1)
    if recipe.lossy:
        violation = bound_violation(cache.tensors(), [a for _, _, a in restored.tensors()], recipe.layouts, chunk_tokens)
        if violation:
            raise KvtoolError(f"lossy recipe {spec!r} strays beyond its error bound: {violation}")
    elif not restored.equal_bits(cache):
        raise KvtoolError(f"recipe {spec!r} did not round-trip bit for bit")
    result = Result(
        spec, OK,
        lossy=recipe.lossy,
        raw_bytes=sizes["total"]["raw"],
        stored_bytes=len(blob),
        ratio=round(cache.nbytes / len(blob), 4),
        by_kind=_ratios(original["kind"], sizes["by_kind"]),
        by_layer=_ratios(original["layer"], sizes["by_layer"]),
        by_plane={k: round(v["ratio"], 4) for k, v in sizes["by_plane"].items()},
    )
    gigabytes = cache.nbytes / 1e9
    for n in sorted({1, threads}):
        wall, cpu = _best(partial(_encode, cache, recipe, chunk_tokens, n), repeat)
        result.compress_mbps[str(n)] = _megabytes_per_second(cache.nbytes, wall)
        if n == 1:
            result.compress_cpu_s_per_gb = round(cpu / gigabytes, 3)
        wall, cpu = _best(partial(_decode, blob, n), repeat)
        result.decompress_mbps[str(n)] = _megabytes_per_second(cache.nbytes, wall)
        if n == 1:
            result.decompress_cpu_s_per_gb = round(cpu / gigabytes, 3)
    return result


def _megabytes_per_second(nbytes: int, seconds: float) -> float:
    """MB/s to three significant digits, so a slow run on a loaded machine reads 0.0412, not 0.0."""
    return float(f"{nbytes / max(seconds, 1e-9) / 1e6:.3g}")


def measure_peer(cache: KVCache, peer: peer_tools.Peer, repeat: int, chunk_tokens: int) -> Result:
    """Another tool on the cache's blocks, one thread: ratio, MB/s and CPU s/GB, checked to give the bytes back."""
    name = f"peer: {peer.name}"
    codec = peer_tools.build(peer, cache)
    if isinstance(codec, str):
        return Result(name, UNAVAILABLE if "not installed" in codec else NOT_APPLICABLE, codec)
    compress, decompress = codec
    blocks = peer_tools.blocks_of(cache, chunk_tokens)
    stored = [compress(b) for b in blocks]
    if any(bytes(decompress(s)) != b for s, b in zip(stored, blocks)):
        raise KvtoolError(f"{name} did not give the bytes back")
    size = sum(len(s) for s in stored)
    gigabytes = cache.nbytes / 1e9
    c_wall, c_cpu = _best(lambda: [compress(b) for b in blocks], repeat)
    d_wall, d_cpu = _best(lambda: [decompress(s) for s in stored], repeat)
    return Result(
        name, OK, raw_bytes=cache.nbytes, stored_bytes=size, ratio=round(cache.nbytes / size, 4),
        compress_mbps={"1": _megabytes_per_second(cache.nbytes, c_wall)},
        decompress_mbps={"1": _megabytes_per_second(cache.nbytes, d_wall)},
        compress_cpu_s_per_gb=round(c_cpu / gigabytes, 3), decompress_cpu_s_per_gb=round(d_cpu / gigabytes, 3),
    )


def _ratios(original: dict, stored: dict) -> dict[str, float]:
    """Original bytes over stored chunk bytes, per group (planes may be larger than the data they hold)."""
    return {str(key): round(original[key] / group["stored"], 4) for key, group in stored.items() if group["stored"]}


def _encode(cache: KVCache, recipe: Recipe, chunk_tokens: int, threads: int) -> None:
    write_cache(cast(BinaryIO, _CountingSink()), cache, recipe, chunk_tokens, threads=threads)


def _decode(blob: bytes, threads: int) -> None:
    with KvzReader.from_bytes(blob) as reader:
        reader.read(threads=threads)


def _best(run: Callable[[], Any], repeat: int) -> tuple[float, float]:
    """The shortest wall time and the shortest CPU time of ``repeat`` runs."""
    walls, cpus = [], []
    for _ in range(max(1, repeat)):
        wall, cpu = time.perf_counter(), time.process_time()
        run()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return max(min(walls), 1e-9), min(cpus)


def run_bench(
    paths: Sequence[Path],
    recipes: Callable[[KVCache], list[str]],
    threads: int | None = None,
    repeat: int = 3,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    on_step: Callable[[str], None] | None = None,
    peers: bool = True,
) -> Report:
    """Every recipe ``recipes(cache)`` names, on every cache file, with the cache's entropy limits,
    and after them the other tools (``peers``) on the same blocks."""
    threads = threads or os.cpu_count() or 1
    files = []
    for path in paths:
        cache = KVCache.load(path)
        results = []
        for spec in recipes(cache):
            results.append(measure(cache, spec, threads, repeat, chunk_tokens))
            if on_step:
                on_step(f"{Path(path).name} {spec}")
        for peer in peer_tools.PEERS if peers else ():
            results.append(measure_peer(cache, peer, repeat, chunk_tokens))
            if on_step:
                on_step(f"{Path(path).name} {peer.name}")
        files.append(
            FileReport(
                str(path), cache.dtype.name, cache.num_layers, cache.num_tokens,
                list(cache.keys[0].shape) if cache.keys else [], cache.nbytes, entropy_limits(cache), results,
            )
        )
    settings = {"threads": threads, "repeat": repeat, "chunk_tokens": chunk_tokens, "peers": peers}
    return Report(machine(), settings, files)
