"""Write the golden .kvz files (run once per format change; the tests decode them on every run).

    python tests/golden/make_golden.py

Each file holds layers 0 and 29, tokens 0-11, of samples/code.safetensors: in 4-token
chunks, one file per codec (byteplane layout) and one per layout chain; in one 12-token
chunk per tensor, one file per array codec (a chunk that small would be stored raw).
"""

from pathlib import Path

from kvtool import container
from kvtool.cache import KVCache

HERE = Path(__file__).parent
SAMPLE = HERE.parents[1] / "samples" / "code.safetensors"
CODEC_RECIPES = {f"codec-{c}": f"byteplane|{c}" for c in ("none", "zstd:3", "zstd:huff", "lz4", "zlib:6", "qat", "isal:1")}
LAYOUT_RECIPES = {
    "layout-token-major": "token-major|zstd:1",
    "layout-channel-major-byteplane": "channel-major|byteplane|zstd:1,lo=none",
    "layout-xor-delta-bf16-split": "channel-major|xor-delta|bf16-split|zstd:1,mant=none",
    "layout-sx-split-rans": "channel-major|sx-split|rans:192,mant=none",
}
# ctxans names its dictionary: the one kvtool ships (kvtool/modeldict/default.kvd), which stays shipped.
ARRAY_RECIPES = {"array-exphuff": "exphuff", "array-ctxans": "ctxans:4c3e1df0f0bace21e0ea8cae679961b0"}
GOLDEN = {**CODEC_RECIPES, **LAYOUT_RECIPES, **ARRAY_RECIPES}


def chunk_tokens(name: str) -> int:
    return 12 if name in ARRAY_RECIPES else 4


def golden_cache() -> KVCache:
    return KVCache.load(SAMPLE, layers=[0, 29], tokens=slice(0, 12))


if __name__ == "__main__":
    cache = golden_cache()
    for name, recipe in GOLDEN.items():
        path = HERE / f"v1-{name.replace(':', '')}.kvz"
        if path.exists():
            continue  # a golden file is written once; the tests read old files, not new ones
        size = container.save(cache, path, recipe, chunk_tokens=chunk_tokens(name), threads=1)
        print(f"{path.name}: {recipe}, {size} bytes")
