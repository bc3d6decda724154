"""Write the golden files (run once per format change; the tests read them on every run).

    python tests/golden/make_golden.py

Each file holds layers 0 and 29, tokens 0-11, of samples/code.safetensors: in 4-token
chunks, one file per codec (byteplane layout) and one per layout chain; in one 12-token
chunk per tensor, one file per array codec (a chunk that small would be stored raw) and one
for ``int``'s ``codes=ctx`` (whose codes are coded at that size, not packed); in 4-token
chunks, one file per other lossy first stage (and one with the outliers side channel before it); the pca
file's transform dictionary is ``pca-basis.kvd``, learnt once and kept beside it.
``lossy-v1.json`` keeps the decoded tensors' xxh3-64 digests of every lossy file (their bits are an
approximation, so nothing else pins them).
``store-v1.json`` holds store entry records (version 1) and prefix keys
(``kvtool/prefix/1``) for fixed inputs, byte for byte.
"""

import json
from pathlib import Path

import xxhash

from kvtool import kvz
from kvtool.cache import KVCache
from kvtool.modeldict import registry
from kvtool.store.entry import wrap
from kvtool.store.keys import prefix_keys

HERE = Path(__file__).parent
SAMPLE = HERE.parents[1] / "samples" / "code.safetensors"
CODEC_RECIPES = {f"codec-{c}": f"byteplane|{c}" for c in ("none", "zstd:3", "zstd:huff", "lz4", "zlib:6", "qat", "isal:1")}
LAYOUT_RECIPES = {
    "layout-token-major": "token-major|zstd:1",
    "layout-channel-major-byteplane": "channel-major|byteplane|zstd:1,lo=none",
    "layout-xor-delta-bf16-split": "channel-major|xor-delta|bf16-split|zstd:1,mant=none",
    "layout-sx-split-rans": "channel-major|sx-split|rans:192,mant=none",
    "layout-outliers": "outliers:0.05|zstd:1",
}
# ctxans names its dictionary: the one kvtool ships (kvtool/modeldict/default.kvd), which stays shipped.
ARRAY_RECIPES = {"array-exphuff": "exphuff", "array-exphuff-lanes": "exphuff-lanes:16",
                 "array-ctxans": "ctxans:4c3e1df0f0bace21e0ea8cae679961b0",
                 "array-ctxtans": "ctxtans:4c3e1df0f0bace21e0ea8cae679961b0",
                 # chunk version 2 (each head's channels coded in class order); the file above holds version 1
                 "array-ctxtans-2": "ctxtans:4c3e1df0f0bace21e0ea8cae679961b0",
                 # chunk version 3 (a state per channel of a head's groups of 64, the states holding raw bits)
                 "array-ctxtans-3": "ctxtans:4c3e1df0f0bace21e0ea8cae679961b0"}
PCA_BASIS = HERE / "pca-basis.kvd"


def pca_basis():
    """The transform dictionary of the pca golden file: learnt once from layers 0 and 29 of the prose sample (keys
    de-rotated, 16 components a tensor, a few KB), then kept like the golden files."""
    if not PCA_BASIS.exists():
        from kvtool.modeldict.basis_train import train_basis

        cache = KVCache.load(SAMPLE.parent / "prose.safetensors", layers=[0, 29])
        PCA_BASIS.write_bytes(train_basis([cache], rope_theta=1e5, components=16).to_bytes())
    return registry.load(PCA_BASIS)


LOSSY_RECIPES = {
    "lossy-int4-kivi": "int:4,group=4|zstd:1",
    "lossy-int6-token": "int:6,k=token,v=token,group=48|zstd:1",
    "lossy-int-widths": "int:4,group=4,kbits=6,vbits=3,layers=k29:8+v0:2|zstd:1",
    "lossy-fp8-e4m3": "fp8:e4m3|exphuff",
    "lossy-fp8-e5m2-group": "fp8:e5m2,group=4|zstd:1",
    "lossy-mant-round3": "mant-round:3|byteplane|zstd:1",
    "lossy-outliers-int3": "outliers:0.05|int:3,group=4|zstd:1",
    # in 12-token chunks, where every codes plane is coded (mode 1; 4-token ones fall back to the packed codes)
    "lossy-int3-ctx": "int:3,group=4,codes=ctx|zstd:1",
    # two sink tokens exact; the keys turned back by their positions, in 4-token chunks
    "lossy-pca": f"pca:{pca_basis().id},step=0.25,sink=2|zstd:1",
}
WHOLE_CHUNKS = {*ARRAY_RECIPES, "lossy-int3-ctx"}
GOLDEN = {**CODEC_RECIPES, **LAYOUT_RECIPES, **ARRAY_RECIPES, **LOSSY_RECIPES}
LOSSY_DIGESTS = HERE / "lossy-v1.json"


