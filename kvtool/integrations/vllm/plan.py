"""Scheduler-side planning: which stored entries a request restores into which blocks, and which blocks to save.

Pure Python (no vLLM, no torch), so it is unit-tested with fake requests.
Entries are named and found by ``kvtool.entries.names`` (``EntryNamer``,
``find_stored_prefix``); this module turns what was found into per-step jobs.
A job names its paged blocks per KV cache group (``kv_groups``): one list per
group, the same blocks of the prompt in each, ``SKIPPED`` where vLLM keeps no
block for that group (outside a sliding window).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from numbers import Integral
from typing import Sequence, cast

from kvtool.entries.names import EntryNamer, EntrySpan
from kvtool.integrations.vllm.kv_groups import NULL_BLOCK, SKIPPED

#: A request's paged blocks, one list per KV cache group (a single list is read as one group's).
BlockTable = tuple[list[int], ...]


def block_table(block_ids: Sequence[Sequence[int]] | Sequence[int]) -> BlockTable:
    """One list per group; a flat list of ints is one group's."""
    if all(isinstance(b, Integral) for b in block_ids):
        return ([int(cast(Integral, b)) for b in block_ids],)
    return tuple(list(cast("Sequence[int]", ids)) for ids in block_ids)


def kept(block_ids: Sequence[int]) -> list[int]:
    """vLLM's block ids with its null block (one it does not keep) as ``SKIPPED``."""
    return [SKIPPED if b == NULL_BLOCK else b for b in block_ids]


@dataclass
class LoadJob:
    """Restore ``entry_id``'s blocks ``first_block ..`` into the paged blocks ``block_ids`` (per group)."""

    entry_id: str
    num_blocks: int  # blocks the entry holds
    first_block: int  # first of them to copy (earlier ones vLLM already has)
    block_ids: BlockTable

    def __post_init__(self) -> None:
        self.block_ids = block_table(self.block_ids)

    @property
    def restored_blocks(self) -> int:
        """Blocks of the prompt this job covers (some may be ``SKIPPED`` in some groups)."""
        return len(self.block_ids[0])

    def written_blocks(self) -> set[int]:
        """The paged blocks this job writes, in every group."""
        return {b for ids in self.block_ids for b in ids if b != SKIPPED}


@dataclass
class SaveJob:
    """Store the paged blocks ``block_ids`` (per group, all of one entry) as ``entry_id``; ``first_token``: the
    prompt position of its first token, which a stage that codes by position (``pca`` de-rotates keys) needs."""

    entry_id: str
    block_ids: BlockTable
    first_token: int = 0

    def __post_init__(self) -> None:
        self.block_ids = block_table(self.block_ids)


@dataclass
class StepPlan:
    """What the worker does in one engine step, per request id."""

    loads: dict[str, list[LoadJob]] = field(default_factory=dict)
    saves: dict[str, list[SaveJob]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


def load_jobs(
    spans: Sequence[EntrySpan], local_blocks: int, block_ids: Sequence[Sequence[int]] | Sequence[int],
    limit_blocks: int | None = None,
) -> list[LoadJob]:
    """Jobs restoring the blocks of ``spans`` from ``local_blocks`` (what vLLM already holds) to ``limit_blocks``.

    ``block_ids`` are all the request's paged blocks, in token order, per group (``block_table``).
    """
    table = block_table(block_ids)
    limit = min(min(len(ids) for ids in table), limit_blocks if limit_blocks is not None else len(table[0]))
    jobs = []
    for span in spans:
        first, end = max(span.start, local_blocks), min(span.end, limit)
        if first < end:
            jobs.append(LoadJob(span.entry_id, span.num_blocks, first - span.start, tuple(ids[first:end] for ids in table)))
    return jobs


def entries_to_save(
    block_hashes: Sequence[bytes],
    prompt_blocks: int,
    computed_blocks: int,
    saved_blocks: int,
    blocks_per_entry: int,
    namer: EntryNamer,
) -> list[EntrySpan]:
    """Entries that became complete in this step, starting at block ``saved_blocks``.

    ``prompt_blocks``: full blocks of the prompt (only prompts are stored);
    ``computed_blocks``: full blocks whose KV exists once this step has run.
    A prompt's last entry may be shorter, once the whole prompt is computed.
    """
    limit = min(prompt_blocks, computed_blocks, len(block_hashes))
    spans = []
    start = saved_blocks
    while start < limit:
        n = min(blocks_per_entry, limit - start)
        if n < blocks_per_entry and limit < prompt_blocks:
            break  # wait until the entry is complete
        spans.append(EntrySpan(namer.entry_id(block_hashes[start + n - 1], n), start, n))
        start += n
    return spans


@dataclass
class RequestState:
    """What the scheduler-side connector remembers about one request."""

    block_hashes: Sequence[bytes]  # vLLM's list, which grows as the request does
    prompt_tokens: int
    local_tokens: int = 0  # vLLM's own prefix-cache hit at lookup
    stored: list[EntrySpan] = field(default_factory=list)  # found in the store at lookup
    block_ids: BlockTable = ()  # per group, ``SKIPPED`` where vLLM keeps no block
    saved_blocks: int = 0  # blocks before this are stored or already planned

    def restored_blocks(self) -> int:
        return self.stored[-1].end if self.stored else 0
