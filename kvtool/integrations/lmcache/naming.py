"""Store keys for LMCache's chunks, and the metadata that lets a restarted adapter find them again.

An LMCache ``ObjectKey`` is (chunk hash, model, KV rank, object group, cache
salt). kvtool keys an entry by a hash of all five and the recipe, so another
tenant's salt, another rank's slice or another recipe (a lossy entry for a
lossless lookup) never answers. The fields themselves go into the entry's
metadata: after a restart the adapter reads them back and checks that they hash
to the key they are stored under. Pure Python.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping

_PERSON = b"kvtool/lmcache/1"
#: Every entry the adapter writes has a key under this prefix.
PREFIX = "lmcache/"


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
        h = hashlib.blake2b(digest_size=32, person=_PERSON)
        for part in (self.model.encode(), str(self.kv_rank).encode(), str(self.group).encode(), self.salt.encode(),
                     self.recipe.encode(), bytes(self.chunk_hash)):
            h.update(len(part).to_bytes(8, "little") + part)
        return PREFIX + h.hexdigest()

    def meta(self, tokens: int, raw_bytes: int) -> dict[str, Any]:
        return {"tokens": tokens, "raw_bytes": raw_bytes,
                "lmcache": {"chunk": self.chunk_hash.hex(), "model": self.model, "kv_rank": self.kv_rank,
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
