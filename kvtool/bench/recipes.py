"""The recipe sets ``kvtool bench`` runs: a quick default set, and every sensible combination.

Baselines come first and code the raw bytes with no layout: zstd:3 and lz4
(the usual general-purpose points) and qat (gzip through QATzip). The best
order-0 recipe names its row count, so it is built for each cache: one rANS
model per channel is ``kv_heads * head_dim`` rows. The best recipe, ``ctxans``,
and ``ctxtans`` (its models, tANS-coded) code with the model dictionary kvtool
ships unless a run names another.
"""

from __future__ import annotations

from kvtool.cache import KVCache
from kvtool.codecs import registry as codec_registry
from kvtool.errors import KvtoolError
from kvtool.layouts import parse_layouts
from kvtool.layouts import registry as layout_registry
from kvtool.layouts.base import PlaneSpec
from kvtool.layouts.lossy import SideChannel
from kvtool.recipe import DEFAULT_RECIPE

BASELINES = ("zstd:3", "lz4", "qat")
#: The gzip family side by side (same wire format) and earlier default recipes.
QUICK = ("zlib:1", "isal:1", "byteplane|zstd:1", "channel-major|byteplane|zstd:huff,lo=none")
#: Per dtype, the fastest good split: tuned zstd on the exponents.
SPLITS = {
    "bf16": "channel-major|bf16-split|zstd:huff,mant=none",
    "fp16": "channel-major|fp16-split|zstd:huff",
}
#: Levels worth measuring per codec id; codecs not named here run at their default.
LEVELS = {
    "zstd": ("1", "3", "9", "19", "huff"),
    "lz4": ("0", "9"),
    "zlib": ("1", "6", "9"),
    "qat": ("1", "9"),
    "isal": ("0", "1", "3"),
}
#: The best recipe's models with a coder of a table step a value.
CONTEXT_TANS = "ctxtans"
#: Planes close to random: stored raw is the fast choice for them.
RAW_PLANES = ("lo", "mant")


def best_recipe(cache: KVCache) -> str:
    """The recipe closest to the lossless limit: context-modelled rANS with a model dictionary."""
    return "ctxans"


def rans_recipe(cache: KVCache) -> str:
    """The best order-0 recipe: per-channel rANS on (exponent, sign change), mantissas raw."""
    return f"channel-major|sx-split|rans:{channels(cache)},mant=none"


def channels(cache: KVCache) -> int:
    return cache.model.num_kv_heads * cache.model.head_dim if cache.keys else 1


def quick(cache: KVCache) -> list[str]:
    """Baselines, the gzip family, the old and current defaults, the best order-0 recipe, the best one and
    ctxtans, for this cache."""
    split = [SPLITS[cache.dtype.name]] if cache.dtype.name in SPLITS else []
    recipes = [*BASELINES, *QUICK, *split, DEFAULT_RECIPE, rans_recipe(cache), best_recipe(cache), CONTEXT_TANS]
    return list(dict.fromkeys(recipes))


def everything(cache: KVCache) -> list[str]:
    """Every registered lossless layout (alone and after channel-major) with every codec at its sensible levels.

    Chains the cache's dtype does not fit are left out. A chain that splits off
    a near-random plane also runs with that plane stored raw. ``rans`` goes
    with ``sx-split``, whose symbols it is built for, and only there.
    """
    recipes = list(BASELINES)
    for chain in _chains(cache):
        for codec in _codec_specs(cache):
            if codec.startswith("rans") != chain.endswith("sx-split"):
                continue
            stage = f"{chain}|{codec}" if chain else codec
            recipes.append(stage)
            for plane in _raw_planes(chain, cache):
                recipes.append(f"{stage},{plane}=none")
    return list(dict.fromkeys(recipes))


def _chains(cache: KVCache) -> list[str]:
    chains = ["", "channel-major"]
    for layout in layout_registry.ids():
        cls = layout_registry.get(layout)  # a side channel (outliers) is there for a lossy stage after it
        if layout not in ("token-major", "channel-major") and not cls.lossy and not issubclass(cls, SideChannel):
            chains += [layout, f"channel-major|{layout}"]
    return [chain for chain in chains if _fits(chain, cache)]


def _codec_specs(cache: KVCache) -> list[str]:
    specs = []
    for codec in codec_registry.ids():
        if codec == "rans":
            specs.append(f"rans:{channels(cache)}")
        else:
            specs += [f"{codec}:{level}" for level in LEVELS.get(codec, ())] or [codec]
    return specs


def _planes(chain: str, cache: KVCache) -> list[str]:
    return [p.name for p in parse_layouts(chain).plan([PlaneSpec.of(cache.keys[0][:, :1])])]


def _raw_planes(chain: str, cache: KVCache) -> list[str]:
    return [name for name in _planes(chain, cache) if name in RAW_PLANES]


def _fits(chain: str, cache: KVCache) -> bool:
    try:
        _planes(chain, cache)
    except KvtoolError:
        return False
    return True
