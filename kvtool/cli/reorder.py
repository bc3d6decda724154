"""``kvtool reorder``: write a cache's planes after a layout chain, and read them back.

The output is a plain safetensors file, so the planes can be studied or fed to
other tools: tensor ``layer.{i}.{key|value}.{plane}`` holds one plane in its own
dtype. The metadata holds the cache's own (``KVCache.header_metadata()``, with
``kvtool.format`` set to ``kvcache-reordered/1``), the layout chain's config as
JSON in ``kvtool.layout``, and in ``kvtool.tensors`` each original tensor's
dtype, shape and plane names. ``--inverse`` rebuilds the plain cache bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import safetensors.numpy
import typer
from safetensors import safe_open

from kvtool.cache import KVCache, dtype_of, parse_metadata
from kvtool.cli._common import JSON_OPTION, REORDERED_TAG, Command, distinct_output, existing_file, print_json, progress
from kvtool.cli.inspect import PATTERN_HELP
from kvtool.dtypes import register_numpy_types
from kvtool.errors import DecodeError, KvtoolError, UsageError
from kvtool.fileio import atomic_write, check_regular
from kvtool.layouts import LayoutChain, layout_from_config, parse_layouts
from kvtool.layouts.base import INPUT_NAME, PlaneSpec
from kvtool.units import format_size

FORMAT_TAG = REORDERED_TAG


def reorder(
    src: Path = typer.Argument(..., help="Input: a KV cache (safetensors), or with --inverse a file this command wrote."),
    dst: Path = typer.Argument(..., help="Where to write the result (safetensors)."),
    layout: Optional[str] = typer.Option(None, "--layout", "-l", help="Layout chain, e.g. 'channel-major|bf16-split'."),
    inverse: bool = typer.Option(False, "--inverse", help="Rebuild the plain cache from a reordered file."),
    pattern: Optional[str] = typer.Option(None, "--pattern", "-p", help=PATTERN_HELP),
    json_out: bool = JSON_OPTION,
):
    """Write a cache's tensors split and reordered by a layout chain, one tensor per plane; --inverse undoes it."""
    if inverse == (layout is not None):
        raise UsageError("give either --layout SPEC or --inverse")
    distinct_output(existing_file(src), dst)
    chain = None if layout is None else parse_layouts(layout)
    if chain is not None and chain.lossy:
        raise UsageError(f"layout {layout!r} is lossy: reorder writes planes it can undo bit for bit; "
                         "a lossy stage belongs in a recipe (kvtool compress --recipe)")
    report, text = _restore_file(src, dst) if chain is None else _reorder_file(src, dst, chain, pattern)
    if json_out:
        print_json(report)
    else:
        typer.echo(text)


def _reorder_file(src: Path, dst: Path, chain: LayoutChain, pattern: str | None) -> tuple[dict[str, Any], str]:
    cache = KVCache.load(src, pattern=pattern)
    tensors, metadata = reordered_tensors(cache, chain)
    with atomic_write(dst) as f:
        f.write(safetensors.numpy.save(tensors, metadata=metadata))
    planes = [p.name for p in chain.plan([PlaneSpec.of(cache.keys[0])])]
    report = {"in": str(src), "out": str(dst), "layout": chain.spec(), "planes": planes, "tensors": len(tensors)}
    return report, (f"{dst}: {cache.num_layers} layers x K/V as {len(tensors)} tensors, planes {', '.join(planes)} "
                    f"({chain.spec() or 'token-major'})")


def _restore_file(src: Path, dst: Path) -> tuple[dict[str, Any], str]:
    cache = restore(src)
    cache.save(dst)
    report = {"in": str(src), "out": str(dst), "layers": cache.num_layers, "tokens": cache.num_tokens, "bytes": cache.nbytes}
    return report, f"{dst}: {cache.num_layers} layers x {cache.num_tokens} tokens restored ({format_size(cache.nbytes)})"


