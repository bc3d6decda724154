"""``kvtool bench``: ratio, speed and entropy limits of recipes on real KV caches."""

from __future__ import annotations

import csv
import sys
from pathlib import Path
from typing import List, Optional

import typer

from kvtool.bench import recipes as recipe_sets
from kvtool.bench.matrix import run_bench
from kvtool.bench.plot import plot, require_matplotlib
from kvtool.bench.report import CSV_COLUMNS, column_decimals, csv_rows, headline, legend, limits_line, table_rows
from kvtool.cli._common import JSON_OPTION, MAX_THREADS, Command, existing_file, format_table, print_json, progress
from kvtool.kvz import DEFAULT_CHUNK_TOKENS
from kvtool.errors import UnavailableError, UsageError
from kvtool.paths import source_checkout
from kvtool.recipe import Recipe

def sample_files() -> list[Path]:
    """The committed sample caches, the default when kvtool runs from a source checkout."""
    checkout = source_checkout()
    files = sorted((checkout / "samples").glob("*.safetensors")) if checkout else []
    if not files:
        raise UsageError("no FILE given: name the KV caches (safetensors) to measure; "
                         "the repository's samples/*.safetensors are two")
    return files


def bench(
    files: Optional[List[Path]] = typer.Argument(None, help="KV caches (safetensors); default, in a source checkout: samples/*.safetensors."),
    recipes: Optional[List[str]] = typer.Option(
        None, "--recipes", "-r", help="Recipes to measure (repeat the option, or space-separate them); default: a quick set."
    ),
    all_recipes: bool = typer.Option(False, "--all", help="Every registered layout and codec at its sensible levels (slow)."),
    threads: int = typer.Option(0, "--threads", "-t", min=0, max=MAX_THREADS, help="Threads for the multi-thread runs (0: one per core)."),
    repeat: int = typer.Option(3, "--repeat", "-n", min=1, help="Time each run this many times and keep the best."),
    chunk_tokens: int = typer.Option(DEFAULT_CHUNK_TOKENS, "--chunk-tokens", min=1, help="Tokens per .kvz chunk."),
    peers: bool = typer.Option(True, "--peers/--no-peers", help="Also measure memcpy, lz4, zstd, Blosc2 and ZipNN on the same blocks."),
    json_out: bool = JSON_OPTION,
    csv_out: bool = typer.Option(False, "--csv", help="Print one CSV row per file and recipe on stdout."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Also draw the ratio/speed Pareto plot to this PNG."),
):
    """Measure recipes on real caches: ratio, MB/s, CPU s/GB, sizes per K/V/layer/plane, and the entropy limits."""
    if json_out and csv_out:
        raise UsageError("give --json or --csv, not both")
    if recipes and all_recipes:
        raise UsageError("give --recipes or --all, not both")
    paths = [existing_file(f) for f in files] if files else sample_files()
    named = [spec for value in recipes or [] for spec in value.split()]
    for spec in named:  # a typo fails now, not after minutes of measuring
        try:
            Recipe.parse(spec)
        except UnavailableError:
            pass  # measured as unavailable, with the reason
    if plot_path:
        require_matplotlib()
    choose = (lambda cache: named) if named else recipe_sets.everything if all_recipes else recipe_sets.quick

    with progress(desc="bench", unit="recipe") as bar:
        def step(label: str) -> None:
            bar.set_postfix_str(label[-50:], refresh=False)
            bar.update()

        report = run_bench(paths, choose, threads=threads or None, repeat=repeat, chunk_tokens=chunk_tokens, on_step=step, peers=peers)

    if plot_path:
        plot(report, plot_path)
    if json_out:
        print_json(report.to_dict())
    elif csv_out:
        writer = csv.DictWriter(sys.stdout, fieldnames=CSV_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(csv_rows(report))
    else:
        _print_tables(report)


def _print_tables(report) -> None:
    s, m = report.settings, report.machine
    typer.echo(
        f"kvtool bench: {m['cpu']}, {m['cores']} cores; chunks of {s['chunk_tokens']} tokens; "
        f"best of {s['repeat']}; 1 and {s['threads']} threads; MB/s of original data"
    )
    for file in report.files:
        typer.echo("")
        typer.echo(headline(file))
        typer.echo(limits_line(file))
        typer.echo(format_table(*table_rows(file, s["threads"]), decimals=column_decimals(s["threads"])))
    typer.echo("")
    for line in legend(s["threads"]):
        typer.echo(line)


def register(app: typer.Typer) -> None:
    from kvtool.cli._common import DefaultCommandGroup
    from kvtool.cli.accuracy import accuracy
    from kvtool.cli.ttft import ttft

    group = typer.Typer(
        cls=DefaultCommandGroup,
        help="Benchmarks: `kvtool bench [FILE...]` compares recipes (the `compression` command); "
        "`kvtool bench ttft` measures time to first token, restoring vs recomputing; "
        "`kvtool bench accuracy` measures what lossy recipes cost the model.",
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    group.command("compression", cls=Command)(bench)
    group.command("ttft", cls=Command)(ttft)
    group.command("accuracy", cls=Command)(accuracy)
    app.add_typer(group, name="bench")
