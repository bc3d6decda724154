"""Small helpers shared by the CLI command modules."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm
from typer.core import TyperGroup

from kvtool.errors import UsageError
from kvtool.fileio import check_regular

JSON_OPTION = typer.Option(False, "--json", help="Print machine-readable JSON on stdout.")


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """A plain aligned text table; numbers right-aligned."""
    cells = [[_fmt(row.get(col, "")) for col in columns] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]
    numeric = [all(isinstance(row.get(col), (int, float)) for row in rows) for col in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    typer.echo(line(columns))
    for r in cells:
        typer.echo(line(r))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def existing_file(path: Path) -> Path:
    """``path``, after checking that it is a regular file (a FIFO or a device would block or never end)."""
    if not path.exists():
        raise UsageError(f"no such file: {path}")
    check_regular(path)
    return path


def distinct_output(src: Path, dst: Path) -> Path:
    """``dst``, after checking that writing it cannot replace ``src`` (same path, link or bind mount)."""
    if src.resolve() == dst.resolve() or (dst.exists() and src.exists() and os.path.samefile(src, dst)):
        raise UsageError(f"the output {dst} is the input file; write to another path")
    return dst


def progress(**kwargs) -> tqdm:
    """A tqdm bar on stderr that stays silent when stderr is not a terminal."""
    return tqdm(file=sys.stderr, disable=None, dynamic_ncols=True, **kwargs)


class DefaultCommandGroup(TyperGroup):
    """A command group whose arguments go to a default command unless they start with a command name.

    ``kvtool bench samples/*.safetensors`` runs the default command as
    ``kvtool bench compression samples/*.safetensors`` does, while
    ``kvtool bench ttft`` runs ``ttft``. ``--help`` alone shows the group.
    """

    default_command = "compression"

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)
