"""``kvtool plan``: predict restore vs recompute time, break-even contexts and KV bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List, Optional

import typer

from kvtool import costmodel as model
from kvtool.cli._common import JSON_OPTION, Command, decimals_for, existing_file, print_json, print_table
from kvtool.errors import UsageError
from kvtool.units import format_size

GB = 1e9


def register(app: typer.Typer) -> None:
    app.command("plan", cls=Command)(plan)


def plan(
    model_config: Optional[Path] = typer.Option(None, "--model-config", help="A Hugging Face config.json or a .gguf file."),
    name: str = typer.Option("model", help="Model name for the report (when given by numbers)."),
    layers: Optional[int] = typer.Option(None, min=1, help="Layers (overrides the config)."),
    kv_heads: Optional[int] = typer.Option(None, min=1, help="KV heads (overrides the config)."),
    head_dim: Optional[int] = typer.Option(None, min=1, help="Head dimension (overrides the config)."),
    dtype: str = typer.Option("bf16", help=f"KV dtype: {', '.join(model.DTYPE_BYTES)}."),
    prefill_tps: Optional[float] = typer.Option(None, help="Prefill speed in tokens/s (a linear model)."),
    prefill_fit: Optional[str] = typer.Option(None, help="Prefill seconds as A,B,C in A + B*n + C*n^2."),
    calibrate: Optional[Path] = typer.Option(None, help="A `kvtool bench ttft --json` result: prefill fit, tiers, codecs and build rate measured there."),
    tier: Optional[List[str]] = typer.Option(None, help="NAME:GB_PER_S[:LATENCY_MS] per tier (repeatable)."),
    codec: Optional[List[str]] = typer.Option(None, help="NAME:RATIO:DECODE_GB_PER_S per codec (repeatable)."),
    bench_json: Optional[Path] = typer.Option(None, help="Codec ratios and decode rates from `kvtool bench --json`."),
    build_gbps: Optional[float] = typer.Option(None, help="GB/s into the engine's cache (host-to-device on a GPU)."),
    chunk_tokens: int = typer.Option(256, min=1, help="Tokens per store entry (latency is paid per entry)."),
    contexts: str = typer.Option("1024,4096,16384,32768,131072", help="Comma-separated context lengths to predict."),
    hit_rate: float = typer.Option(0.8, help="Share of each prompt that is stored."),
    concurrency: int = typer.Option(64, min=0, help="Running sessions whose KV the engine holds."),
    retained: int = typer.Option(1000, min=0, help="Idle sessions whose KV the store keeps for their return."),
    context: int = typer.Option(32768, min=1, help="Context per session for the byte counts."),
    validate: Optional[Path] = typer.Option(None, help="A `kvtool bench ttft --json` result to compare the predictions with."),
    json_out: bool = JSON_OPTION,
):
    """Predict TTFT with restore vs recompute per context, break-even context per tier and codec, and KV bytes."""
    shape = _shape(model_config, name, layers, kv_heads, head_dim, dtype)
    measured = json.loads(existing_file(calibrate).read_text()) if calibrate else None
    inputs = model.calibrate(measured, shape) if measured else model.default_inputs(shape)
    inputs = _override(inputs, prefill_tps, prefill_fit, tier, codec, bench_json, build_gbps, chunk_tokens)
    ctx = _ints(contexts)
    report = {
        "label": "model output (kvtool plan), not a measurement",
        "inputs": inputs.to_dict(),
        "predictions": model.predict(inputs, ctx, hit_rate),
        "break_even": model.break_even_table(inputs),
        "capacity": [
            {"codec": c.name, "context": context, "concurrency": concurrency, "retained": retained, **model.capacity(inputs, c, context, concurrency, retained)}
            for c in inputs.codecs
        ],
    }
    if validate:
        checks = model.validate(json.loads(existing_file(validate).read_text()), inputs)
        report["validation"] = checks
        report["max_abs_error"] = max(abs(r["error"]) for r in checks)
    if json_out:
        print_json(report)
        return
    _print_report(report, shape, inputs, validate is not None)


def _print_report(report: dict, shape: model.ModelShape, inputs: model.Inputs, validated: bool) -> None:
    """The report as a few readable tables: one row per context and tier, one column per codec."""
    p = inputs.prefill
    typer.echo(f"{report['label']}.")
    typer.echo(f"{shape.name}: {format_size(shape.bytes_per_token)}/token ({shape.layers} layers x {shape.kv_heads} KV heads "
               f"x {shape.head_dim} dims x K,V x {model.DTYPE_BYTES[shape.dtype]} bytes)")
    typer.echo(f"prefill {p.a:.4g} + {p.b:.4g}*n + {p.c:.4g}*n^2 s; build {inputs.build_rate / GB:.2f} GB/s")
    typer.echo("tiers: " + ", ".join(f"{t.name} {t.bandwidth / GB:.2f} GB/s + {t.latency * 1e3:.2f} ms/entry" for t in inputs.tiers))
    typer.echo("codecs: " + ", ".join(f"{c.name} ratio {c.ratio:.3f}, decode {c.decode_rate / GB:.2f} GB/s" for c in inputs.codecs))
    typer.echo("inputs from: " + "; ".join(f"{what}: {source}" for what, source in inputs.sources.items()))
    codecs = [c.name for c in inputs.codecs]
    rows: dict[tuple, dict] = {}
    places = decimals_for([r["ttft_restore_s"] for r in report["predictions"]])
    for r in report["predictions"]:
        row = rows.setdefault((r["context"], r["tier"]), {
            "context": r["context"], "stored": r["cached"], "recompute s": r["recompute_s"], "tier": r["tier"]})
        row[r["codec"]] = f"{r['ttft_restore_s']:.{places}f} s ({r['speedup']:.1f}x)"
    typer.echo("")
    typer.echo("Time to first token: recompute the whole prompt, or restore its stored part (speedup):")
    print_table(list(rows.values()), ["context", "stored", "recompute s", "tier", *codecs])
    breaks: dict[str, dict] = {}
    for r in report["break_even"]:
        breaks.setdefault(r["tier"], {"tier": r["tier"]})[r["codec"]] = r["break_even_tokens"]
    typer.echo("")
    typer.echo("Break-even: shortest stored prefix (tokens) that restores faster than it recomputes:")
    print_table(list(breaks.values()), ["tier", *codecs])
    if report["capacity"]:
        first = report["capacity"][0]
        typer.echo("")
        typer.echo(f"KV bytes at {first['context']} tokens per session: {first['concurrency']} running in the engine, "
                   f"{first['retained']} idle kept in the store:")
        print_table([{"codec": c["codec"], "engine": format_size(c["engine_bytes"]), "store": format_size(c["store_bytes"])}
                     for c in report["capacity"]], ["codec", "engine", "store"])
    if validated:
        typer.echo("")
        typer.echo("Predictions against the measurements:")
        print_table(report["validation"], ["config", "turn", "tokens", "measured_s", "predicted_s", "error"])
        typer.echo(f"largest error: {100 * report['max_abs_error']:.1f}%")


def _shape(config: Optional[Path], name: str, layers, kv_heads, head_dim, dtype: str) -> model.ModelShape:
    if dtype not in model.DTYPE_BYTES:
        raise UsageError(f"unknown dtype {dtype!r}; known: {', '.join(model.DTYPE_BYTES)}")
    base = None
    if config:
        existing_file(config)
        base = model.shape_from_gguf(config, dtype) if config.suffix == ".gguf" else model.shape_from_config(config, dtype)
    values: dict[str, Any] = {
        "name": base.name if base else name,
        "layers": layers or (base and base.layers),
        "kv_heads": kv_heads or (base and base.kv_heads),
        "head_dim": head_dim or (base and base.head_dim),
    }
    missing = [k for k, v in values.items() if not v]
    if missing:
        raise UsageError(f"give --model-config or all of --layers, --kv-heads, --head-dim (missing: {', '.join(missing)})")
    return model.ModelShape(dtype=dtype, **values)


def _override(inputs: model.Inputs, tps, fit, tiers, codecs, bench_json, build_gbps, chunk_tokens) -> model.Inputs:
    changes: dict = {"chunk_tokens": chunk_tokens}
    sources = dict(inputs.sources)
    if tps and fit:
        raise UsageError("give --prefill-tps or --prefill-fit, not both")
    if tps:
        changes["prefill"], sources["prefill"] = model.Prefill.from_tokens_per_second(tps), "--prefill-tps"
    if fit:
        a, b, c = _floats(fit, 3, "--prefill-fit")
        changes["prefill"], sources["prefill"] = model.Prefill(a, b, c), "--prefill-fit"
    if tiers:
        changes["tiers"], sources["tiers"] = [_tier(t) for t in tiers], "--tier"
    if codecs:
        changes["codecs"], sources["codecs"] = [_codec(c) for c in codecs], "--codec"
    elif bench_json:
        changes["codecs"], sources["codecs"] = model.codecs_from_bench(existing_file(bench_json)), str(bench_json)
    if build_gbps:
        changes["build_rate"], sources["build_rate"] = build_gbps * GB, "--build-gbps"
    return model.Inputs(**{**inputs.__dict__, **changes, "sources": sources})


def _tier(text: str) -> model.Tier:
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise UsageError(f"--tier {text!r}: write NAME:GB_PER_S[:LATENCY_MS]")
    values = _floats(",".join(parts[1:]), len(parts) - 1, "--tier")
    return model.Tier(parts[0], values[0] * GB, (values[1] if len(values) > 1 else 0.0) / 1e3)


def _codec(text: str) -> model.CodecCost:
    parts = text.rsplit(":", 2)
    if len(parts) != 3:
        raise UsageError(f"--codec {text!r}: write NAME:RATIO:DECODE_GB_PER_S")
    ratio, rate = _floats(",".join(parts[1:]), 2, "--codec")
    return model.CodecCost(parts[0], ratio, rate * GB)


def _floats(text: str, count: int, option: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"{option} {text!r}: expected {count} numbers") from None
    if len(values) != count or (option != "--prefill-fit" and values[0] <= 0):
        raise UsageError(f"{option} {text!r}: expected {count} numbers, the first positive")
    return values


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--contexts {text!r}: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise UsageError("--contexts needs positive token counts")
    return values
