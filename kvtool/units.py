"""Byte sizes as people write them."""

from __future__ import annotations

from kvtool.errors import UsageError

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}


def parse_size(text: str | int) -> int:
    """``4096``, ``64KiB``, ``2GiB``, ``1.5GB`` -> a number of bytes."""
    if isinstance(text, int):
        return text
    s = text.strip().lower()
    number = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(number):].strip()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value < 0:
        raise UsageError(f"not a size: {text!r} (examples: 4096, 64KiB, 2GiB)")
    return int(value * _UNITS[unit])


def format_size(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
