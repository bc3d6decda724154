"""Two ideas from the literature for 3-4 bit keys, measured before building either (BENCHMARKS.md,
"Lossy recipes", "Keys de-rotated, non-uniform levels"):

- keys de-rotated before quantizing (KVQuant's pre-RoPE keys): each chunk's keys rotated back by
  their position in the chunk (a rotation constant over a chunk does not matter to a per-channel
  range), quantized, rotated forward again;
- non-uniform levels: 2^B levels at the normal distribution's quantiles, mapped onto each group's
  [min, max] (the same two fp16 parameters a group stores today).

    python benchmarks/lossy_keys_rope.py samples/prose.safetensors samples/code.safetensors [--theta 100000]

Keys are quantized per channel along tokens as the ``int`` stage's keys are (min-max, in float64,
without its fp16 rounding of the group parameters). Reported: the keys' relative RMS error and the
relative error of attention logits q.k, with the cache's own keys as stand-in queries (a cache holds
no queries). RoPE pairs are Hugging Face's ``rotate_half`` layout (channel i with i + dim/2),
frequencies ``theta ** (-2i / dim)``; SmolLM2-135M's theta is 100000.
"""

from __future__ import annotations

import argparse
from statistics import NormalDist

import numpy as np

from kvtool.cache import KVCache

SETTINGS = ((3, 128), (4, 128), (3, 256))


def rotate(x: np.ndarray, theta: float, sign: int) -> np.ndarray:
    """``x`` [heads, tokens, dim] rotated by ``sign`` times each token's position in the chunk."""
    dim = x.shape[-1]
    half = dim // 2
    angle = np.arange(x.shape[1])[:, None] * (theta ** (-np.arange(0, dim, 2) / dim))[None, :]
    cos, sin = np.cos(angle), np.sin(sign * angle)
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def quantize(x: np.ndarray, bits: int, group: int, levels: np.ndarray) -> np.ndarray:
    """Per channel along tokens, groups of ``group`` tokens, each value to the nearest of ``levels``
    (in [0, 1]) mapped onto its group's [min, max]."""
    heads, tokens, dim = x.shape
    g = x.transpose(0, 2, 1).reshape(heads, dim, tokens // group, group)
    lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
    span = np.where(hi > lo, hi - lo, 1.0)
    nearest = np.abs(((g - lo) / span)[..., None] - levels).argmin(-1)
    return (lo + levels[nearest] * span).reshape(heads, dim, tokens).transpose(0, 2, 1)


def level_sets(bits: int) -> dict[str, np.ndarray]:
    n = 2**bits
    normal = np.array([NormalDist().inv_cdf((k + 0.5) / n) for k in range(n)])
    return {"uniform": np.linspace(0.0, 1.0, n), "normal": (normal - normal[0]) / (normal[-1] - normal[0])}


def errors(keys: np.ndarray, approx: np.ndarray) -> tuple[float, float]:
    rel = float(np.sqrt(((approx - keys) ** 2).sum() / (keys**2).sum()))
    ref, got = np.einsum("htd,hsd->hts", keys, keys), np.einsum("htd,hsd->hts", keys, approx)
    return rel, float(np.sqrt(((got - ref) ** 2).sum() / (ref**2).sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("caches", nargs="+")
    parser.add_argument("--theta", type=float, default=1e5)
    args = parser.parse_args()
    print("| cache | keys | levels | as stored (post-RoPE): rel. RMS / logit error | de-rotated: rel. RMS / logit error |")
    print("|---|---|---|---|---|")
    for path in args.caches:
        cache = KVCache.load(path)
        for bits, group in SETTINGS:
            for name, levels in level_sets(bits).items():
                post, pre = [], []
                for k in cache.keys:
                    k = np.asarray(k, np.float32).astype(np.float64)
                    post.append(errors(k, quantize(k, bits, group, levels)))
                    back = rotate(quantize(rotate(k, args.theta, -1), bits, group, levels), args.theta, 1)
                    pre.append(errors(k, back))
                p, q = np.mean(post, axis=0), np.mean(pre, axis=0)
                print(f"| {path.rsplit('/', 1)[-1]} | {bits} bits, group {group} | {name} | "
                      f"{p[0]:.4f} / {p[1]:.4f} | {q[0]:.4f} / {q[1]:.4f} |")


if __name__ == "__main__":
    main()
