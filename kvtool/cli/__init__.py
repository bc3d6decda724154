"""The ``kvtool`` command line: one Typer app, one module per command group."""

from __future__ import annotations

import os
import signal
import sys

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

import kvtool
from kvtool.errors import KvtoolError


class _Group(TyperGroup):
    """Turns deliberate errors into one line on stderr and a meaningful exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KvtoolError as exc:
            _fail(str(exc), exc.exit_code)
        except TyperException as exc:  # a bad option or argument: one line too, and where the help is
            message, ctx = exc.format_message(), getattr(exc, "ctx", None)
            if not message:  # a group called without a command has printed its help
                raise
            _fail(f"{message} (see {ctx.command_path if ctx else 'kvtool'} --help)", exc.exit_code)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
            _fail(f"{exc.strerror}: {exc.filename}", 2)
        except BrokenPipeError:  # the reader went away (`kvtool ... | head`): stop quietly
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(141)
        except OSError as exc:
            _fail(str(exc), 1)
        except MemoryError:
            _fail("out of memory (a smaller --max-size, fewer --threads or a smaller selection may fit)", 1)


def _fail(message: str, code: int):
    typer.echo(f"kvtool: error: {message}", err=True)
    raise typer.Exit(code)


app = typer.Typer(
    cls=_Group,
    name="kvtool",
    help="Keep LLM KV caches instead of recomputing them: reorder, compress losslessly, store in tiers.",
    epilog="Exit codes: 0 done; 1 not done (no such entry, not stored); 2 usage; 3 unavailable (a missing "
    "library, a store server that does not answer); 4 input that does not decode (corrupt, not this format, "
    "over --max-size); 130 interrupted; 143 terminated.",
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
    from kvtool.cli import bench, codecs, dump, files, inspect, plan, reorder, serve, store, train

    for module in (bench, codecs, dump, files, inspect, plan, reorder, serve, store, train):
        module.register(app)


_register_commands()


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that partly written files are removed on the way out."""


def _on_sigterm(signum, frame):
    raise Terminated


def main() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        app(prog_name="kvtool")
    except KeyboardInterrupt:
        typer.echo("kvtool: interrupted", err=True)
        sys.exit(130)
    except Terminated:
        typer.echo("kvtool: terminated", err=True)
        sys.exit(143)
