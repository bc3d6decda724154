"""KV caches as plain safetensors files: kvtool's metadata, a streaming writer, and partial reads.

kvtool's own dumps name their tensors ``layer.{layer}.key`` / ``layer.{layer}.value``
and keep the model facts and provenance in the safetensors metadata. Files
written by other tools are read through a tensor-name pattern
(``kvtool.tensor_names``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from safetensors import safe_open

from kvtool.dtypes import DType, dtype_of, register_numpy_types
from kvtool.errors import DecodeError, UsageError
from kvtool.facts import AXES, ModelFacts
from kvtool.fileio import atomic_write, check_regular
from kvtool.tensor_names import match_names
from kvtool.tokens import token_range

FORMAT_TAG = "kvcache/1"
KVTOOL_PATTERN = "layer.{layer}.{key|value}"


def tensor_name(layer: int, kind: str) -> str:
    """kvtool's name for the key (``kind`` ``"k"``) or value tensor of ``layer``."""
    return f"layer.{layer}.{'key' if kind == 'k' else 'value'}"


def header_metadata(dtype: str, model: ModelFacts, provenance: dict[str, Any], token_start: int) -> dict[str, str]:
    """The string map kvtool writes into a safetensors header."""
    return {
        "kvtool.format": FORMAT_TAG,
        "kvtool.axes": ",".join(AXES),
        "kvtool.dtype": dtype,
        "kvtool.model": json.dumps(model.to_dict(), sort_keys=True),
        "kvtool.provenance": json.dumps(provenance, sort_keys=True),
        "kvtool.token_start": str(token_start),
    }


def parse_metadata(meta: dict[str, str], path: Path) -> tuple[ModelFacts, dict[str, Any], int]:
    """Model facts, provenance and first token position from kvtool's safetensors metadata.

    ``DecodeError`` names what is malformed: metadata is file content, not trusted.
    """
    try:
        facts = ModelFacts.from_dict(json.loads(meta.get("kvtool.model", "{}")))
        provenance = json.loads(meta.get("kvtool.provenance", "{}"))
        text = meta.get("kvtool.token_start", "0")
        if not (text.isascii() and text.isdigit()) or len(text) > 18:
            raise ValueError(f"kvtool.token_start is not a token position: {text[:40]!r}")
    except (ValueError, RecursionError) as exc:
        raise DecodeError(f"{path}: bad kvtool metadata ({str(exc)[:200]})") from None
    if not isinstance(provenance, dict):
        raise DecodeError(f"{path}: bad kvtool metadata (kvtool.provenance is not a JSON object)")
    return facts, provenance, int(text)


def write_safetensors(path: str | os.PathLike[str], tensors: Iterable[tuple[str, np.ndarray]], metadata: dict[str, str]) -> None:
    """Write ``(name, array)`` pairs as a safetensors file (atomically), one tensor at a time.

    No image of the whole file is built in memory: the header is computed from
    the shapes, then each array is written straight from its buffer (a
    non-contiguous one is copied, one tensor at a time). The bytes are those
    safetensors' own writer lays out (tensors in name order), except that the
    JSON header has sorted keys, so equal caches give equal files: safetensors
    writes the metadata map in hash order, which changes from process to
    process. The header is padded with spaces to 8 bytes, as the format allows.
    """
    ordered = sorted(tensors, key=lambda item: item[0])
    head, _ = safetensors_frame([(name, array.shape, array.dtype) for name, array in ordered], metadata)
    with atomic_write(path) as f:
        f.write(head)
        for _, array in ordered:
            f.write(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)


