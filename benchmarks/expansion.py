"""How far a token block of a real cache expands: raw bytes over stored bytes, all planes of a block together.

    python benchmarks/expansion.py 'exphuff' 'int:4|zstd:3' 'mant-round:0|bf16-split|zstd:3' ...

For each recipe, both samples cut into 16-, 256- and 1024-token chunks; prints the largest
ratio of any block. The readers' default ``max_expansion`` (kvtool/kvz/format.py) must stay far above it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from kvtool.cache import KVCache
from kvtool.kvz import KvzReader, encode_cache

SAMPLES = Path(__file__).resolve().parents[1] / "samples"


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    caches = [KVCache.load(SAMPLES / name) for name in ("code.safetensors", "prose.safetensors")]
    for spec in sys.argv[1:]:
        worst = 0.0
        for cache in caches:
            for chunk in (16, 256, 1024):
                index = KvzReader.from_bytes(encode_cache(cache, spec, chunk_tokens=chunk, threads=1)).index
                _, block = np.unique(index["tensor"].astype(np.int64) << 32 | index["token_start"], return_inverse=True)
                raw = np.bincount(block, index["raw_len"].astype(float))
                stored = np.bincount(block, index["stored_len"].astype(float))
                worst = max(worst, float((raw / stored).max()))
        print(f"{worst:8.1f}  {spec}", flush=True)


if __name__ == "__main__":
    main()
