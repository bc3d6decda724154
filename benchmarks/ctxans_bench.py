"""ctxans against its bounds: model dictionaries trained on the same and on the other text.

    python benchmarks/ctxans_bench.py out/code-4096.safetensors out/prose-4096.safetensors --repeat 3 \
        [--third out/psf-4096.safetensors]

The caches are two texts of one model and dtype. For each text a dictionary is learnt
(``kvtool.modeldict.train``, 256-token blocks, as ``kvtool train`` does); every cache is
then coded with ``ctxans`` and the dictionary of its own text ("same") and of the other
text ("other"), and of a third text when ``--third`` gives one, at 256-token chunks (what
the store keeps) and at one chunk per tensor, next to ``exphuff`` (the default recipe)
and the best order-0 recipe. Encode and decode
run on one thread through ``kvtool.kvz`` exactly as ``kvtool compress`` does; speed
is CPU time (``time.process_time``), the least of ``--repeat`` runs, per GB (10^9 bytes)
of original data. Every result is decoded and compared bit for bit.

Bounds (``kvtool.bench.bounds``, plug-in entropies of the whole cache, models free):
order 0 per channel for (sign, exponent) with the mantissa raw, the same for ctxans's
symbol (sign, exponent, top mantissa bit), and that symbol's conditional entropy in
ctxans's 16 contexts per channel (the side information it would need, 16 tables per
channel, not counted; ctxans takes its tables from the dictionary instead).
Prints a markdown table; ``--json`` writes the numbers too.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from kvtool.bench.bounds import entropy_limits
from kvtool.bench.recipes import rans_recipe
from kvtool.cache import KVCache
from kvtool.kvz import KvzReader, decode_cache, encode_cache
from kvtool.modeldict.train import train

CHUNKS = (256, 4096)


def cpu_seconds(fn, repeat: int):
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.process_time()
        result = fn()
        best = min(best, time.process_time() - start)
    return best, result


def measure(cache: KVCache, recipe: str, chunk_tokens: int, repeat: int) -> dict:
    encode_s, blob = cpu_seconds(lambda: encode_cache(cache, recipe, chunk_tokens=chunk_tokens, threads=1), repeat)
    decode_s, back = cpu_seconds(lambda: decode_cache(blob), repeat)
    if not back.equal_bits(cache):
        sys.exit(f"{recipe}: decoded data differs")
    with KvzReader.from_bytes(blob) as reader:
        index, kinds = reader.index, [kind for _, kind, _ in reader.tensors]
    stored = {kind: sum(int(e["stored_len"]) for e in index if kinds[e["tensor"]] == kind) for kind in ("k", "v")}
    raw = {kind: sum(array.nbytes for _, k, array in cache.tensors() if k == kind) for kind in ("k", "v")}
    gb = cache.nbytes / 1e9
    return {
        "ratio": cache.nbytes / len(blob), "k": raw["k"] / stored["k"], "v": raw["v"] / stored["v"],
        "bytes": len(blob), "encode_s_per_gb": encode_s / gb, "decode_s_per_gb": decode_s / gb,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("caches", nargs=2, type=Path, help="two caches of one model and dtype, of different texts")
    parser.add_argument("--third", type=Path, help="a cache of a third text: its dictionary is tried on both")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--classes", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args()
    caches = [KVCache.load(path) for path in args.caches]
    names = [path.name for path in args.caches]
    sources = [*zip(names, caches)] + ([(args.third.name, KVCache.load(args.third))] if args.third else [])
    results = {"caches": names, "dictionaries": {}, "bounds": {}, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        dict_files = []
        for name, cache in sources:
            start = time.process_time()
            dictionary = train([cache], classes=args.classes)
            path = Path(tmp) / f"{Path(name).stem}.kvd"
            path.write_bytes(dictionary.to_bytes())
            dict_files.append(path)
            results["dictionaries"][name] = {"id": dictionary.id, "bytes": path.stat().st_size,
                                             "train_cpu_s": round(time.process_time() - start, 1)}
        for i, (name, cache) in enumerate(zip(names, caches)):
            results["bounds"][name] = entropy_limits(cache)
            recipes = [("exphuff", "exphuff"), ("order-0 rANS", rans_recipe(cache)),
                       ("ctxans, same text", f"ctxans:{dict_files[i]}"),
                       ("ctxans, other text", f"ctxans:{dict_files[1 - i]}")]
            if args.third:
                recipes.append(("ctxans, third text", f"ctxans:{dict_files[2]}"))
            for chunk_tokens in CHUNKS:
                for label, recipe in recipes:
                    row = {"cache": name, "chunk_tokens": chunk_tokens, "recipe": label,
                           **measure(cache, recipe, chunk_tokens, args.repeat)}
                    results["rows"].append(row)
                    print(json.dumps(row), file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print_tables(results)


def print_tables(results: dict) -> None:
    for name, info in results["dictionaries"].items():
        print(f"- dictionary of {name}: {info['bytes']:,} bytes (id {info['id'][:12]}), trained in {info['train_cpu_s']} CPU s")
    for name, bounds in results["bounds"].items():
        parts = []
        for label, key in (("order 0, sign+exp per channel, mantissa raw", "sign_exp_per_channel"),
                           ("order 0, ctxans's symbol per channel", "sign_level_per_channel"),
                           ("ctxans's symbol in its 16 contexts per channel", "sign_level_context")):
            parts.append(f"{label} {bounds['all'][key]:.3f} / {bounds['k'][key]:.3f} / {bounds['v'][key]:.3f}")
        print(f"- bounds of {name}, all / K / V: " + "; ".join(parts))
    print()
    print("| cache | chunk | recipe | ratio | K | V | encode CPU s/GB | decode CPU s/GB |")
    print("|---|---|---|---|---|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['cache']} | {row['chunk_tokens']} | {row['recipe']} | {row['ratio']:.4f} | {row['k']:.3f} | "
              f"{row['v']:.3f} | {row['encode_s_per_gb']:.2f} | {row['decode_s_per_gb']:.2f} |")


if __name__ == "__main__":
    main()
