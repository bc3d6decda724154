"""Small helpers shared by the CLI command modules."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm
from typer.core import TyperCommand, TyperGroup

from kvtool.errors import UsageError
from kvtool.fileio import check_output, check_regular

JSON_OPTION = typer.Option(False, "--json", help="Print machine-readable JSON on stdout.")

#: Set by the global ``-q``: no success summaries, progress bars or warnings.
_quiet = False


def set_quiet(value: bool) -> None:
    global _quiet
    _quiet = value


def setup_logging(level: int | str, *loggers: str) -> None:
    """Log kvtool's messages (and those of ``loggers``) to stderr at ``level``, as
    ``kvtool: LEVEL logger: message``.

    The handler sits on the ``kvtool`` logger, not the root, so an application that embeds
    kvtool keeps its own logging setup; it is replaced, not added again, when the app runs
    twice in one process, and writes to whatever ``sys.stderr`` is when a message comes.
    """
    for name in ("kvtool", *loggers):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
            logger.removeHandler(handler)
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("kvtool: %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)


class _StderrHandler(logging.StreamHandler):
    """A handler on the current ``sys.stderr`` (a test runner swaps it between runs)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def print_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, sort_keys=False))


def print_result(data: dict[str, Any], line: str, json_out: bool) -> None:
    """A command's result: ``data`` as JSON with ``--json``, else ``line`` (unless ``-q``)."""
    if json_out:
        print_json(data)
    elif not _quiet:
        typer.echo(line)


def format_table(rows: list[dict[str, Any]], columns: list[str], decimals: dict[str, int] | None = None) -> str:
    """A plain aligned text table: text left-aligned; numbers right-aligned, with the decimals
    ``decimals`` gives a column, else as many as the column's largest value leaves room for
    (3 below 10, 1 below 1000, else 0), so that a column's decimal points line up. A table
    printed again and again (a benchmark's) fixes its decimals, so a column reads the same each run."""
    numeric = [any(_is_number(row.get(col)) for row in rows) for col in columns]
    fixed = decimals or {}
    decimals_of = [fixed.get(col, decimals_for([row.get(col) for row in rows])) for col in columns]
    cells = [[_cell(row.get(col, ""), d) for col, d in zip(columns, decimals_of)] for row in rows]
    widths = [max([len(col)] + [len(r[i]) for r in cells]) for i, col in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    return "\n".join([line(columns)] + [line(r) for r in cells])


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    typer.echo(format_table(rows, columns))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def decimals_for(values: list[Any]) -> int:
    """Decimals to show a column's floats with: 3 below 10, 1 below 1000, else 0."""
    floats = [abs(v) for v in values if isinstance(v, float)]
    largest = max(floats, default=0.0)
    return 3 if largest < 10 else 1 if largest < 1000 else 0


def _cell(value: Any, decimals: int) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.{decimals}f}"
    return str(value)


class _HelpFixes:
    """Help text that reads as the code does: no ``<bool>`` type beside a flag, arguments
    named in capitals (``SRC DST``), the same in the usage line."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if param.param_type_name == "option" and (getattr(param, "is_flag", False) or getattr(param, "count", False)):
                param.metavar = ""
            elif param.param_type_name == "argument" and param.metavar is None:
                param.metavar = param.name.upper()
        return params


class Command(_HelpFixes, TyperCommand):
    """Every kvtool command: ``app.command(name, cls=Command)``."""

    def collect_usage_pieces(self, ctx):
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar + ("..." if param.nargs != 1 else "")
                pieces.append(name if param.required else f"[{name}]")
        return pieces


class Group(_HelpFixes, TyperGroup):
    """Every kvtool command group: ``typer.Typer(cls=Group)``."""


#: ``kvtool.format`` of a file written by ``kvtool reorder --layout``.
REORDERED_TAG = "kvcache-reordered/1"


def safetensors_format(path: Path) -> str | None:
    """The ``kvtool.format`` tag of a safetensors file; None when it has none or is not safetensors."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            return (f.metadata() or {}).get("kvtool.format")
    except Exception:  # noqa: BLE001 - safetensors raises its own types; the caller's reader reports the damage
        return None


def existing_file(path: Path) -> Path:
    """``path``, after checking that it is a regular file (a FIFO or a device would block or never end)."""
    if not path.exists():
        raise UsageError(f"no such file: {path}")
    check_regular(path)
    return path


def distinct_output(src: Path, dst: Path) -> Path:
    """``dst``, after checking that it can be written (``check_output``) and that writing it cannot
    replace ``src`` (same path, link or bind mount): before any work."""
    if src.resolve() == dst.resolve() or (dst.exists() and src.exists() and os.path.samefile(src, dst)):
        raise UsageError(f"the output {dst} is the input file; write to another path")
    check_output(dst)
    return dst


def progress(**kwargs) -> tqdm:
    """A tqdm bar on stderr that stays silent when stderr is not a terminal, or with ``-q``."""
    return tqdm(file=sys.stderr, disable=True if _quiet else None, dynamic_ncols=True, **kwargs)


#: Worker threads beyond this are a typo (``--threads 100000``), not a request.
MAX_THREADS = 1024


class DefaultCommandGroup(Group):
    """A command group whose arguments go to a default command unless they start with a command name.

    ``kvtool bench samples/*.safetensors`` runs the default command as
    ``kvtool bench compression samples/*.safetensors`` does, while
    ``kvtool bench ttft`` runs ``ttft``. ``--help`` alone shows the group.
    """

    default_command = "compression"

    def format_help(self, ctx, formatter):
        """The group's help, then the default command's, whose options ``kvtool bench FILE...`` takes."""
        super().format_help(ctx, formatter)
        command = self.commands.get(self.default_command)
        if command is not None:
            command.format_help(type(ctx)(command, info_name=self.default_command, parent=ctx), formatter)

    def parse_args(self, ctx, args):
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h")):
            args = [self.default_command, *args]
        return super().parse_args(ctx, args)
