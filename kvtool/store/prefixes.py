"""How a prompt's stored entries are named and found: vLLM block hashes to store keys, longest stored prefix.

An entry holds ``blocks_per_entry`` consecutive vLLM blocks (all layers) of a
prompt, and the prompt's last entry may hold fewer. vLLM gives every full block
a hash chained over the whole prefix up to it (including the request's
``cache_salt`` and any multimodal or LoRA keys), so an entry is named by the
hash of its last block, the number of blocks it holds, and a root that binds
the model, recipe, KV dtype, block size and tensor-parallel layout. Each
tensor-parallel rank stores its own heads under its own key.

The vLLM connector names the entries it saves and finds the ones it restores
here; the HTTP API's lookup finds them the same way, without the connector.
Pure Python: no vLLM, no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    from kvtool.store.base import Store

_PERSON = b"kvtool/vllm/1"


def blocks_per_entry(chunk_tokens: int, block_size: int) -> int:
    """Whole vLLM blocks in an entry of about ``chunk_tokens`` tokens (at least one)."""
    return max(1, chunk_tokens // block_size)


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
