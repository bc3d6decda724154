"""How much another fp32 rounding moves a KV cache dump: the tolerance the tests allow across CPUs.

    python benchmarks/rounding.py            # ~1 min on 2 cores; needs the model extra

A dump runs SmolLM2 in fp32 and rounds the cache to bf16. Another CPU (AVX-512
instead of AVX2) or torch build sums in another order and rounds some fp32
values differently, so a dump is not byte-identical across machines. This
measures how far the committed sample (made on an AMD CPU with AVX2) lies from
the same 64 tokens computed

- in fp64, a reference no fp32 rounding error reaches: any fp32 machine's
  dump deviates from it about as far as the sample does, so two machines
  differ by at most about twice this;
- in 7-token prefill chunks, another summation order in fp32.

For each it prints how many bf16 values differ, the largest difference in
bf16 units in the last place (for |x| > 0.01) and absolutely, the largest
|a - b| - rtol |b| over the tolerance the tests use, and the next-token accuracy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvtool.cache import KVCache
from kvtool.sources import hf

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
TOKENS = 64
#: What tests/test_dump.py allows between a dump and the sample (twice what fp64 shows; see the module docstring).
RTOL, ATOL = 2**-6, 2e-3


def compare(cache: KVCache, sample: KVCache) -> dict:
    a = np.concatenate([t.astype(np.float32).ravel() for t in cache.keys + cache.values])
    b = np.concatenate([t.astype(np.float32).ravel() for t in sample.keys + sample.values])
    diff = np.abs(a - b)
    big = np.abs(b) > 0.01
    ulp = np.abs(b[big]) * 2.0**-7  # one bf16 unit in the last place is 2^-7 to 2^-8 of the value
    return {
        "values": int(a.size),
        "differing": int(np.count_nonzero(diff)),
        "differing_share": round(float(np.count_nonzero(diff)) / a.size, 6),
        "max_ulps_above_0.01": round(float((diff[big] / ulp).max()), 3),
        "max_abs": float(diff.max()),
        "worst_excess_over_tolerance": float((diff - RTOL * np.abs(b) - ATOL).max()),
        "next_token_accuracy": cache.provenance["next_token_accuracy"],
    }


def main() -> None:
    text = (SAMPLES / "texts" / "functools.py.txt").read_text(encoding="utf-8")
    sample = KVCache.load(SAMPLES / "code.safetensors", tokens=slice(0, TOKENS))
    loaded = hf.load()
    report = {
        "sample_next_token_accuracy_64": hf.prefill(loaded, text, text_name="t", max_tokens=TOKENS).provenance["next_token_accuracy"],
        "fp32_7_token_chunks": compare(hf.prefill(loaded, text, text_name="t", max_tokens=TOKENS, chunk_tokens=7), sample),
    }
    loaded.model = loaded.model.double()
    report["fp64"] = compare(hf.prefill(loaded, text, text_name="t", max_tokens=TOKENS), sample)
    report["tolerance"] = {"rtol": RTOL, "atol": ATOL}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
