"""Find the key and value tensor of each layer in a file by a tensor-name pattern.

Caches dumped by other tools name their tensors in their own way; a pattern
such as ``model.layers.{layer}.self_attn.{k|v}`` says how.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvtool.errors import UsageError


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Turn ``model.layers.{layer}.self_attn.{k|v}`` into a regex with groups ``layer`` and ``kv``.

    ``{layer}`` (or ``{layer:02d}``) stands for the layer number and ``{K|V}``
    for the two literal names of the key and value tensors, key first.
    """
    parts = re.split(r"(\{[^{}]*\})", pattern)
    regex, seen = "", set()
    for part in parts:
        if re.fullmatch(r"\{layer(:0?\d*d)?\}", part):
            regex += r"(?P<layer>\d+)"
            seen.add("layer")
        elif re.fullmatch(r"\{[^{}|]+\|[^{}|]+\}", part):
            key, value = part[1:-1].split("|")
            regex += f"(?P<kv>{re.escape(key)}|{re.escape(value)})"
            seen.add("kv")
        elif "{" in part or "}" in part:
            raise UsageError(f"bad tensor-name pattern {pattern!r}: use {{layer}} and {{K|V}}")
        else:
            regex += re.escape(part)
    if seen != {"layer", "kv"}:
        raise UsageError(f"tensor-name pattern {pattern!r} needs both {{layer}} and {{K|V}}, e.g. L{{layer:02d}}.{{k|v}}")
    return re.compile(regex)


def match_names(names: list[str], pattern: str, path: Path) -> dict[int, tuple[str, str]]:
    """``{layer: (key tensor name, value tensor name)}`` for every layer ``pattern`` finds in ``names``."""
    regex = compile_pattern(pattern)
    key_name = re.findall(r"\{([^{}|]+)\|", pattern)[0]  # compile_pattern checked there is one
    found: dict[int, dict[str, str]] = {}
    for name in names:
        m = regex.fullmatch(name)
        if m:
            role = "k" if m["kv"] == key_name else "v"
            found.setdefault(int(m["layer"]), {})[role] = name
    if not found:
        raise UsageError(f"{path}: no tensor matches the pattern {pattern!r} (it holds e.g. {names[:3]})")
    incomplete = [lid for lid, kv in found.items() if len(kv) != 2]
    if incomplete:
        raise UsageError(f"{path}: layers {sorted(incomplete)} lack a key or a value tensor")
    return {lid: (kv["k"], kv["v"]) for lid, kv in sorted(found.items())}
