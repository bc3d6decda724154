"""How much an order-0 entropy coder would gain over zstd on the int stage's codes, with and without outliers.

    python benchmarks/outlier_entropy.py samples/prose.safetensors 'int:3,group=128' 'outliers:0.01|int:3,group=128'

For every 256-token block of every tensor: the codes plane through zstd level 3 against
the order-0 entropy of the block's codes (its own histogram, the table not counted);
the other planes (scales, outliers) are counted through zstd:3 in both columns. Prints
one row per chain and kind: bits per value of each, what the entropy coder saves, and
for a chain with outliers how much of each row's range is left (the median row's kept
range over its full range, averaged over the blocks).
"""

from __future__ import annotations

import sys

import numpy as np
import zstandard

from kvtool.cache import KVCache
from kvtool.layouts import parse_layouts
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.int_quant import _unpack
from kvtool.layouts.lossy import SideChannel

CHUNK = 256


def kept_range(side: SideChannel, block: np.ndarray) -> float:
    """The median over ``block``'s rows of the kept range over the full range."""
    dense, _ = side.split(block)
    axis = 1 if side.axis == "channel" else 2
    full, kept = (np.ptp(b.astype(np.float64), axis=axis) for b in (block, dense))
    return float(np.median(kept[full > 0] / full[full > 0]))


def measure(cache: KVCache, spec: str) -> dict[str, tuple[float, float, float, float]]:
    chain = parse_layouts(spec)
    zstd = zstandard.ZstdCompressor(level=3)
    sums: dict[str, list[float]] = {"k": [0, 0, 0, 0], "v": [0, 0, 0, 0]}  # values, zstd codes, entropy codes, other planes
    ranges: dict[str, list[float]] = {"k": [], "v": []}
    for layer, kind, array in cache.tensors():
        bound = chain.for_kind(kind, layer)
        quant = bound[len(bound) - 1]
        for start in range(0, array.shape[1], CHUNK):
            block = array[:, start : start + CHUNK]
            planes = bound.forward([block])
            names = [p.name for p in bound.plan([PlaneSpec.of(block)])]
            codes = planes[names.index("codes")]
            values = _unpack(codes, block.size, quant.code_bits)
            counts = np.bincount(values, minlength=1 << quant.code_bits)
            p = counts[counts > 0] / values.size
            total = sums[kind]
            total[0] += block.size
            total[1] += 8 * len(zstd.compress(codes.tobytes()))
            total[2] += float(-(p * np.log2(p)).sum() * values.size)
            if isinstance(bound[0], SideChannel) and bound[0].axis != "none":
                ranges[kind].append(kept_range(bound[0], block))
            total[3] += sum(8 * len(zstd.compress(np.ascontiguousarray(pl).tobytes())) for n, pl in zip(names, planes) if n != "codes")
    return {kind: (z / n, h / n, o / n, float(np.mean(ranges[kind])) if ranges[kind] else 1.0) for kind, (n, z, h, o) in sums.items()}


def main(path: str, specs: list[str]) -> None:
    cache = KVCache.load(path)
    print("| chain | kind | codes, zstd:3 (bits/value) | codes, order-0 entropy | other planes, zstd:3 | ratio zstd | ratio entropy "
          "| entropy coder saves | kept range |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in specs:
        for kind, (z, h, o, kept) in measure(cache, spec).items():
            bits = 8 * cache.dtype.itemsize
            print(f"| `{spec}` | {kind.upper()} | {z:.3f} | {h:.3f} | {o:.3f} | {bits / (z + o):.2f} | {bits / (h + o):.2f} | "
                  f"{100 * (1 - (h + o) / (z + o)):.1f}% | {kept:.3f} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
