"""The int stage's codes plane alone: zstd:3 of the packed codes against codes=ctx (BENCHMARKS.md, "Lossy recipes").

    python benchmarks/int_codes_planes.py samples/prose.safetensors [BITS ...]

Every tensor in 256-token blocks with ``int:BITS,group=64``; per kind, the codes' bytes relative to
their packed size: zstd:3 of the packed plane, the codes=ctx plane up to its zero tail, and zstd:3 of
that plane (what a codes=ctx recipe stores); and how many blocks named repeated rows.
"""

from __future__ import annotations

import sys

import numpy as np
import zstandard

from kvtool.cache import KVCache
from kvtool.layouts.int_quant import IntQuant


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cache = KVCache.load(sys.argv[1])
    zstd = zstandard.ZstdCompressor(level=3)
    for bits in [int(b) for b in sys.argv[2:]] or [3, 4, 5, 6]:
        for kind, tensors in (("keys", cache.keys), ("values", cache.values)):
            packed = zstd_packed = coded = zstd_coded = blocks = repeats = 0
            for tensor in tensors:
                for start in range(0, tensor.shape[1], 256):
                    block = np.ascontiguousarray(tensor[:, start : start + 256])
                    plain = IntQuant(bits, group=64).for_kind(kind[0]).forward_plane(block)[0]
                    plane = IntQuant(bits, group=64, codes="ctx").for_kind(kind[0]).forward_plane(block)[0]
                    nonzero = np.flatnonzero(plane)
                    packed += plain.size
                    zstd_packed += len(zstd.compress(plain.tobytes()))
                    coded += int(nonzero[-1]) + 1 if nonzero.size else 1
                    zstd_coded += len(zstd.compress(plane.tobytes()))
                    blocks += 1
                    repeats += bool(plane[0] == 1 and plane[10:14].any())
            print(f"int:{bits} {kind:6s}  zstd:3 {zstd_packed / packed:.3f}  codes=ctx {coded / packed:.3f}  "
                  f"codes=ctx then zstd:3 {zstd_coded / packed:.3f}  ({repeats} of {blocks} blocks name repeated rows)")


if __name__ == "__main__":
    main()
