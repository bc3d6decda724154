"""The root ``kvtool`` command group: global options, error handling, and commands loaded on demand."""

from __future__ import annotations

import logging
import os
import signal
import sys
from difflib import get_close_matches

import typer
from typer.exceptions import TyperException

import kvtool
from kvtool.cli._common import Group, set_quiet, setup_logging
from kvtool.errors import KvtoolError

#: Every top-level command: the module under ``kvtool.cli`` that defines it, and its one-line help,
#: in the order ``kvtool --help`` lists them. A module is imported only when one of its commands
#: runs or shows its own help, so ``kvtool codecs`` never imports the benchmarks and ``kvtool
#: --help`` imports none (a test checks each line against its command's docstring).
COMMANDS = {
    "inspect": ("inspect", ("Show a cache's model, shape, dtype and provenance, and per layer its values' statistics "
                           "(a raw cache) or compression ratios (a .kvz).")),
    "compress": ("files", "Compress a KV cache into a .kvz, or any file into one codec stream."),
    "decompress": ("files", ("Decompress a .kvz back into a safetensors cache (bit-exact, or the approximation a lossy "
                            "recipe stored), or a plain stream into its bytes.")),
    "verify": ("files", "Check a .kvz's header, index and every chunk checksum."),
    "reorder": ("reorder", ("Write a cache's tensors split and reordered by a layout chain, one tensor per plane; "
                           "--inverse undoes it.")),
    "codecs": ("codecs", "List every registered codec: available or why not, and the implementation it runs on."),
    "bench": ("bench", ("Benchmarks: `kvtool bench [FILE...]` compares recipes (the `compression` command); `kvtool "
                       "bench ttft` measures time to first token, restoring vs recomputing; `kvtool bench accuracy` "
                       "measures what lossy recipes cost the model.")),
    "plan": ("plan", ("Predict TTFT with restore vs recompute per context, break-even context per tier and codec, "
                     "whether each codec restores faster than storing raw on each tier, and KV bytes.")),
    "store": ("store", ("Put, get, list and evict entries of a KV cache store (memory, file, redis, or tiers of them), "
                       "or of a running API server's store with --api.")),
    "serve": ("serve", ("Serve the hot/cold scheduling API (pin, prefetch, offload, evict, hint, lookup, events, "
                       "metrics) over a store.")),
    "train": ("train", "Learn a model dictionary from caches of a model; use it as the recipe `ctxans:NAME.kvd` (or, with --basis, `pca:NAME.kvd,step=0.3|zstd:1`)."),
    "dump": ("dump", "Run a model over a text and save its KV cache."),
    "import": ("dump", "Convert another tool's safetensors KV dump into kvtool's own."),
    "convert-model": ("dump", "Save the model (default: the dequantised SmolLM2 GGUF) as a plain Hugging Face folder."),
}


class _RootGroup(Group):
    """Loads command modules on demand, and turns deliberate errors into one line on stderr
    and a meaningful exit code."""

    _listing = False  # while the root's own help is written: commands are listed, not loaded

    def list_commands(self, ctx):
        return list(COMMANDS)

    def format_help(self, ctx, formatter):
        self._listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self._listing = False

    def get_command(self, ctx, cmd_name):
        if self._listing and cmd_name not in self.commands and cmd_name in COMMANDS:
            import click

            return click.Command(cmd_name, help=COMMANDS[cmd_name][1])
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            import importlib

            module = importlib.import_module(f"kvtool.cli.{COMMANDS[cmd_name][0]}")
            commands = typer.Typer()
            module.register(commands)
            self.commands.update(typer.main.get_group(commands).commands)
        return self.commands.get(cmd_name)

    def resolve_command(self, ctx, args):
        try:
            return super().resolve_command(ctx, args)
        except TyperException as exc:  # an unknown command: suggest from every command, loaded or not
            matches = get_close_matches(args[0], list(COMMANDS)) if args else []
            if matches and "Did you mean" not in exc.message:
                exc.message = f"{exc.message.rstrip('.')}. Did you mean {', '.join(map(repr, matches))}?"
            raise

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
    cls=_RootGroup,
    name="kvtool",
    help="Keep LLM KV caches instead of recomputing them: reorder, compress losslessly, store in tiers.",
    epilog="Exit codes: 0 done; 1 not done (no such entry, not stored); 2 usage; 3 unavailable (a missing "
    "library, a store server that does not answer); 4 input that does not decode (corrupt, not this format, "
    "over --max-size); 130 interrupted; 143 terminated. Environment variables: see docs/ENVIRONMENT.md.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool):
    if value:
        typer.echo(f"kvtool {kvtool.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, show_default=False, help="Log more: -v what kvtool does, -vv debugging detail."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only errors and the results asked for: no summaries, progress bars or warnings."),
):
    """Keep LLM KV caches instead of recomputing them."""
    if verbose and quiet:
        raise typer.BadParameter("give -v or -q, not both")
    set_quiet(quiet)
    setup_logging(logging.ERROR if quiet else max(logging.DEBUG, logging.WARNING - 10 * verbose))


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that partly written files are removed on the way out."""


def _on_sigterm(signum, frame):
    raise Terminated


#: A one-shot command owns its terminal: QATzip's software fallback prints a probe line on every
#: call, filtered even while the command's worker threads run. ``kvtool serve`` keeps the
#: library's rule (filtered only while one thread runs): pointing file descriptor 2 elsewhere
#: would hold back the other threads' messages in a long-running server.
QATZIP_FILTER_VAR = "KVTOOL_QATZIP_FILTER_STDERR"


def _command_name(args: list[str]) -> str | None:
    return next((arg for arg in args if not arg.startswith("-")), None)


def run() -> None:
    signal.signal(signal.SIGTERM, _on_sigterm)
    if _command_name(sys.argv[1:]) != "serve":
        os.environ.setdefault(QATZIP_FILTER_VAR, "1")
    try:
        app(prog_name="kvtool")
    except KeyboardInterrupt:
        typer.echo("kvtool: interrupted", err=True)
        sys.exit(130)
    except Terminated:
        typer.echo("kvtool: terminated", err=True)
        sys.exit(143)
