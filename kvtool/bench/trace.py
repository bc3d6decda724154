"""Multi-turn agent traces for the TTFT experiment, built from real text.

Each turn appends new tokens (a tool's output) to the conversation, so turn
``i``'s prompt is turn ``i-1``'s prompt plus new tokens. The hit rate is
the share of a turn's prompt that is a cached prefix: with hit rate ``h`` the
prompt lengths grow geometrically (``n_i = n_{i-1} / h``) and the last turn is
``max_context`` tokens long. Turn 0's prefix stands for an earlier session
(system prompt, task, documents) whose cache is already stored.

Lengths are rounded to whole ``chunk_tokens`` (the store keeps a prefix in
chunks, as vLLM keeps blocks), so the realised hit rate is within one chunk of
the one asked for. The same seed and texts give the same trace.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvtool.errors import UsageError
from kvtool.paths import source_checkout


@dataclass(frozen=True)
class Turn:
    index: int
    tokens: list[int]  # the whole prompt of this turn
    cached_tokens: int  # leading tokens whose cache is stored before the turn starts

    @property
    def new_tokens(self) -> int:
        return len(self.tokens) - self.cached_tokens

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / len(self.tokens)


def turn_lengths(turns: int, hit_rate: float, max_context: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``(prompt tokens, cached tokens)`` per turn, whole chunks, the last prompt ``max_context`` long."""
    if turns < 1:
        raise UsageError("a trace needs at least one turn")
    if not 0.0 < hit_rate < 1.0:
        raise UsageError(f"the hit rate must lie strictly between 0 and 1, not {hit_rate}")
    if chunk_tokens < 1 or max_context < 2 * chunk_tokens:
        raise UsageError(f"--max-context must be at least two chunks ({2 * chunk_tokens} tokens)")

    def whole(n: float) -> int:
        return max(chunk_tokens, round(n / chunk_tokens) * chunk_tokens)

    lengths = [whole(max_context * hit_rate ** (turns - 1 - i)) for i in range(turns)]
    cached = [whole(lengths[0] * hit_rate)] + lengths[:-1]
    result = []
    for n, c in zip(lengths, cached):
        if c >= n:
            raise UsageError(
                f"a {n}-token turn leaves no new tokens at hit rate {hit_rate} in {chunk_tokens}-token chunks; "
                "raise --max-context or lower --chunk-tokens"
            )
        result.append((n, c))
    return result


def build_trace(
    token_pool: Sequence[int],
    *,
    turns: int = 3,
    hit_rate: float = 0.8,
    max_context: int = 4096,
    chunk_tokens: int = 128,
    seed: int = 0,
    user_message_tokens: Sequence[Sequence[int]] = (),
) -> list[Turn]:
    """The turns of one agent session, their tokens drawn from ``token_pool`` (a tokenized real text).

    Each turn's new tokens stand for a tool output: runs of the pool starting at
    seeded random offsets, cut to fill the turn. With ``user_message_tokens``,
    each turn starts with one of them, as a chat's user message
    (``benchmarks/vs_lmcache`` sends such turns to a server).
    """
    plan = turn_lengths(turns, hit_rate, max_context, chunk_tokens)
    pool = list(token_pool)
    if len(pool) < 2:
        raise UsageError("the text pool holds fewer than two tokens")
    rng = random.Random(seed)

    def draw(count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            start = rng.randrange(len(pool))
            out.extend(pool[start : start + count - len(out)])
        return out

    tokens = draw(plan[0][1])  # the earlier session's context
    trace = []
    for index, (length, cached) in enumerate(plan):
        need = length - len(tokens)
        message = list(rng.choice(user_message_tokens))[:need] if user_message_tokens else []
        tokens = tokens + message + draw(need - len(message))
        trace.append(Turn(index, list(tokens), cached))
    return trace


def read_texts(folder: str | Path | None = None) -> str:
    """The real texts the traces are cut from, joined in name order; by default, in a source
    checkout, ``samples/texts``."""
    checkout = source_checkout()
    if folder is not None:
        root = Path(folder)
    elif checkout is not None:
        root = checkout / "samples" / "texts"
    else:
        raise UsageError("name a folder of real texts to cut the trace from (--texts)")
    files = sorted(p for p in root.glob("*") if p.is_file())
    if not files:
        raise UsageError(f"no text files in {root}")
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