def safetensors_frame(tensors: Sequence[tuple[str, tuple[int, ...], np.dtype]], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The bytes before the data of a safetensors file holding ``(name, shape, dtype)`` tensors, as
    ``write_safetensors`` writes it, and where each tensor's data starts in the file."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset, starts = 0, {}
    for name, shape, dtype in sorted(tensors, key=lambda item: item[0]):
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": dtype_of(np.dtype(dtype)).safetensors, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        starts[name] = offset
        offset += nbytes
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, {name: 8 + len(text) + at for name, at in starts.items()}


def read_cache(
    path: Path,
    layers: Sequence[int] | None,
    tokens: slice | None,
    pattern: str | None,
    model: ModelFacts | None,
) -> tuple[list[np.ndarray], list[np.ndarray], ModelFacts, dict[str, Any], list[int], int]:
    """Keys, values, model facts, provenance, layer ids and first token position read from ``path``.

    Only the layers and tokens asked for are read; see ``KVCache.load``.
    """
    check_regular(path)
    token_range(tokens, 0)  # refuses a step or a negative position before the file is opened
    try:
        handle = safe_open(str(path), framework="numpy")
    except FileNotFoundError:
        raise
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types for bad headers
        raise DecodeError(f"{path}: not a readable safetensors file ({exc})") from None
    with handle as f:
        meta = f.metadata() or {}
        names = list(f.keys())
        own = meta.get("kvtool.format") == FORMAT_TAG
        if own and meta.get("kvtool.axes", ",".join(AXES)) != ",".join(AXES):
            raise DecodeError(f"{path}: unsupported axes {meta['kvtool.axes']!r}")
        layer_names = match_names(names, pattern or KVTOOL_PATTERN, path)
        wanted = sorted(layer_names) if layers is None else list(layers)
        missing = [lid for lid in wanted if lid not in layer_names]
        if missing:
            raise UsageError(f"{path}: no layers {missing} (it has {min(layer_names)}..{max(layer_names)})")
        keys, values, first = [], [], 0
        for lid in wanted:
            k_name, v_name = layer_names[lid]
            key, first = _read_tensor(f, k_name, tokens, path)
            keys.append(key)
            values.append(_read_tensor(f, v_name, tokens, path)[0])
    if own:
        facts, provenance, token_start = parse_metadata(meta, path)
    else:
        facts = model or ModelFacts()
        provenance = {"source": "import", "file": path.name, "pattern": pattern}
        token_start = 0
    if keys and (facts.num_layers == 0 or facts.num_kv_heads == 0 or facts.head_dim == 0):
        facts = replace(
            facts,
            num_layers=facts.num_layers or len(layer_names),
            num_kv_heads=facts.num_kv_heads or keys[0].shape[0],
            head_dim=facts.head_dim or keys[0].shape[2],
        )
    return keys, values, facts, provenance, wanted, token_start + first


def _read_tensor(f: Any, name: str, tokens: slice | None, path: Path) -> tuple[np.ndarray, int]:
    """The tensor ``name`` cut to ``tokens``, and the position of its first token in the file."""
    sl = f.get_slice(name)
    shape = sl.get_shape()
    dtype = dtype_of(sl.get_dtype())
    register_numpy_types()  # safetensors names the numpy type by its name
    batched = len(shape) == 4 and shape[0] == 1
    if not batched and len(shape) != 3:
        raise UsageError(f"{path}: tensor {name} has shape {shape}; expected {list(AXES)} or [1, {', '.join(AXES)}]")
    start, stop = token_range(tokens, shape[-2])
    if start == stop:  # safetensors refuses an empty slice at the end of an axis
        return np.empty((shape[-3], 0, shape[-1]), dtype.numpy), start
    if dtype.name.startswith("fp8"):
        # safetensors' numpy reader has no fp8 type; map the bytes and view them through ml_dtypes.
        return _mapped_tensor(path, name, dtype)[:, start:stop].copy(), start
    if batched:
        return sl[0:1, :, start:stop, :][0], start
    return sl[:, start:stop, :], start


def _mapped_tensor(path: Path, name: str, dtype: DType) -> np.ndarray:
    """A read-only memory map of one tensor, located through the (already validated) safetensors header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(length))[name]
    start, end = entry["data_offsets"]
    array = np.memmap(path, dtype=dtype.numpy, mode="r", offset=8 + length + start, shape=(end - start,))
    tensor: np.ndarray = array.reshape(entry["shape"][-3:])
    return tensor
