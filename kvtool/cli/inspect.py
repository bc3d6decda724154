"""``kvtool inspect``: what a KV cache file holds and how its bits are distributed."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import numpy as np
import typer

from kvtool import kvz, stats
from kvtool.cache import KVCache
from kvtool.cli._common import JSON_OPTION, REORDERED_TAG, Command, existing_file, print_json, print_table, safetensors_format
from kvtool.cli.dicts import DICT_OPTION, use_dictionaries
from kvtool.errors import UsageError
from kvtool.layouts.lossy import lossy_stages
from kvtool.units import format_size

PATTERN_HELP = "Tensor-name pattern of a cache from another tool, e.g. 'model.layers.{layer}.self_attn.{k|v}'."


def inspect(
    file: Path = typer.Argument(..., help="A KV cache: a safetensors dump or a .kvz file."),
    json_out: bool = JSON_OPTION,
    pattern: Optional[str] = typer.Option(None, "--pattern", "-p", help=PATTERN_HELP),
    dictionaries: Optional[List[Path]] = DICT_OPTION,
):
    """Show a cache's model, shape, dtype and provenance, and per layer its values' statistics (a raw cache) or compression ratios (a .kvz)."""
    use_dictionaries([file], dictionaries)  # a transform stage's basis is reported by its dictionary
    report = file_report(existing_file(file), pattern)
    if json_out:
        print_json(report)
    elif report["type"] == KVZ_TYPE:
        print_kvz_report(report)
    else:
        print_raw_cache_report(report)


KVZ_TYPE = "compressed cache (.kvz)"


def file_report(path: Path, pattern: str | None) -> dict[str, Any]:
    """The report for a file, by its type: a .kvz container or a raw cache in safetensors."""
    if kvz.is_kvz(path):
        with kvz.open_kvz(path) as reader:
            return kvz_report(reader, path)
    if pattern is None and safetensors_format(path) == REORDERED_TAG:
        raise UsageError(
            f"{path} holds a cache's planes as written by `kvtool reorder`, not a cache; "
            f"`kvtool reorder {path} OUT.safetensors --inverse` rebuilds the cache"
        )
    return raw_cache_report(KVCache.load(path, pattern=pattern), path)


def kvz_report(reader: kvz.KvzReader, path: Path) -> dict[str, Any]:
    """Facts of a .kvz and its compression ratio overall, per layer, per K/V and per plane (from the index alone)."""
    heads, tokens, dim = reader.tensors[0][2] if reader.tensors else (0, 0, 0)
    original = len(reader.tensors) * heads * tokens * dim * reader.dtype.itemsize
    return {
        "file": str(path),
        "type": KVZ_TYPE,
        "recipe": reader.recipe.spec(),
        "recipe_config": reader.recipe.to_config(),
        "lossy": lossy_summary(reader),
        "model": reader.model.to_dict(),
        "layers": len(reader.layer_ids),
        "layer_ids": reader.layer_ids,
        "kv_heads": heads,
        "head_dim": dim,
        "dtype": reader.dtype.name,
        "tokens": tokens,
        "token_start": reader.token_start,
        "chunk_tokens": reader.chunk_tokens,
        "chunks": len(reader.index),
        "original_bytes": original,
        "file_bytes": path.stat().st_size,
        "provenance": reader.provenance,
        "metadata": reader.metadata,
        "sizes": _with_original_bytes(reader.sizes(), original // max(len(reader.tensors), 1)),
    }


def _with_original_bytes(sizes: dict[str, Any], tensor_bytes: int) -> dict[str, Any]:
    """Sizes per K/V and per layer with the cache's own bytes (``original``) and the ratio taken from them.

    A lossy stage leaves planes smaller than the tensors they stand for, so the
    planes' raw bytes would understate what was saved; for a lossless recipe both agree.
    """
    for group, tensors_each in (("by_kind", None), ("by_layer", 2)):
        for entry in sizes[group].values():
            count = tensors_each or len(sizes["by_layer"])
            entry["original"] = count * tensor_bytes
            entry["ratio"] = entry["original"] / entry["stored"] if entry["stored"] else 1.0
    return sizes


def lossy_summary(reader: kvz.KvzReader) -> dict[str, Any] | None:
    """A lossy .kvz's stage, and the error it measured when written: the largest, and per layer and K/V."""
    if reader.lossy is None:
        return None
    errors = reader.lossy["error"]
    summary = {
        "stage": lossy_stages(reader.recipe.layouts),
        "max_abs": max((e["max_abs"] for e in errors), default=0.0),
        "rel_rms": max((e["rel_rms"] for e in errors), default=0.0),
        "error": errors,
    }
    described = [layout.describe() for layout in reader.recipe.layouts if layout.lossy and hasattr(layout, "describe")]
    return {**summary, "basis": described[0]} if described else summary


def basis_line(basis: dict[str, Any]) -> str:
    """The dictionary a transform stage coded with, in one line."""
    if not basis.get("found", True):
        return f"dictionary {basis['dictionary']}, not found here (it is needed to restore the cache)"
    steps = ", ".join(f"{kind.upper()} {step:.4g}" for kind, step in basis["steps"].items())
    exact = f"first {basis['sink']} tokens" + (f" and last {basis['recent']}" if basis["recent"] else "") + " exact"
    rope = "keys de-rotated, " if basis["rope"] else ""
    return f"dictionary {basis['dictionary']} ({basis['learnt_from']}), {rope}steps {steps} of each tensor's RMS, {exact}"


