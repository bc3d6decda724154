"""``ctxtans`` under vLLM's CPU build: entries coded with a model dictionary restore to vLLM's own tokens.

Two ways to get the dictionary, as deployments do: the one kvtool ships
(recipe ``ctxtans``), and one the connector learns from the first entries it
saves (``dictionary: train:512``), publishes into the store and codes with
from then on; a fresh process finds it in the store. Each restore must give
the greedy tokens of a run without the connector, and the entries must be
smaller than the default recipe's coding of the same KV (the dictionary was used,
not the ``exphuff`` fallback for every chunk).

    .venv-vllm/bin/python -m pytest tests/vllm_e2e/test_vllm_ctxtans.py
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

from test_vllm_e2e import PROMPT, ROOT, SUFFIX, model, restored_tokens, run_vllm  # noqa: E402,F401 (model: a fixture)

from kvtool.kvz import KvzReader, encode_cache  # noqa: E402
from kvtool.modeldict import registry  # noqa: E402
from kvtool.store import dicts, open_store  # noqa: E402

OTHER_PROMPT = ROOT / "samples" / "texts" / "PSF-LICENSE.txt"


@pytest.fixture(scope="module")
def baseline(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[Path, list[int]]:
    """The greedy tokens of both prompts with their suffix, without the connector."""
    steps = [{"prompt_file": str(path), "suffix": SUFFIX} for path in (PROMPT, OTHER_PROMPT)]
    results, _ = run_vllm(tmp_path_factory.mktemp("baseline"), {"model": str(model), "store": None, "steps": steps})
    return {PROMPT: results[0]["tokens"], OTHER_PROMPT: results[1]["tokens"]}


def entry_recipes(store_url: str) -> dict[str, tuple[int, int]]:
    """Per recipe of the stored entries: their bytes, and the bytes the default recipe codes the same KV in."""
    store = open_store(store_url)
    source = dicts.source(store)  # a learnt dictionary is found in the store, as the connector finds it
    registry.attach(source)
    sizes: dict[str, tuple[int, int]] = {}
    try:
        for key in store.keys():
            if key.startswith(dicts.PREFIX):
                continue  # a published dictionary
            blob = store.get(key)
            with KvzReader.from_bytes(blob) as reader:
                spec, cache = reader.recipe.spec(), reader.read()
                ours, default = sizes.get(spec, (0, 0))
                sizes[spec] = (ours + len(blob), default + len(encode_cache(cache, chunk_tokens=reader.chunk_tokens)))
    finally:
        registry.detach(source)
        store.close()
    return sizes


def test_the_shipped_dictionary_restores_vllms_tokens(model: Path, tmp_path: Path, baseline: dict) -> None:
    connector = {"model": str(model), "store": f"file://{tmp_path / 'store'}", "recipe": "ctxtans"}
    run_vllm(tmp_path, {**connector, "steps": [{"prompt_file": str(PROMPT)}]})
    sizes = entry_recipes(connector["store"])
    assert list(sizes) == [f"ctxtans:{registry.default_id()}"], sizes
    ours, default = sizes[f"ctxtans:{registry.default_id()}"]
    assert ours < default

    (hit,), log = run_vllm(tmp_path, {**connector, "steps": [{"prompt_file": str(PROMPT), "suffix": SUFFIX}]})
    restored = restored_tokens(log)
    assert restored and restored[0] >= 1000, log[-4000:]
    assert hit["tokens"] == baseline[PROMPT]


def test_a_learnt_dictionary_is_published_and_restores_vllms_tokens(model: Path, tmp_path: Path, baseline: dict) -> None:
    connector = {"model": str(model), "store": f"file://{tmp_path / 'store'}", "recipe": "ctxtans",
                 "dictionary": "train:512"}
    steps = [{"prompt_file": str(PROMPT)}, {"prompt_file": str(OTHER_PROMPT), "after_log": "learnt dictionary"}]
    _, log = run_vllm(tmp_path, {**connector, "steps": steps})
    sizes = entry_recipes(connector["store"])
    learnt = [spec for spec in sizes if spec != f"ctxtans:{registry.default_id()}"]
    assert len(learnt) == 1 and learnt[0].startswith("ctxtans:"), log[-4000:]
    ours, default = sizes[learnt[0]]
    assert ours < default

    (hit,), log = run_vllm(tmp_path, {**connector, "steps": [{"prompt_file": str(OTHER_PROMPT), "suffix": SUFFIX}]})
    restored = restored_tokens(log)
    assert restored and restored[0] >= 1000, log[-4000:]
    assert hit["tokens"] == baseline[OTHER_PROMPT]
