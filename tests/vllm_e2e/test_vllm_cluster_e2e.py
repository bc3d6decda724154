"""Two vLLM servers, one Redis Cluster: the second restores the prefix the first stored.

Run inside the vLLM environment with a cluster running (``.ci/run`` starts one;
without ``KVTOOL_TEST_REDIS_CLUSTER`` the fixture starts its own)::

    .venv-vllm/bin/python -m pytest tests/vllm_e2e

Server A and server B are separate vLLM processes, run one after the other
(two CPU cores cannot hold both). The reference is vLLM's own prefix cache in
one process, in the same process mode: the prompt, then the prompt with a
suffix, which hits the cache. Server B given the prompt with the suffix must
restore the prefix from the cluster and produce the same tokens.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

from test_vllm_e2e import PROMPT, SUFFIX, model, restored_tokens, run_vllm  # noqa: E402,F401 (model: a fixture)


def test_a_second_server_restores_the_first_servers_prefix_from_the_cluster(
    model: Path, tmp_path: Path, redis_cluster_url: str
) -> None:
    prompt = {"prompt_file": str(PROMPT)}
    with_suffix = {**prompt, "suffix": SUFFIX}

    (_, reference), _ = run_vllm(
        tmp_path, {"model": str(model), "store": None, "prefix_caching": True, "steps": [prompt, with_suffix]}
    )

    store = f"{redis_cluster_url}?prefix=kvtool-e2e-{uuid.uuid4().hex[:12]}:&ttl=3600"
    server = {"model": str(model), "store": store}
    (first,), log_a = run_vllm(tmp_path, {**server, "steps": [prompt]})
    assert first["prompt_tokens"] >= 1000
    assert restored_tokens(log_a) == []

    steps = [{**with_suffix, "salt": "another-tenant"}, with_suffix]
    (_, hit), log_b = run_vllm(tmp_path, {**server, "steps": steps})
    restored = restored_tokens(log_b)
    assert len(restored) == 1, log_b[-4000:]  # the other tenant's request found nothing it could use
    assert restored[0] >= 1000  # server B restored what server A stored
    assert "redis+cluster" in log_b
    assert hit["tokens"] == reference["tokens"]
