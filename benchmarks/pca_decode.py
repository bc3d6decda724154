"""The pca stage's decoder alone: CPU seconds per GB of its blocks, without the container, the codec or a store.

    python benchmarks/pca_decode.py out/GPL-3.safetensors out/basis-without-GPL-3.kvd 0.32 0.8
    for tree in BEFORE AFTER; do PYTHONPATH=$tree python benchmarks/pca_decode.py ...; done   # two trees compared

256-token blocks of the cache's first 1024 tokens, layers 0, 10, 20 and 29, keys and values, coded once
per step; then every block restored through the stage's ``inverse_plane_into`` (the C decoder where the core
is built) five times; the median is printed beside the five.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvtool.cache import KVCache
from kvtool.layouts import get_layout
from kvtool.layouts.base import PlaneSpec
from kvtool.modeldict import registry

LAYERS = [0, 10, 20, 29]
TOKENS, BLOCK = 1024, 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache")
    parser.add_argument("dictionary", help="a transform dictionary (.kvd) of the cache's model")
    parser.add_argument("steps", nargs="+", type=float)
    args = parser.parse_args()
    dictionary = registry.load(args.dictionary)
    cache = KVCache.load(args.cache, tokens=slice(0, TOKENS), layers=LAYERS)
    for step in args.steps:
        blocks = []
        for layer, kind, tensor in cache.tensors():
            for start in range(0, tensor.shape[1], BLOCK):
                block = np.ascontiguousarray(tensor[:, start : start + BLOCK])
                stage = get_layout(f"pca:{dictionary.id},step={step}").for_kind(kind, layer).for_block(start, TOKENS)
                blocks.append((stage, stage.forward_plane(block), PlaneSpec.of(block), np.empty_like(block)))
        nbytes = sum(out.nbytes for *_, out in blocks)
        runs = []
        for _ in range(5):
            started = time.process_time()
            for stage, planes, spec, out in blocks:
                stage.inverse_plane_into(planes, spec, out)
            runs.append((time.process_time() - started) / nbytes * 1e9)
        print(f"step={step}: decode {statistics.median(runs):.2f} CPU s/GB (" + " ".join(f"{r:.2f}" for r in runs) + ")")


if __name__ == "__main__":
    main()
