"""The model matrix on vLLM's CPU build: each family is restored exactly by kvtool's connector, or refused with one line.

    .venv-vllm/bin/python -m pytest tests/vllm_e2e/test_model_matrix.py

For every family of ``families.py`` (tiny configs written here, vLLM's dummy
weights, SmolLM2's tokenizer), ``run_matrix.py`` runs in two processes, every
family one after the other in each: the first computes a prompt (kvtool saves
it) and asks again (vLLM's own prefix cache answers: the reference), the second
asks under another ``cache_salt`` (nothing may be restored), then as before
(kvtool restores the prefix), then once more with every stored entry damaged
(each restore must fail and vLLM compute the prompt). A family is

- ``exact``: the restore gave the same tokens, with the same log-probabilities to
  the last bit, as vLLM's prefix cache, for as many prompt tokens as vLLM's cache
  supplied, and another prefix gives other log-probabilities (so equal outputs
  mean equal KV); damaged entries were refused and the output is vLLM's own;
- ``refused``: kvtool said why in one line and restored nothing, and the output is
  the one vLLM computes without any cache;
- ``not runnable``: vLLM's CPU build cannot build or run it; its error is the reason.

The first process also puts chunks of each family's layout and KV through kvtool's
tier under vLLM's own offloading (``tier_rows.py``: exact, or refused at start-up).
Every family's row (status, reason, KV groups, the tier's status) is printed at the
end of the test run (``conftest.py``); the README's support matrix names this test
for each row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from families import FAMILIES, MATRIX_ROWS, Family

pytest.importorskip("vllm", reason="vLLM is not installed here: create its environment with scripts/vllm-env.sh")

RUNNER = Path(__file__).with_name("run_matrix.py")
#: Families kvtool's connector must restore exactly on any CPU vLLM's CPU build runs on.
AT_LEAST_EXACT = 5


def run_phase(phase: str, names: list[str], root: Path) -> dict[str, dict]:
    spec = root / f"{phase}.json"
    spec.write_text(json.dumps({"phase": phase, "models": str(root / "models"), "stores": str(root / "stores"),
                                "families": names}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override the runner's small KV cache
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec)], capture_output=True, text=True, env=env,
                          timeout=900, check=False)
    rows = {r["family"]: r for r in (json.loads(line[len("FAMILY "):]) for line in proc.stdout.splitlines()
                                     if line.startswith("FAMILY "))}
    assert proc.returncode == 0 and set(rows) == set(names), proc.stderr[-4000:]
    return rows


@dataclass(frozen=True)
class Row:
    """A family's row of the matrix: kvtool's connector (status, reason), its KV cache groups, kvtool's tier."""

    status: str  # exact, refused, not runnable; anything else fails the tests
    reason: str
    groups: str
    tier: dict

    def line(self, family: Family) -> str:
        return (f"{family.name:<12} {self.status:<13} {self.groups:<54} tier: {self.tier['status']:<13} "
                f"{family.attention}: {self.reason} | tier: {self.tier['reason']}")


def same_output(a: dict, b: dict) -> bool:
    return a["tokens"] == b["tokens"] and a["logprobs"] == b["logprobs"]


def verdict(save: dict, restore: dict | None) -> tuple[str, str]:
    """The family's status and its reason (or what went wrong: a status the tests do not accept)."""
    if "error" in save:
        return "not runnable", save["error"]
    assert restore is not None
    if "error" in restore:
        return "failed", f"the restoring process failed: {restore['error']}"
    salted, restored, cold, warm = restore["salted"], restore["restored"], save["cold"], save["warm"]
    if salted["kvtool_restored"] or not same_output(salted, cold):
        return "wrong", f"another cache_salt restored {salted['kvtool_restored']} tokens or changed the output"
    refusal = restore.get("refusal")
    if refusal is not None:
        if restored["kvtool_restored"] or not same_output(restored, cold):
            return "wrong", f"refused ({refusal}) but restored {restored['kvtool_restored']} tokens or changed the output"
        return "refused", refusal
    if not restored["kvtool_restored"]:
        return "failed", "nothing restored and no refusal"
    damaged = restore["damaged"]
    if damaged["kvtool_restored"] or not damaged["kvtool_failed"] or not same_output(damaged, cold):
        return "wrong", (f"damaged entries: {damaged['kvtool_restored']} tokens restored, {damaged['kvtool_failed']} "
                         f"refused, tokens {damaged['tokens']} vs {cold['tokens']}")
    if restored["kvtool_restored"] != warm["vllm_cached"] or not same_output(restored, warm):
        return "wrong", (f"restored {restored['kvtool_restored']} tokens (vLLM's cache: {warm['vllm_cached']}); "
                         f"tokens {restored['tokens']} vs {warm['tokens']}")
    if save["control"]["logprobs"] == warm["logprobs"]:
        return "failed", "another prefix gives the same log-probabilities: this model's output does not show its KV"
    return "exact", f"{restored['kvtool_restored']} tokens restored, output equal to vLLM's prefix cache"


@pytest.fixture(scope="module")
def matrix(model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> dict[str, Row]:
    root = tmp_path_factory.mktemp("matrix")
    for family in FAMILIES:
        family.write(root / "models", model)
    started = time.perf_counter()
    names = [f.name for f in FAMILIES]
    saved = run_phase("save", names, root)
    restored = run_phase("restore", [n for n in names if "error" not in saved[n]], root)
    not_run = {"status": "not runnable", "reason": "vLLM did not run the family"}
    rows = {name: Row(*verdict(saved[name], restored.get(name)), saved[name].get("groups") or "-",
                      saved[name].get("tier") or not_run) for name in names}
    lines = [rows[f.name].line(f) for f in FAMILIES]
    lines.append(f"({time.perf_counter() - started:.0f} s for {len(names)} families, two processes)")
    request.config.stash[MATRIX_ROWS] = lines
    return rows


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_each_family_is_restored_exactly_or_refused_never_wrong(matrix: dict[str, Row], family: Family) -> None:
    row = matrix[family.name]
    if row.status == "not runnable":
        assert family.may_not_run is not None and family.may_not_run in row.reason, row.reason
    else:
        assert row.status == family.expect, row.reason


@pytest.mark.parametrize("family", FAMILIES, ids=[f.name for f in FAMILIES])
def test_the_offloading_tier_takes_each_familys_chunks_exactly_or_refuses_them(matrix: dict[str, Row],
                                                                                 family: Family) -> None:
    row = matrix[family.name]
    if row.status == "not runnable":
        assert row.tier["status"] == "not runnable"
    else:
        assert row.tier["status"] == family.tier, row.tier["reason"]


def test_enough_families_restore_exactly(matrix: dict[str, Row]) -> None:
    exact = [name for name, row in matrix.items() if row.status == "exact"]
    assert len(exact) >= AT_LEAST_EXACT, matrix