def chunk_tokens(name: str) -> int:
    return 12 if name in WHOLE_CHUNKS else 4


def golden_cache() -> KVCache:
    return KVCache.load(SAMPLE, layers=[0, 29], tokens=slice(0, 12))


STORE_VECTORS = HERE / "store-v1.json"
ENTRY_INPUTS = [
    {"key": "a", "value": "", "meta": {}},
    {"key": "session-1", "value": "68656c6c6f", "meta": {"tokens": 5, "raw_bytes": 100}},
    {"key": "\u00e9/\u043a\u043b\u044e\u0447/\U0001f642", "value": bytes(range(256)).hex(), "meta": {"s": "\u00fc", "nested": {"x": [1, 2.5, None, True]}}},
    {"key": "k" * 1024, "value": (b"\x00\xff" * 500).hex(), "meta": {"prefix_tokens": 256, "tokens": 256}},
]
PREFIX_INPUTS = [
    {"model_id": "SmolLM2-135M-Instruct", "recipe": "channel-major|byteplane|zstd:huff,lo=none", "salt": "", "chunk_tokens": 4, "tokens": list(range(1, 11))},
    {"model_id": "SmolLM2-135M-Instruct", "recipe": "channel-major|byteplane|zstd:huff,lo=none", "salt": "tenant-a", "chunk_tokens": 4, "tokens": list(range(1, 11))},
    {"model_id": "m", "recipe": "zstd:3", "salt": "\u00fc", "chunk_tokens": 256, "tokens": [(i * 7919) % 50000 for i in range(600)]},
    {"model_id": "m", "recipe": "zstd:3", "salt": "", "chunk_tokens": 2, "tokens": [0, 4294967295, 65536]},
    {"model_id": "m", "recipe": "zstd:3", "salt": "", "chunk_tokens": 16, "tokens": []},
]


def decoded_digests(cache: KVCache) -> list[str]:
    """Each decoded tensor's xxh3-64, K then V per layer, as hex."""
    return [xxhash.xxh3_64_hexdigest(array.tobytes()) for _, _, array in cache.tensors()]


def store_vectors() -> dict:
    entries = [{**case, "record": wrap(case["key"], bytes.fromhex(case["value"]), case["meta"]).record.hex()} for case in ENTRY_INPUTS]
    prefixes = [{**case, "keys": prefix_keys(case["tokens"], case["chunk_tokens"], case["model_id"], case["recipe"], case["salt"])} for case in PREFIX_INPUTS]
    return {"entries": entries, "prefix_keys": prefixes}


if __name__ == "__main__":
    if not STORE_VECTORS.exists():
        STORE_VECTORS.write_text(json.dumps(store_vectors(), indent=1, ensure_ascii=True) + "\n")
        print(f"{STORE_VECTORS.name}: {len(ENTRY_INPUTS)} entry records, {len(PREFIX_INPUTS)} prefix key chains")
    cache = golden_cache()
    for name, recipe in GOLDEN.items():
        path = HERE / f"v1-{name.replace(':', '')}.kvz"
        if path.exists():
            continue  # a golden file is written once; the tests read old files, not new ones
        size = kvz.save(cache, path, recipe, chunk_tokens=chunk_tokens(name), threads=1)
        print(f"{path.name}: {recipe}, {size} bytes")
    digests = json.loads(LOSSY_DIGESTS.read_text()) if LOSSY_DIGESTS.exists() else {}
    for name in LOSSY_RECIPES.keys() - digests.keys():
        with kvz.open_kvz(HERE / f"v1-{name}.kvz") as reader:
            digests[name] = decoded_digests(reader.read())
    LOSSY_DIGESTS.write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")
