"""Byte sizes as people write them."""

from __future__ import annotations

import math

from kvtool.errors import UsageError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}
#: The largest size accepted: what a signed 64-bit length (and so every C library kvtool calls) can hold.
MAX_SIZE = (1 << 63) - 1


def parse_size(text: str | int) -> int:
    """``4096``, ``64KiB``, ``2GiB``, ``1.5GB`` -> a number of bytes, from 0 to ``MAX_SIZE``."""
    bad = UsageError(f"not a size: {text!r} (examples: 4096, 64KiB, 2GiB)")
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise bad
    s = str(text).strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):].strip()
    if unit not in _UNITS:
        raise bad
    try:  # whole numbers exactly; others (1.5GB, 1e9) through a float
        size = int(number) * _UNITS[unit] if number.strip().isdigit() else float(number) * _UNITS[unit]
    except ValueError:
        raise bad from None
    if not math.isfinite(size) or size < 0:
        raise bad
    if size > MAX_SIZE:
        raise UsageError(f"size {text!r} is too large (at most {MAX_SIZE} bytes)")
    return int(size)


def format_size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
