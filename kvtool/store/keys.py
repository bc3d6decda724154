"""Keys for cached prefixes: chained hashes of token chunks, per model, recipe and tenant.

A prompt's tokens are cut into chunks of ``chunk_tokens`` (the last may be
shorter), and chunk ``i`` is stored as its own entry under::

    root    = H("kvtool/prefix/1", model_id, recipe, salt)
    hash_i  = H(hash_{i-1} or root, tokens of chunk i)

with ``H`` BLAKE2b-256 over length-prefixed fields and tokens as little-endian
u32. A chunk's key thus names the whole prefix up to its end, so two prompts
that share a prefix share the entries for it, and the longest cached prefix is
found by walking the chunk keys until the first miss (one entry per chunk, as
LMCache and vLLM's block hashes do; ``Store.put_prefix`` and
``Store.get_prefix`` store and find them). The model, recipe and tenant salt are
inside every key: caches of another model, another encoding or another tenant
can never be hit, whatever their tokens.

The key of a short last chunk differs from any full chunk's, so it matches only
a prompt with exactly that many tokens in that chunk; a longer prompt restores
the full chunks it shares and recomputes the rest.
"""

from __future__ import annotations

import hashlib
import operator
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from kvtool.errors import UsageError

if TYPE_CHECKING:
    import numpy as np

_PERSON = b"kvtool/prefix/1"


@dataclass(frozen=True)
class PrefixKeyer:
    """Derives the chunk keys of token sequences for one model, recipe and tenant."""

    model_id: str
    recipe: str
    salt: str = ""
    chunk_tokens: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens <= 0:
            raise UsageError(f"chunk_tokens must be a positive integer, not {self.chunk_tokens!r}")
        if not self.model_id:
            raise UsageError("a prefix key needs a model id")

    def keys(self, tokens: Sequence[int] | np.ndarray) -> list[str]:
        """One key per chunk of ``tokens``, in order."""
        ids = _token_bytes(tokens)
        previous = self._root()
        keys = []
        step = 4 * self.chunk_tokens
        for start in range(0, len(ids), step):
            h = hashlib.blake2b(digest_size=32, person=_PERSON)
            h.update(previous)
            h.update(_field(ids[start:start + step]))
            previous = h.digest()
            keys.append(previous.hex())
        return keys

    def chunk_lengths(self, n_tokens: int) -> list[int]:
        """How many tokens each chunk of an ``n_tokens`` sequence holds."""
        full, rest = divmod(n_tokens, self.chunk_tokens)
        return [self.chunk_tokens] * full + ([rest] if rest else [])

    def _root(self) -> bytes:
        h = hashlib.blake2b(digest_size=32, person=_PERSON)
        for text in (self.model_id, self.recipe, self.salt):
            h.update(_field(text.encode("utf-8")))
        return h.digest()


def prefix_keys(
    tokens: Sequence[int] | np.ndarray, chunk_tokens: int, model_id: str, recipe: str, salt: str = ""
) -> list[str]:
    """The chunk keys of ``tokens``; see the module docstring."""
    return PrefixKeyer(model_id, recipe, salt, chunk_tokens).keys(tokens)


@dataclass(frozen=True)
class PrefixHit:
    """The longest cached prefix of a prompt: one value per chunk, and how many tokens they cover."""

    values: list[bytes]
    tokens: int
    keys: list[str]


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32; a list is packed without numpy, so ``import kvtool.store`` needs none."""
    if not isinstance(tokens, (list, tuple, range)):  # an array (numpy, torch): numpy is loaded already
        import numpy as np

        ids = np.asarray(tokens)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise UsageError("tokens must be a one-dimensional sequence of integer token ids")
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
            raise UsageError("token ids must lie in 0 .. 2**32-1")
        return ids.astype("<u4").tobytes()
    bad = UsageError("tokens must be a one-dimensional sequence of integer token ids")
    if any(isinstance(t, bool) for t in tokens):
        raise bad
    try:
        values = [operator.index(t) for t in tokens]  # ints, numpy ints; not floats, strings or lists
    except TypeError:
        raise bad from None
    if values and (min(values) < 0 or max(values) > 0xFFFFFFFF):
        raise UsageError("token ids must lie in 0 .. 2**32-1")
    return struct.pack(f"<{len(values)}I", *values)


def _field(data: bytes) -> bytes:
    return len(data).to_bytes(8, "little") + data
