"""Compress a folder of KV cache dumps with kvtool's library API, then read parts back.

    python examples/pipeline.py samples/*.safetensors --out out/pipeline

Each cache is saved as a .kvz with a recipe; then only layer 7 and the first 128
tokens of each are read back, touching only the chunks that hold them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import kvtool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("caches", nargs="+", type=Path, help="safetensors KV caches (kvtool dumps)")
    parser.add_argument("--out", type=Path, default=Path("out/pipeline"), help="folder for the .kvz files")
    parser.add_argument("--recipe", default=kvtool.DEFAULT_RECIPE, help="layouts|codec, e.g. 'byteplane|zstd:1'")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    for path, cache in kvtool.iter_caches(args.caches):
        target = args.out / f"{path.stem}.kvz"
        size = kvtool.save(cache, target, recipe=args.recipe)
        print(f"{path.name}: {cache.num_tokens} tokens, {cache.nbytes / size:.3f}x -> {target}")

        part = kvtool.load(target, layers=[7], tokens=slice(0, 128))
        assert part.equal_bits(cache.select(layers=[7], tokens=slice(0, 128)))
        with kvtool.open_kvz(target) as reader:
            reader.read(layers=[7], tokens=slice(0, 128))
            print(f"  layer 7, tokens 0-127: read {reader.bytes_read} of {size} bytes")


if __name__ == "__main__":
    main()