def reordered_tensors(cache: KVCache, chain: LayoutChain) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Every plane of every K/V tensor under its safetensors name, and the metadata to undo it."""
    tensors: dict[str, np.ndarray] = {}
    originals: dict[str, dict[str, Any]] = {}
    for layer, kind, array in progress(iterable=list(cache.tensors()), desc="reorder", unit="tensor"):
        base = f"layer.{layer}.{'key' if kind == 'k' else 'value'}"
        bound = chain.for_kind(kind, layer)  # a stage may tell keys and values apart (outliers' rows)
        specs = bound.plan([PlaneSpec.of(array)])
        for spec, plane in zip(specs, bound.forward([array])):
            tensors[f"{base}.{spec.name}"] = plane
        originals[base] = {"dtype": dtype_of(array).name, "shape": list(array.shape), "planes": [s.name for s in specs]}
    metadata = {
        **cache.header_metadata(),
        "kvtool.format": FORMAT_TAG,
        "kvtool.layout": json.dumps(chain.get_config()),
        "kvtool.tensors": json.dumps(originals),
    }
    return tensors, metadata


def restore(path: Path) -> KVCache:
    """The plain cache a file written by ``kvtool reorder --layout`` came from."""
    check_regular(path)
    try:
        handle = safe_open(str(path), framework="numpy")
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types for bad headers
        raise DecodeError(f"{path}: not a readable safetensors file ({exc})") from None
    with handle as f:
        meta = f.metadata() or {}
        if meta.get("kvtool.format") != FORMAT_TAG:
            raise UsageError(f"{path}: not a file written by `kvtool reorder --layout` (no {FORMAT_TAG} tag)")
        try:
            chain = LayoutChain([layout_from_config(c) for c in json.loads(meta["kvtool.layout"])])
            originals = json.loads(meta["kvtool.tensors"])
        except KvtoolError:  # an unknown layout id: as it is, not as a ValueError below
            raise
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise DecodeError(f"{path}: bad reorder metadata ({exc})") from None
        model, provenance, token_start = parse_metadata(meta, path)
        if not isinstance(originals, dict):
            raise DecodeError(f"{path}: bad reorder metadata (kvtool.tensors is not an object)")
        names = set(f.keys())
        layers: dict[int, dict[str, np.ndarray]] = {}
        for base, original in originals.items():
            layer, kind = _parse_base(base, path)
            bound = chain.for_kind(kind[0], layer)  # "key" -> "k"
            layers.setdefault(layer, {})[kind] = _restore_tensor(f, names, bound, base, original, path)
    if any(len(kv) != 2 for kv in layers.values()):
        raise DecodeError(f"{path}: a layer lacks its key or value tensor")
    ids = sorted(layers)
    return KVCache(
        [layers[i]["key"] for i in ids], [layers[i]["value"] for i in ids], model, provenance,
        layer_ids=ids, token_start=token_start,
    )


def _parse_base(base: str, path: Path) -> tuple[int, str]:
    parts = base.split(".")
    if len(parts) != 3 or parts[0] != "layer" or not parts[1].isdigit() or parts[2] not in ("key", "value"):
        raise DecodeError(f"{path}: unexpected tensor name {base!r} in the reorder metadata")
    return int(parts[1]), parts[2]


def _restore_tensor(f, names: set[str], chain: LayoutChain, base: str, original: dict[str, Any], path: Path) -> np.ndarray:
    try:
        spec = PlaneSpec(INPUT_NAME, tuple(int(n) for n in original["shape"]), dtype_of(original["dtype"]).numpy)
        specs = chain.plan([spec])
        if [s.name for s in specs] != original["planes"]:
            raise DecodeError(f"planes {original['planes']} do not match the layout's {[s.name for s in specs]}")
        missing = [f"{base}.{s.name}" for s in specs if f"{base}.{s.name}" not in names]
        if missing:
            raise DecodeError(f"missing tensors {missing}")
        register_numpy_types()  # safetensors names the numpy type by its name
        planes = [f.get_tensor(f"{base}.{s.name}") for s in specs]
        return chain.inverse(planes, [spec])[0]
    except KvtoolError as exc:  # before ValueError: a UsageError is one too
        raise type(exc)(f"{path}: {base}: {exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise DecodeError(f"{path}: bad entry for {base} ({exc})") from None


def register(app: typer.Typer) -> None:
    app.command("reorder", cls=Command)(reorder)
