"""A lossy recipe in vLLM's CPU build: entries stored with it, restored in a fresh process, the output compared.

The reference is vLLM's own prefix cache: one process runs the prompt, then
the prompt with a suffix, whose prefix blocks come from vLLM's (lossless)
prefix cache. With the kvtool connector set to a lossy recipe, one process
saves the prompt's KV and a fresh one restores it for the prompt with the
suffix. A lossy restore need not give the same tokens, so the test asserts
that the prefix was restored from lossy entries, and measures and prints how
far the greedy output agrees (run pytest with ``-s`` to see the line). The
``pca`` stage codes with a transform dictionary learnt here from the committed
samples and named by its file in the recipe, so each process finds it::

    .venv-vllm/bin/python -m pytest -s tests/vllm_e2e/test_vllm_lossy.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

from test_vllm_e2e import PROMPT, ROOT, SUFFIX, model, restored_tokens, run_vllm  # noqa: E402,F401 (model: a fixture)

from kvtool.cache import KVCache  # noqa: E402
from kvtool.kvz import KvzReader  # noqa: E402
from kvtool.modeldict.basis_train import train_basis  # noqa: E402
from kvtool.recipe import Recipe  # noqa: E402
from kvtool.store import open_store  # noqa: E402

#: The key layers the per-layer sensitivity run found most sensitive, at 8 bits (BENCHMARKS.md,
#: "Bits per kind and per layer").
KEYS8 = "k20:8+k18:8+k7:8+k23:8+k14:8+k17:8"
#: Recipes that BENCHMARKS.md measures (section "Lossy recipes"): about 2.5x, the best 3x plan with its
#: codes entropy-coded (codes=ctx: the same approximation, 3.28x), and outliers kept exact before 4-bit
#: codes (about 3.6x).
RECIPES = [
    "int:6,group=64|zstd:3",
    f"int:4,group=128,kbits=5,layers={KEYS8}+v18:6+v20:6+v14:6,codes=ctx|zstd:3",
    "outliers:0.01|int:4,group=128|zstd:3",
]
MAX_TOKENS = 64
WARM, STEP = {"prompt_file": str(PROMPT)}, {"prompt_file": str(PROMPT), "suffix": SUFFIX}


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict:
    """The prompt with the suffix, its prefix from vLLM's own (lossless) prefix cache."""
    (_, result), _ = run_vllm(
        tmp_path_factory.mktemp("reference"),
        {"model": str(model), "store": None, "prefix_caching": True, "max_tokens": MAX_TOKENS, "steps": [WARM, STEP]},
    )
    assert result["vllm_cached_tokens"] >= 1000  # the reference reused vLLM's own prefix cache
    return result


@pytest.fixture(scope="module")
def basis_file(model, tmp_path_factory) -> Path:
    """A transform dictionary for SmolLM2 learnt from the committed samples (keys de-rotated with the model's
    rope_theta): 512 tokens, seconds of CPU; a deployment learns one from far more."""
    config = json.loads((model / "config.json").read_text())
    theta = config.get("rope_parameters", config)["rope_theta"]  # where transformers 5 writes it, or 4
    caches = [KVCache.load(path) for path in sorted((ROOT / "samples").glob("*.safetensors"))]
    path = tmp_path_factory.mktemp("basis") / "smollm2.kvd"
    path.write_bytes(train_basis(caches, rope_theta=theta).to_bytes())
    return path


@pytest.mark.parametrize("recipe", RECIPES)
def test_lossy_restore_against_vllm_prefix_cache(model, tmp_path, reference, recipe) -> None:
    restore_and_compare(model, tmp_path, reference, recipe)


def test_pca_restore_against_vllm_prefix_cache(model, tmp_path, reference, basis_file) -> None:
    """The pca stage, its dictionary named by file in the recipe (step=0.32: about 6x with the dictionaries of
    BENCHMARKS.md; this one, from 512 tokens, approximates far more coarsely at the same step)."""
    spec = restore_and_compare(model, tmp_path, reference, f"pca:{basis_file},step=0.32|zstd:1")
    assert spec.startswith("pca:") and str(basis_file) not in spec  # entries name the dictionary by its id


def restore_and_compare(model: Path, tmp_path: Path, reference: dict, recipe: str) -> str:
    """Save the prompt's KV with ``recipe``, restore it in a fresh process, print the agreement; the entries' recipe."""
    spec = Recipe.parse(recipe).spec()
    store_url = f"file://{tmp_path / 'store'}"
    connector = {"model": str(model), "store": store_url, "recipe": recipe, "max_tokens": MAX_TOKENS}
    _, log = run_vllm(tmp_path, {**connector, "steps": [WARM]})
    assert "(lossy: restored prefixes are approximations)" in log
    store = open_store(store_url)
    entries = [store.get(key) for key in store.keys()]
    assert len(entries) >= 4
    for blob in entries:
        with KvzReader.from_bytes(blob) as reader:
            assert reader.recipe.spec() == spec and reader.lossy is not None
    store.close()

    (restored_run,), log = run_vllm(tmp_path, {**connector, "steps": [STEP]})
    restored = restored_tokens(log)
    assert restored and restored[0] >= 1000, log[-4000:]

    ours, theirs = restored_run["tokens"], reference["tokens"]
    assert len(ours) == len(theirs) == MAX_TOKENS
    identical = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), MAX_TOKENS)
    same = sum(a == b for a, b in zip(ours, theirs))
    print(
        f"\nlossy restore with {recipe}: {restored[0]} prompt tokens restored; greedy output identical to vLLM's "
        f"prefix cache for {identical} of {MAX_TOKENS} tokens, {same} of {MAX_TOKENS} positions equal"
    )
    return spec