def lossy_note(reader: kvz.KvzReader) -> str:
    """One line on what a lossy .kvz holds, for the commands that read or write one."""
    summary = lossy_summary(reader)
    assert summary is not None, "lossy_note is for lossy files only"
    return (
        f"lossy recipe {reader.recipe.spec()!r}: the cache is an approximation "
        f"(largest error {summary['max_abs']:.4g}; RMS error at most {100 * summary['rel_rms']:.3g}% of a tensor's RMS)"
    )


def raw_cache_report(cache: KVCache, path: Path) -> dict[str, Any]:
    """Facts of a raw cache and, per layer and K/V, value range, zeros, exponents and byte-plane entropy."""
    heads, _, dim = cache.keys[0].shape if cache.keys else (0, 0, 0)
    return {
        "file": str(path),
        "type": "raw cache (safetensors)",
        "model": cache.model.to_dict(),
        "layers": cache.num_layers,
        "layer_ids": cache.layer_ids,
        "kv_heads": heads,
        "head_dim": dim,
        "dtype": cache.dtype.name,
        "tokens": cache.num_tokens,
        "token_start": cache.token_start,
        "bytes": cache.nbytes,
        "bytes_per_token": cache.bytes_per_token,
        "provenance": cache.provenance,
        "tensors": [tensor_report(layer, kind, array) for layer, kind, array in cache.tensors()],
    }


def tensor_report(layer: int, kind: str, array: np.ndarray) -> dict[str, Any]:
    values = array.astype(np.float32)
    finite = values[np.isfinite(values)]
    count = max(values.size, 1)
    return {
        "layer": layer,
        "kind": "key" if kind == "k" else "value",
        "min": float(finite.min()) if finite.size else None,
        "max": float(finite.max()) if finite.size else None,
        "zeros": round(int(np.count_nonzero(values == 0)) / count, 6),
        "nonfinite": int(values.size - finite.size),
        "exponent": stats.exponent_summary(array),
        "byte_entropy_bits": [round(h, 4) for h in stats.byte_plane_entropies(array)],
    }


def print_raw_cache_report(report: dict[str, Any]) -> None:
    model = report["model"]
    typer.echo(f"{report['file']}: {report['type']}")
    typer.echo(f"  model       {model['model_id']} ({model['architecture']}), keys post-RoPE: {model['keys_post_rope']}")
    typer.echo(
        f"  shape       {report['layers']} layers x K/V [{report['kv_heads']} heads, {report['tokens']} tokens, "
        f"{report['head_dim']} dims] {report['dtype']}, tokens from {report['token_start']}"
    )
    typer.echo(f"  size        {format_size(report['bytes'])}, {report['bytes_per_token']} bytes/token")
    typer.echo("  provenance")
    width = max(map(len, report["provenance"]), default=0)
    for key, value in report["provenance"].items():
        typer.echo(f"    {key:<{width}}  {value}")
    rows = []
    for t in report["tensors"]:
        exp = t["exponent"]
        rows.append({
            "layer": t["layer"],
            "kv": t["kind"][0].upper(),
            "min": t["min"],
            "max": t["max"],
            "zeros": t["zeros"],
            "exp range": f"{exp['min']}..{exp['max']}" if exp["min"] is not None else "-",
            "common exps": " ".join(str(e["exponent"]) for e in exp["top"]),
            "H(exp)": exp["entropy_bits"],
            "H(bytes) msb..lsb": " ".join(f"{h:.2f}" for h in t["byte_entropy_bits"]),
        })
    typer.echo("")
    print_table(rows, list(rows[0]) if rows else ["layer"])


def print_kvz_report(report: dict[str, Any]) -> None:
    sizes = report["sizes"]
    total = sizes["total"]
    typer.echo(f"{report['file']}: {report['type']}")
    typer.echo(f"  recipe      {report['recipe']}")
    lossy = report["lossy"]
    if lossy:
        typer.echo(
            f"  lossy       yes: stage {lossy['stage']}, largest error {lossy['max_abs']:.4g}, RMS error at most "
            f"{100 * lossy['rel_rms']:.3g}% of a tensor's RMS (measured when written; per layer below)"
        )
        if "basis" in lossy:
            typer.echo(f"  basis       {basis_line(lossy['basis'])}")
    typer.echo(
        f"  shape       {report['layers']} layers x K/V [{report['kv_heads']} heads, {report['tokens']} tokens, "
        f"{report['head_dim']} dims] {report['dtype']}, {report['chunks']} chunks of {report['chunk_tokens']} tokens"
    )
    typer.echo(f"  model       {report['model']['model_id']} ({report['model']['architecture']})")
    typer.echo(
        f"  size        {format_size(report['original_bytes'])} -> {format_size(report['file_bytes'])} on disk "
        f"({format_size(total['stored'])} of chunks), ratio {report['original_bytes'] / max(report['file_bytes'], 1):.3f}"
    )
    for title, group in (("K/V", "by_kind"), ("plane", "by_plane"), ("layer", "by_layer")):
        size = "original" if group != "by_plane" else "raw"
        rows = [{title: name, size: v[size], "stored": v["stored"], "ratio": v["ratio"]} for name, v in sizes[group].items()]
        typer.echo("")
        print_table(rows, [title, size, "stored", "ratio"])
    if lossy:
        typer.echo("\nerror of the lossy stage (max abs, RMS, RMS over the values' RMS)")
        print_table(
            [{"layer": e["layer"], "kv": str(e.get("kind", "")).upper(), "max abs": e["max_abs"], "rms": e["rms"],
              "rel rms": e["rel_rms"]} for e in lossy["error"]],
            ["layer", "kv", "max abs", "rms", "rel rms"],
        )


def register(app: typer.Typer) -> None:
    app.command("inspect", cls=Command)(inspect)
