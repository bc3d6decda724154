"""Scheduler-side planning: which stored entries a request can restore, and which blocks to save.

Pure Python (no vLLM, no torch), so it is unit-tested with fake requests.

A request's prompt is cut into vLLM blocks; ``blocks_per_entry`` consecutive
blocks (all layers) form one store entry, and the prompt's last entry may hold
fewer blocks. vLLM gives every full block a hash chained over the whole prefix
up to it (including the request's ``cache_salt`` and any multimodal or LoRA
keys), so an entry is named by the hash of its last block, the number of blocks
it holds, and a root that binds the model, recipe, KV dtype, block size and
tensor-parallel layout. Each tensor-parallel rank stores its own heads under
its own key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from kvtool.store import Store

_PERSON = b"kvtool/vllm/1"


@dataclass(frozen=True)
class EntryNamer:
    """Derives store keys for entries from vLLM block hashes."""

    model_id: str
    recipe: str
    kv_dtype: str
    block_size: int
    tp_size: int = 1

    def entry_id(self, last_block_hash: bytes, num_blocks: int) -> str:
        h = hashlib.blake2b(digest_size=32, person=_PERSON)
        for part in (self.model_id, self.recipe, self.kv_dtype, str(self.block_size), str(self.tp_size), str(num_blocks)):
            raw = part.encode("utf-8")
            h.update(len(raw).to_bytes(8, "little") + raw)
        h.update(len(last_block_hash).to_bytes(8, "little") + bytes(last_block_hash))
        return h.hexdigest()

    def key(self, entry_id: str, rank: int) -> str:
        return f"vllm/{entry_id}/tp{rank}"

    def keys(self, entry_id: str) -> list[str]:
        return [self.key(entry_id, rank) for rank in range(self.tp_size)]


@dataclass(frozen=True)
class EntrySpan:
    """Blocks ``start .. start + num_blocks - 1`` of a request, stored as entry ``entry_id``."""

    entry_id: str
    start: int
    num_blocks: int

    @property
    def end(self) -> int:
        return self.start + self.num_blocks


@dataclass
class LoadJob:
    """Restore ``entry_id``'s blocks ``first_block ..`` into the paged blocks ``block_ids``."""

    entry_id: str
    num_blocks: int  # blocks the entry holds
    first_block: int  # first of them to copy (earlier ones vLLM already has)
    block_ids: list[int]


@dataclass
class SaveJob:
    """Store the paged blocks ``block_ids`` (all of one entry) as ``entry_id``."""

    entry_id: str
    block_ids: list[int]


@dataclass
class StepPlan:
    """What the worker does in one engine step, per request id."""

    loads: dict[str, list[LoadJob]] = field(default_factory=dict)
    saves: dict[str, list[SaveJob]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


def find_stored_prefix(
    block_hashes: Sequence[bytes],
    usable_blocks: int,
    blocks_per_entry: int,
    namer: EntryNamer,
    is_stored: Callable[[list[str]], list[bool]],
    tokens_held: Callable[[list[str]], list[int | None]] | None = None,
) -> list[EntrySpan]:
    """The longest run of stored entries from the first block, within ``usable_blocks``.

    Entries start at multiples of ``blocks_per_entry``. Where the full-size
    entry is missing, a shorter one (a stored prompt's last entry) is tried,
    longest first; it ends the run. ``is_stored`` answers for a list of keys.
    ``tokens_held`` (``tokens_in(store)``), if given, says how many tokens the
    entry found holds: one that holds another count than its blocks is never
    claimed, and ends the run.
    """
    usable = min(usable_blocks, len(block_hashes))
    spans: list[EntrySpan] = []
    start = 0
    while start < usable:
        full = min(blocks_per_entry, usable - start)
        candidates = [EntrySpan(namer.entry_id(block_hashes[start + n - 1], n), start, n) for n in range(full, 0, -1)]
        keys = [key for span in candidates for key in namer.keys(span.entry_id)]
        present = is_stored(keys)
        ranks = namer.tp_size
        found = next(
            (span for i, span in enumerate(candidates) if all(present[i * ranks:(i + 1) * ranks])), None
        )
        if found is None:
            break
        expected = found.num_blocks * namer.block_size
        if tokens_held is not None and any(t != expected for t in tokens_held(namer.keys(found.entry_id))):
            break
        spans.append(found)
        if found.num_blocks < blocks_per_entry:
            break
        start = found.end
    return spans


def tokens_in(store: "Store") -> Callable[[list[str]], list[int | None]]:
    """``tokens_held`` for ``find_stored_prefix``: the token count in each entry's metadata (None if absent).

    Only the store's index or headers are read, never a value: the scheduler
    cheaply refuses an entry of the wrong size; a damaged value is found when
    the worker reads it.
    """
    def held(keys: list[str]) -> list[int | None]:
        infos = [store.info(key) for key in keys]
        return [None if info is None else info.tokens for info in infos]

    return held


def load_jobs(
    spans: Sequence[EntrySpan], local_blocks: int, block_ids: Sequence[int], limit_blocks: int | None = None
) -> list[LoadJob]:
    """Jobs restoring the blocks of ``spans`` from ``local_blocks`` (what vLLM already holds) to ``limit_blocks``.

    ``block_ids`` are all the request's paged blocks, in token order.
    """
    limit = min(len(block_ids), limit_blocks if limit_blocks is not None else len(block_ids))
    jobs = []
    for span in spans:
        first, end = max(span.start, local_blocks), min(span.end, limit)
        if first < end:
            jobs.append(LoadJob(span.entry_id, span.num_blocks, first - span.start, list(block_ids[first:end])))
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
    block_ids: list[int] = field(default_factory=list)
    saved_blocks: int = 0  # blocks before this are stored or already planned

    def restored_blocks(self) -> int:
        return self.stored[-1].end if self.stored else 0
