"""``kvtool plan``: predict restore vs recompute time, break-even contexts and KV bytes."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, List, Optional

import typer

from kvtool import costmodel as model
from kvtool.model_shape import DTYPE_BYTES, ModelShape, shape_from_config
from kvtool.cli._common import JSON_OPTION, Command, decimals_for, existing_file, print_json, print_table
from kvtool.errors import UsageError
from kvtool.plan_presets import PRESETS
from kvtool.units import format_size

GB = 1e9


def register(app: typer.Typer) -> None:
    app.command("plan", cls=Command)(plan)


HARDWARE_HELP = ("Named hardware (docs/PLAN.md): " + "; ".join(f"{p.name}: {p.machine}" for p in PRESETS.values())
                 + ". Its prefill is used only for the models it was measured or estimated for.")


def plan(
    model_config: Optional[Path] = typer.Option(
        None, "--config", "--model-config",
        help="A Hugging Face config.json (its attention kinds: MLA latents, sliding windows, state layers) or a .gguf file."),
    name: Optional[str] = typer.Option(None, help="Model name for the report (default: the config's model, or 'model')."),
    layers: Optional[int] = typer.Option(None, min=1, help="Layers (overrides the config)."),
    kv_heads: Optional[int] = typer.Option(None, min=1, help="KV heads (overrides the config)."),
    head_dim: Optional[int] = typer.Option(None, min=1, help="Head dimension (overrides the config)."),
    dtype: str = typer.Option("bf16", help=f"KV dtype: {', '.join(DTYPE_BYTES)}."),
    hardware: Optional[str] = typer.Option(None, "--hardware", help=HARDWARE_HELP),
    prefill_tps: Optional[float] = typer.Option(None, help="Prefill speed in tokens/s (a linear model)."),
    prefill_fit: Optional[str] = typer.Option(None, help="Prefill seconds as A,B,C in A + B*n + C*n^2."),
    calibrate: Optional[Path] = typer.Option(None, help="A `kvtool bench ttft --json` result: prefill fit, tiers, codecs and build rate measured there."),
    tier: Optional[List[str]] = typer.Option(None, help="NAME:GB_PER_S[:LATENCY_MS] per tier (repeatable)."),
    codec: Optional[List[str]] = typer.Option(None, help="NAME:RATIO:DECODE_GB_PER_S per codec (repeatable)."),
    bench_json: Optional[Path] = typer.Option(None, help="Codec ratios and decode rates from `kvtool bench --json`."),
    build_gbps: Optional[float] = typer.Option(None, help="GB/s into the engine's cache (host-to-device on a GPU)."),
    decode_cores: float = typer.Option(1.0, min=0.01, help="Cores free for decoding: each codec's decode rate is "
                                       "one core's, and a restore's chunks decode in parallel."),
    chunk_tokens: Optional[int] = typer.Option(None, min=1, show_default=False,
                                               help="Tokens per store entry (latency is paid per entry); default: the hardware's, else 256."),
    contexts: str = typer.Option("1024,4096,16384,32768,131072", help="Comma-separated context lengths to predict."),
    hit_rate: float = typer.Option(0.8, help="Share of each prompt that is stored."),
    concurrency: int = typer.Option(64, min=0, help="Running sessions whose KV the engine holds."),
    retained: int = typer.Option(1000, min=0, help="Idle sessions whose KV the store keeps for their return."),
    context: int = typer.Option(32768, min=1, help="Context per session for the byte counts."),
    validate: Optional[Path] = typer.Option(None, help="A `kvtool bench ttft --json` result to compare the predictions with."),
    json_out: bool = JSON_OPTION,
):
    """Predict TTFT with restore vs recompute per context, break-even context per tier and codec, whether each
    codec restores faster than storing raw on each tier, and KV bytes.

    A cost model, not a measurement: it needs the model's shape and the hardware's speeds
    (--hardware NAME, --calibrate, or --prefill-*, --tier, --codec and --build-gbps), and prints
    every input and its source first. docs/PLAN.md describes the model, its inputs and the presets.
    """
    shape = _shape(model_config, name, layers, kv_heads, head_dim, dtype)
    measured = json.loads(existing_file(calibrate).read_text()) if calibrate else None
    given = _given(prefill_tps, prefill_fit, tier, codec, bench_json, build_gbps)
    inputs = replace(_inputs(shape, measured, hardware, given, chunk_tokens), decode_cores=decode_cores)
    ctx = _ints(contexts)
    report = {
        "label": "model output (kvtool plan), not a measurement",
        "inputs": inputs.to_dict(),
        "predictions": model.predict(inputs, ctx, hit_rate),
        "break_even": model.break_even_table(inputs),
        "pays": model.pays_table(inputs),
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


def _print_report(report: dict, shape: ModelShape, inputs: model.Inputs, validated: bool) -> None:
    """The inputs, each with its source, then the predictions as a few tables: one row per context
    and tier, one column per codec."""
    p, sources = inputs.prefill, inputs.sources
    typer.echo(f"kvtool plan for {shape.name}: {report['label']}. Inputs:")
    inputs_rows = [
        ("model", f"{format_size(shape.bytes_per_token)}/token ({shape.describe()})", sources.get("model", "")),
        ("prefill", f"{p.a:.4g} + {p.b:.4g}*n + {p.c:.4g}*n^2 s", sources["prefill"]),
        ("tiers", ", ".join(f"{t.name} {t.bandwidth / GB:.2f} GB/s + {t.latency * 1e3:.3g} ms/entry" for t in inputs.tiers),
         sources["tiers"]),
        ("codecs", ", ".join(f"{c.name} ratio {c.ratio:.3f}, decode {c.decode_rate / GB:.2f} GB/s" for c in inputs.codecs),
         sources["codecs"]),
        ("build", f"{inputs.build_rate / GB:.2f} GB/s into the engine's cache; {inputs.chunk_tokens} tokens per entry",
         sources["build_rate"]),
    ]
    for what, value, source in inputs_rows:
        typer.echo(f"  {what:<8} {value}" + (f"  [{source}]" if source else ""))
    for preset in PRESETS.values():
        if any(source.startswith(f"--hardware {preset.name}") for source in sources.values()):
            typer.echo(f"  --hardware {preset.name}: {preset.machine}")
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
        tokens = r["break_even_tokens"]
        breaks.setdefault(r["tier"], {"tier": r["tier"]})[r["codec"]] = NEVER if tokens is None else tokens
    typer.echo("")
    typer.echo("Break-even: shortest stored prefix (tokens) that restores faster than it recomputes "
               f"({NEVER}: recomputing stays faster up to {model.BREAK_EVEN_LIMIT} tokens):")
    print_table(list(breaks.values()), ["tier", *codecs])
    _print_pays(report["pays"], inputs.decode_cores)
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


def _print_pays(rows: list[dict], cores: float) -> None:
    """Per tier and codec: restore seconds per GB of KV against the uncompressed baseline, and where it pays."""
    if not rows:
        return
    typer.echo("")
    typer.echo(f"Does compression pay? Restore seconds per GB of KV (read the stored bytes, decode on {cores:g} "
               f"core{'s' if cores != 1 else ''}) against {rows[0]['baseline']}, and the tier speed below which it pays:")
    print_table([{"tier": r["tier"], "tier GB/s": f"{r['bandwidth'] / GB:g}", "codec": r["codec"], "s/GB": r["seconds_per_gb"],
                  f"{r['baseline']} s/GB": r["baseline_seconds_per_gb"], "saving": f"{r['saving']:+.0%}",
                  "pays": "yes" if r["pays"] else "no", "pays below": _speed(r["pays_below"])} for r in rows],
                ["tier", "tier GB/s", "codec", "s/GB", f"{rows[0]['baseline']} s/GB", "saving", "pays", "pays below"])


def _speed(bandwidth: float | None) -> str:
    if bandwidth is None:
        return "any speed"
    return "never" if bandwidth == 0 else f"{bandwidth / GB:.2f} GB/s ({bandwidth * 8 / GB:.1f} Gbit/s)"


#: A break-even cell where restoring never wins.
NEVER = "never"


def _shape(config: Optional[Path], name: Optional[str], layers, kv_heads, head_dim, dtype: str) -> ModelShape:
    """The config's shape (with its latents, windows and state layers), or the options', which override it."""
    if dtype not in DTYPE_BYTES:
        raise UsageError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    base = ModelShape("model", 0, 0, 0, dtype)
    if config:
        existing_file(config)
        base = model.shape_from_gguf(config, dtype) if config.suffix == ".gguf" else shape_from_config(config, dtype)
    given = {"name": name, "layers": layers, "kv_heads": kv_heads, "head_dim": head_dim}
    shape = replace(base, **{k: v for k, v in given.items() if v})
    missing = [k for k in ("layers", "kv_heads", "head_dim") if not getattr(shape, k)]
    if missing:
        raise UsageError(f"give --config or all of --layers, --kv-heads, --head-dim (missing: {', '.join(missing)})")
    return shape


#: The hardware inputs, and the options that give each.
HARDWARE_INPUTS = {"prefill": "--prefill-tps or --prefill-fit", "tiers": "--tier", "codecs": "--codec or --bench-json",
                   "build_rate": "--build-gbps"}


def _given(tps, fit, tiers, codecs, bench_json, build_gbps) -> dict[str, tuple[Any, str]]:
    """The hardware inputs the options give: name -> (value, source)."""
    given: dict[str, tuple[Any, str]] = {}
    if tps and fit:
        raise UsageError("give --prefill-tps or --prefill-fit, not both")
    if tps:
        given["prefill"] = model.Prefill.from_tokens_per_second(tps), "--prefill-tps"
    if fit:
        given["prefill"] = model.Prefill(*_floats(fit, 3, "--prefill-fit")), "--prefill-fit"
    if tiers:
        given["tiers"] = [_tier(t) for t in tiers], "--tier"
    if codecs:
        given["codecs"] = [_codec(c) for c in codecs], "--codec"
    elif bench_json:
        given["codecs"] = model.codecs_from_bench(existing_file(bench_json)), str(bench_json)
    if build_gbps:
        given["build_rate"] = build_gbps * GB, "--build-gbps"
    return given


def _inputs(shape: ModelShape, measured: Optional[dict], hardware: Optional[str],
            given: dict[str, tuple[Any, str]], chunk_tokens: Optional[int]) -> model.Inputs:
    """The model's inputs: a measured run's or a preset's, then what the options give. Every hardware
    input must come from somewhere, and a prefill only from a run or a preset of this model."""
    base: dict[str, tuple[Any, str]] = {}
    chunk = 256
    if measured is not None and hardware is not None:
        raise UsageError("give --calibrate or --hardware, not both")
    if measured is not None:
        run = model.calibrate(measured, shape)
        base = {what: (getattr(run, what), run.sources[what]) for what in HARDWARE_INPUTS}
        chunk = run.chunk_tokens
        ran = str(measured.get("model", ""))
        if not _same_model(ran, shape.name):
            del base["prefill"]  # that run's prefill is another model's
    elif hardware is not None:
        if hardware not in PRESETS:
            raise UsageError(f"unknown --hardware {hardware!r}; presets: {', '.join(PRESETS)} (docs/PLAN.md)")
        preset = PRESETS[hardware]
        source = f"--hardware {preset.name}"
        base = {"tiers": (list(preset.tiers), source), "codecs": (list(preset.codecs), source),
                "build_rate": (preset.build_rate, source)}
        chunk = preset.chunk_tokens
        fit = preset.prefill_for(shape.name)
        if fit is not None:
            base["prefill"] = fit, f"--hardware {preset.name}, for {shape.name}"
    chosen = {**base, **given}
    missing = [what for what in HARDWARE_INPUTS if what not in chosen]
    if "prefill" in missing and (measured is not None or hardware is not None):
        if measured is not None:
            where = f"the run in --calibrate measured {measured.get('model')!r}"
        else:
            where = f"--hardware {hardware} has a prefill only for {', '.join(PRESETS[str(hardware)].prefill)}"
        who = "an unnamed model (--name)" if shape.name == "model" else repr(shape.name)
        raise UsageError(f"{where}, not {who}: give its prefill with --prefill-tps or --prefill-fit")
    if missing:
        raise UsageError(
            f"kvtool plan predicts for hardware you describe: give --hardware ({', '.join(PRESETS)}; docs/PLAN.md), "
            f"--calibrate TTFT.json, or {', '.join(HARDWARE_INPUTS[m] for m in missing)}")
    sources = {what: source for what, (_, source) in chosen.items()}
    sources["model"] = "--layers/--kv-heads/--head-dim" if shape.name == "model" else shape.name
    return model.Inputs(model=shape, prefill=chosen["prefill"][0], tiers=chosen["tiers"][0],
                        codecs=chosen["codecs"][0], build_rate=chosen["build_rate"][0],
                        chunk_tokens=chunk_tokens or chunk, sources=sources)


def _same_model(measured: str, asked: str) -> bool:
    """Whether a run of ``measured`` (``SmolLM2-135M-Instruct.Q4_1``) speaks for ``asked`` (``SmolLM2-135M``)."""
    def plain(text: str) -> str:
        return text.lower().rsplit("/", 1)[-1]

    return bool(measured) and (plain(measured).startswith(plain(asked)) or plain(asked).startswith(plain(measured)))


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
