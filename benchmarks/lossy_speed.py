"""How fast lossy recipes restore, against the lossless default (BENCHMARKS.md, "Lossy recipes", "Speed").

    python benchmarks/lossy_speed.py out/code-4096.safetensors exphuff 'int:6,group=64|zstd:3'
    KVTOOL_NATIVE=0 python benchmarks/lossy_speed.py ...   # the numpy reference

Each recipe's .kvz (256-token chunks, as the store keeps them) is written once and read three
times, on one thread, into fresh memory; CPU seconds per GB of cache, so a busy machine moves
them less.
"""

from __future__ import annotations

import sys
import time

from kvtool.cache import KVCache
from kvtool.kvz import KvzReader, encode_cache


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    cache = KVCache.load(sys.argv[1])
    for spec in sys.argv[2:]:
        started = time.process_time()
        blob = encode_cache(cache, spec, chunk_tokens=256, threads=1)
        encode = (time.process_time() - started) / cache.nbytes * 1e9
        runs = []
        for _ in range(3):
            reader = KvzReader.from_bytes(blob)
            started = time.process_time()
            reader.read(threads=1)
            runs.append((time.process_time() - started) / cache.nbytes * 1e9)
        print(f"{spec:24s} ratio {cache.nbytes / len(blob):.3f}  write {encode:.2f}  restore "
              + " / ".join(f"{r:.2f}" for r in runs) + " CPU s/GB, one thread")


if __name__ == "__main__":
    main()
