"""Token positions: the one reading of a token range, and the hash of a token sequence."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from kvtool.errors import UsageError


def token_range(tokens: slice | None, num_tokens: int) -> tuple[int, int]:
    """``(start, stop)`` of ``tokens`` within a cache of ``num_tokens`` tokens, ``start <= stop``.

    ``None`` is every token. A stop past the end is cut at ``num_tokens``, as a
    Python slice is. Positions count from the first token held, so a negative
    position and a step are refused with ``UsageError`` rather than read as
    Python's from-the-end or strided slices.
    """
    if tokens is None:
        return 0, num_tokens
    if tokens.step not in (None, 1):
        raise UsageError(f"token ranges must be contiguous, not a step of {tokens.step}")
    for name, value in (("start", tokens.start), ("stop", tokens.stop)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 0):
            raise UsageError(f"token range {name} must be a position >= 0, not {value!r}")
    start = min(int(tokens.start or 0), num_tokens)
    stop = num_tokens if tokens.stop is None else min(int(tokens.stop), num_tokens)
    return start, max(start, stop)


def token_ids_hash(token_ids: Sequence[int]) -> str:
    """A stable hash of a token sequence (xxh3-64 of little-endian int64 ids)."""
    return xxhash.xxh3_64_hexdigest(np.asarray(token_ids, dtype="<i8").tobytes())
