"""Every store key an integration writes, in one place: vLLM's block hashes, vLLM's offload chunks, LMCache's objects.

Each scheme hashes what the stored bytes mean (model, recipe, dtype, geometry,
the host's own hash of the prefix, which binds the tenant's cache salt) into a
fixed-length key with its own BLAKE2b personalisation and key prefix, so the
three never collide in a shared store and another recipe, model or tenant never
answers a lookup.

- ``EntryNamer`` (kvtool's vLLM connector and the HTTP API's lookup): an entry
  holds ``blocks_per_entry`` vLLM blocks of a prompt and is named by the hash of
  its last block, the blocks it holds and a root that binds the model, recipe, KV
  dtype, block size and tensor-parallel size; each rank stores its own heads
  under its own key. ``find_stored_prefix`` finds the longest stored run.
- ``ChunkNamer`` (the tier under vLLM's OffloadingConnector): vLLM's offload key
  (block hash + group) with the layout of the row that holds the chunk.
- ``ChunkName`` (the LMCache L2 adapter): an LMCache ``ObjectKey``'s fields and
  the recipe; the fields also go into the entry's metadata, so a restarted
  adapter finds its chunks again and checks they hash to their key.

Pure Python: no vLLM, LMCache or torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from kvtool.store.base import Store

#: Every key of the LMCache adapter's entries starts with this; the offload tier's with OFFLOAD_PREFIX.
LMCACHE_PREFIX = "lmcache/"
OFFLOAD_PREFIX = "vllm-tier/"
_LMCACHE_PERSON = b"kvtool/lmcache/1"
_OFFLOAD_PERSON = b"kvtool/vllm-tier"
#: Scheme 2: entries from vLLM's CPU backend hold their tokens' keys and values; under scheme 1 they held its kernels'
#: tiles, which only the same kernel reads back right, so those entries are never found again.
_VLLM_PERSON = b"kvtool/vllm/2"


def _digest(person: bytes, parts: Sequence[str | bytes]) -> str:
    """BLAKE2b-256 of length-prefixed parts: no two lists of parts hash alike by shifting bytes between them."""
    h = hashlib.blake2b(digest_size=32, person=person)
    for part in parts:
        raw = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        h.update(len(raw).to_bytes(8, "little") + raw)
    return h.hexdigest()


# --- kvtool's vLLM connector: entries of whole vLLM blocks ---------------------------------------


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
        return _digest(_VLLM_PERSON, (self.model_id, self.recipe, self.kv_dtype, str(self.block_size), str(self.tp_size),
                                      str(num_blocks), last_block_hash))

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


def tokens_in(store: Store) -> Callable[[list[str]], list[int | None]]:
    """``tokens_held`` for ``find_stored_prefix``: the token count in each entry's metadata (None if absent).

    Only the store's index or headers are read, never a value: the scheduler
    cheaply refuses an entry of the wrong size; a damaged value is found when
    the worker reads it.
    """
    def held(keys: list[str]) -> list[int | None]:
        infos = [store.info(key) for key in keys]
        return [None if info is None else info.tokens for info in infos]

    return held


# --- the tier under vLLM's OffloadingConnector: one entry per offload chunk ----------------------

@dataclass(frozen=True)
class ChunkNamer:
    """Store keys for vLLM's offload keys (block hash + group index).

    vLLM's block hash chains the whole prefix up to the chunk, and its first link
    includes the request's ``cache_salt`` (and any LoRA or multimodal inputs), so
    tenants with different salts never share a chunk. The rest of the key binds
    what the bytes mean: model, KV dtype, recipe, tokens per block and chunk, the
    parallel layout and the row layout, as kvtool's own connector binds its entries.
    """

    model: str
    kv_dtype: str
    recipe: str
    tokens: str  # tokens per hash / per block / per chunk
    parallel: str
    layout: str  # RowLayout.signature()

    def key(self, offload_key: bytes) -> str:
        return OFFLOAD_PREFIX + _digest(_OFFLOAD_PERSON, (self.model, self.kv_dtype, self.recipe, self.tokens, self.parallel,
                                                          self.layout, offload_key))


# --- the LMCache L2 adapter: one entry per LMCache object ----------------------------------------

@dataclass(frozen=True)
class ChunkName:
    """The fields of an LMCache ``ObjectKey``, and the recipe its entry is coded with."""

    chunk_hash: bytes
    model: str
    kv_rank: int
    group: int
    salt: str
    recipe: str

    @property
    def key(self) -> str:
        return LMCACHE_PREFIX + _digest(_LMCACHE_PERSON, (self.model, str(self.kv_rank), str(self.group), self.salt,
                                                          self.recipe, self.chunk_hash))

    def meta(self) -> dict[str, Any]:
        """What the entry's metadata keeps of the name (``from_meta`` reads it back)."""
        return {"lmcache": {"chunk": self.chunk_hash.hex(), "model": self.model, "kv_rank": self.kv_rank,
                            "group": self.group, "salt": self.salt, "recipe": self.recipe}}

    @classmethod
    def from_meta(cls, key: str, meta: Mapping[str, Any]) -> "ChunkName | None":
        """The name stored in an entry's metadata, if it is well formed and hashes to ``key``; else None."""
        fields = meta.get("lmcache")
        if not isinstance(fields, dict):
            return None
        chunk, model, salt, recipe = (fields.get(k) for k in ("chunk", "model", "salt", "recipe"))
        rank, group = fields.get("kv_rank"), fields.get("group")
        if not all(isinstance(v, str) for v in (chunk, model, salt, recipe)) \
                or not all(type(v) is int and v >= 0 for v in (rank, group)):
            return None
        try:
            chunk_hash = bytes.fromhex(chunk)  # type: ignore[arg-type]
        except ValueError:
            return None
        name = cls(chunk_hash, model, rank, group, salt, recipe)  # type: ignore[arg-type]
        return name if name.key == key else None
