"""The ``kvtool`` command line: one Typer app, one module per command group."""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup

import kvtool
from kvtool.errors import KvtoolError


class _Group(TyperGroup):
    """Turns deliberate errors into one line on stderr and a meaningful exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvtoolError as exc:
            _fail(str(exc), exc.exit_code)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
            _fail(f"{exc.strerror}: {exc.filename}", 2)
        except BrokenPipeError:  # the reader went away (`kvtool ... | head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(141)
        except OSError as exc:
            _fail(str(exc), 1)


def _fail(message: str, code: int):
    typer.echo(f"kvtool: error: {message}", err=True)
    raise typer.Exit(code)


app = typer.Typer(
    cls=_Group,
    name="kvtool",
    help="Keep LLM KV caches instead of recomputing them: reorder, compress losslessly, store in tiers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        typer.echo(f"kvtool {kvtool.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    """Keep LLM KV caches instead of recomputing them."""


def _register_commands() -> None:
    from kvtool.cli import bench, codecs, dump, files, inspect, plan, reorder, serve, store

    for module in (bench, codecs, dump, files, inspect, plan, reorder, serve, store):
        module.register(app)


_register_commands()


def main() -> None:
    try:
        app(prog_name="kvtool")
    except KeyboardInterrupt:
        typer.echo("kvtool: interrupted", err=True)
        sys.exit(130)
