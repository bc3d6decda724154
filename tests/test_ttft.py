"""The TTFT experiment: a deterministic trace that keeps its hit rate, and a restore that gives the recompute's token."""

from __future__ import annotations

import pytest

from kvtool.bench.trace import build_trace, read_texts, turn_lengths
from kvtool.errors import UsageError

POOL = list(range(1000, 1997))


def test_trace_repeats_with_a_seed():
    first = build_trace(POOL, turns=4, max_context=2048, chunk_tokens=64, seed=7)
    again = build_trace(POOL, turns=4, max_context=2048, chunk_tokens=64, seed=7)
    other = build_trace(POOL, turns=4, max_context=2048, chunk_tokens=64, seed=8)
    assert [t.tokens for t in first] == [t.tokens for t in again]
    assert [t.tokens for t in first] != [t.tokens for t in other]


@pytest.mark.parametrize("hit_rate", [0.5, 0.8, 0.9])
def test_trace_respects_the_hit_rate(hit_rate):
    chunk = 32
    trace = build_trace(POOL, turns=4, hit_rate=hit_rate, max_context=4096, chunk_tokens=chunk, seed=0)
    assert len(trace[-1].tokens) == 4096
    for before, turn in zip(trace, trace[1:]):
        assert turn.tokens[: len(before.tokens)] == before.tokens  # each turn appends to the last
        assert turn.cached_tokens == len(before.tokens)
    for turn in trace:
        assert turn.cached_tokens % chunk == 0 and len(turn.tokens) % chunk == 0
        assert abs(turn.hit_rate - hit_rate) <= chunk / len(turn.tokens)
        assert turn.new_tokens > 0


def test_each_turn_starts_with_a_user_message_when_given():
    messages = [[1, 2, 3], [4, 5]]
    trace = build_trace(POOL, turns=3, max_context=1024, chunk_tokens=32, seed=1, user_message_tokens=messages)
    plain = build_trace(POOL, turns=3, max_context=1024, chunk_tokens=32, seed=1)
    for before, turn in zip([None, *trace], trace):
        start = len(before.tokens) if before else turn.cached_tokens
        assert any(turn.tokens[start : start + len(m)] == m for m in messages)
    assert [len(t.tokens) for t in trace] == [len(t.tokens) for t in plain]


def test_trace_refuses_what_it_cannot_build():
    with pytest.raises(UsageError):
        turn_lengths(3, 1.0, 4096, 128)
    with pytest.raises(UsageError):
        turn_lengths(3, 0.99, 256, 128)  # no new tokens left in whole chunks


def test_trace_text_is_real():
    assert len(read_texts()) > 10_000


def test_restore_gives_the_recomputed_first_token():
    pytest.importorskip("torch", reason="running the model needs the model extra: pip install 'kvtool[model]'")
    pytest.importorskip("transformers", reason="running the model needs the model extra: pip install 'kvtool[model]'")
    from kvtool.bench import ttft
    from kvtool.bench.ttft_hf import HFEngine

    engine = HFEngine()
    trace = build_trace(engine.tokenize(read_texts()), turns=2, hit_rate=0.75, max_context=128, chunk_tokens=32, seed=1)
    result = ttft.run(engine, trace, tiers=["memory"], recipes=["none", "default"], chunk_tokens=32)
    recomputed = result["turns"]["recompute"]
    for name in ("memory/none", "memory/default"):
        rows = result["turns"][name]
        assert len(rows) == 2
        for row, base, turn in zip(rows, recomputed, trace):
            assert row["restored_tokens"] == turn.cached_tokens > 0
            assert row["first_token"] == base["first_token"]
    assert all(s["first_token_matches"] for s in result["summary"] if s["tier"])
