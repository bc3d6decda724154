"""The KV cache model: keys and values of every layer, with their meaning.

A ``KVCache`` holds, per layer, a key and a value array shaped
``[kv_heads, tokens, head_dim]`` (the ``AXES``), all of one dtype. Low-precision
floats are numpy arrays of ``ml_dtypes`` types, so their bit patterns are
handled without torch. Raw dumps are plain safetensors files: tensors named
``layer.{layer}.key`` / ``layer.{layer}.value`` and the model facts and
provenance in the safetensors metadata.

Caches dumped by other tools load through a tensor-name pattern such as
``model.layers.{layer}.self_attn.{k|v}``.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import ml_dtypes
import numpy as np
import safetensors.numpy
import xxhash
from safetensors import safe_open

from kvtool.errors import DecodeError, UsageError
from kvtool.fileio import atomic_write, check_regular

AXES = ("kv_heads", "tokens", "head_dim")
FORMAT_TAG = "kvcache/1"
KVTOOL_PATTERN = "layer.{layer}.{key|value}"


@dataclass(frozen=True)
class DType:
    name: str  # kvtool's name
    numpy: np.dtype
    safetensors: str  # the dtype string in a safetensors header
    exponent_bits: int
    mantissa_bits: int

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def bits_view(self) -> np.dtype:
        """The unsigned integer dtype with the same bit pattern."""
        return np.dtype(f"u{self.itemsize}")


DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("bf16", np.dtype(ml_dtypes.bfloat16), "BF16", 8, 7),
        DType("fp16", np.dtype(np.float16), "F16", 5, 10),
        DType("fp32", np.dtype(np.float32), "F32", 8, 23),
        DType("fp8_e4m3", np.dtype(ml_dtypes.float8_e4m3fn), "F8_E4M3", 4, 3),
        DType("fp8_e5m2", np.dtype(ml_dtypes.float8_e5m2), "F8_E5M2", 5, 2),
    )
}


def dtype_of(array_or_name: np.ndarray | np.dtype | str) -> DType:
    """kvtool's dtype record for a numpy array, numpy dtype, or name (``bf16``, ``BF16``, ``float16``)."""
    if isinstance(array_or_name, str):
        for d in DTYPES.values():
            if array_or_name in (d.name, d.safetensors, d.numpy.name):
                return d
        raise UsageError(f"unsupported dtype {array_or_name!r}; supported: {', '.join(DTYPES)}")
    dt = np.dtype(getattr(array_or_name, "dtype", array_or_name))
    for d in DTYPES.values():
        if d.numpy == dt:
            return d
    raise UsageError(f"unsupported dtype {dt}; supported: {', '.join(DTYPES)}")


@dataclass(frozen=True)
class ModelFacts:
    """What a reader needs to know about the model that produced a cache."""

    model_id: str = "unknown"
    architecture: str = "unknown"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    keys_post_rope: bool | None = None  # None: not known

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelFacts":
        """The facts in ``data`` (other keys are ignored); ``ValueError`` for a value of the wrong type."""
        if not isinstance(data, dict):
            raise ValueError(f"model facts must be a JSON object, not {type(data).__name__}")
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for name, value in known.items():
            if not _fits_field(name, value):
                raise ValueError(f"model fact {name!r} has a value of the wrong type: {str(value)[:80]!r}")
        return cls(**known)


def _fits_field(name: str, value: Any) -> bool:
    if name in ("model_id", "architecture"):
        return isinstance(value, str)
    if name == "keys_post_rope":
        return value is None or isinstance(value, bool)
    return type(value) is int and 0 <= value < 1 << 31


def token_ids_hash(token_ids: Sequence[int]) -> str:
    """A stable hash of a token sequence (xxh3-64 of little-endian int64 ids)."""
    return xxhash.xxh3_64_hexdigest(np.asarray(token_ids, dtype="<i8").tobytes())


@dataclass
class KVCache:
    """Keys and values of a run of consecutive layers over a run of consecutive tokens."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    model: ModelFacts = field(default_factory=ModelFacts)
    provenance: dict[str, Any] = field(default_factory=dict)
    layer_ids: list[int] | None = None  # model layer index of each entry; default 0..n-1
    token_start: int = 0  # position of the first token held here

    def __post_init__(self) -> None:
        if self.layer_ids is None:
            self.layer_ids = list(range(len(self.keys)))
        self.validate()

    # -- facts ---------------------------------------------------------------
    @property
    def dtype(self) -> DType:
        return dtype_of(self.keys[0]) if self.keys else DTYPES["bf16"]

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values)

    @property
    def bytes_per_token(self) -> int:
        return sum(a.shape[0] * a.shape[2] * a.itemsize for a in self.keys + self.values)

    def tensors(self) -> Iterator[tuple[int, str, np.ndarray]]:
        """``(layer_id, "k" or "v", array)`` for every tensor, layer by layer, K before V."""
        for layer, k, v in zip(self.layer_ids, self.keys, self.values):
            yield layer, "k", k
            yield layer, "v", v

    def validate(self) -> None:
        if len(self.keys) != len(self.values) or len(self.layer_ids) != len(self.keys):
            raise UsageError("a KV cache needs one key and one value tensor per layer")
        shapes = {a.shape for a in self.keys + self.values}
        dtypes = {a.dtype for a in self.keys + self.values}
        if len(dtypes) > 1:
            raise UsageError(f"all K/V tensors must share one dtype, found {sorted(map(str, dtypes))}")
        for a in self.keys + self.values:
            if a.ndim != 3:
                raise UsageError(f"K/V tensors must be {list(AXES)}, got shape {list(a.shape)}")
            dtype_of(a)
        if len({(s[0], s[1], s[2]) for s in shapes}) > 1:
            raise UsageError(f"K/V tensors differ in shape: {sorted(shapes)}")

    # -- slicing -------------------------------------------------------------
    def select(self, layers: Sequence[int] | None = None, tokens: slice | None = None) -> "KVCache":
        """A cache over some model layers (by layer id) and a token range; arrays are views."""
        index = list(range(self.num_layers))
        if layers is not None:
            position = {lid: i for i, lid in enumerate(self.layer_ids)}
            missing = [lid for lid in layers if lid not in position]
            if missing:
                raise UsageError(f"layers {missing} are not in this cache (it holds {self.layer_ids[0]}..{self.layer_ids[-1]})")
            index = [position[lid] for lid in layers]
        start, stop, step = (tokens or slice(None)).indices(self.num_tokens)
        if step != 1:
            raise UsageError("token ranges must be contiguous")
        return replace(
            self,
            keys=[self.keys[i][:, start:stop] for i in index],
            values=[self.values[i][:, start:stop] for i in index],
            layer_ids=[self.layer_ids[i] for i in index],
            token_start=self.token_start + start,
            provenance=dict(self.provenance),
        )

    def equal_bits(self, other: "KVCache") -> bool:
        """True when both hold the same layers, tokens and bit patterns."""
        if self.layer_ids != other.layer_ids or self.token_start != other.token_start:
            return False
        pairs = zip(self.keys + self.values, other.keys + other.values)
        return all(
            a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b)) for a, b in pairs
        )

    # -- files ---------------------------------------------------------------
    def header_metadata(self) -> dict[str, str]:
        """The string map kvtool writes into a safetensors header."""
        return {
            "kvtool.format": FORMAT_TAG,
            "kvtool.axes": ",".join(AXES),
            "kvtool.dtype": self.dtype.name,
            "kvtool.model": json.dumps(self.model.to_dict(), sort_keys=True),
            "kvtool.provenance": json.dumps(self.provenance, sort_keys=True),
            "kvtool.token_start": str(self.token_start),
        }

    def save(self, path: str | Path) -> None:
        """Write a plain safetensors file (atomically)."""
        tensors = {}
        for layer, kind, array in self.tensors():
            tensors[f"layer.{layer}.{'key' if kind == 'k' else 'value'}"] = np.ascontiguousarray(array)
        data = _canonical_header(safetensors.numpy.save(tensors, metadata=self.header_metadata()))
        with atomic_write(path) as f:
            f.write(data)

    @classmethod
    def load(
        cls,
        path: str | Path,
        layers: Sequence[int] | None = None,
        tokens: slice | None = None,
        pattern: str | None = None,
        model: ModelFacts | None = None,
    ) -> "KVCache":
        """Read a cache from a safetensors file, only the layers and tokens asked for.

        kvtool's own dumps need no ``pattern``; other files name their tensors
        with one (``L{layer:02d}.{k|v}``, ``model.layers.{layer}.self_attn.{k|v}``)
        and may take their model facts from ``model``.
        """
        path = Path(path)
        check_regular(path)
        try:
            handle = safe_open(str(path), framework="numpy")
        except FileNotFoundError:
            raise
        except Exception as exc:  # safetensors raises its own types for bad headers
            raise DecodeError(f"{path}: not a readable safetensors file ({exc})") from None
        with handle as f:
            meta = f.metadata() or {}
            names = list(f.keys())
            own = meta.get("kvtool.format") == FORMAT_TAG
            if own and meta.get("kvtool.axes", ",".join(AXES)) != ",".join(AXES):
                raise DecodeError(f"{path}: unsupported axes {meta['kvtool.axes']!r}")
            layer_names = _match_names(names, pattern or KVTOOL_PATTERN, path)
            wanted = sorted(layer_names) if layers is None else list(layers)
            missing = [lid for lid in wanted if lid not in layer_names]
            if missing:
                raise UsageError(f"{path}: no layers {missing} (it has {min(layer_names)}..{max(layer_names)})")
            keys, values = [], []
            for lid in wanted:
                k_name, v_name = layer_names[lid]
                keys.append(_read_tensor(f, k_name, tokens, path))
                values.append(_read_tensor(f, v_name, tokens, path))
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
        start = (tokens or slice(None)).indices(1 << 62)[0] if tokens is not None else 0
        return cls(keys, values, facts, provenance, layer_ids=wanted, token_start=token_start + start)


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


def _canonical_header(data: bytes) -> bytes:
    """The same safetensors file with its JSON header keys sorted, so equal caches give equal bytes.

    safetensors writes the metadata map in hash order, which changes from process
    to process. Tensor offsets count from the end of the header, so rewriting
    the header (padded with spaces to 8 bytes, as the format allows) moves nothing.
    """
    (length,) = struct.unpack_from("<Q", data)
    header = json.dumps(json.loads(data[8 : 8 + length]), sort_keys=True, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data[8 + length :]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(dtype_of(a).bits_view)


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Turn ``model.layers.{layer}.self_attn.{k|v}`` into a regex with groups ``layer`` and ``kv``.

    ``{layer}`` (or ``{layer:02d}``) stands for the layer number and ``{K|V}``
    for the two literal names of the key and value tensors, key first.
    """
    parts = re.split(r"(\{[^{}]*\})", pattern)
    regex, seen = "", set()
    for part in parts:
        if re.fullmatch(r"\{layer(:0?\d*d)?\}", part):
            regex += r"(?P<layer>\d+)"
            seen.add("layer")
        elif re.fullmatch(r"\{[^{}|]+\|[^{}|]+\}", part):
            key, value = part[1:-1].split("|")
            regex += f"(?P<kv>{re.escape(key)}|{re.escape(value)})"
            seen.add("kv")
        elif "{" in part or "}" in part:
            raise UsageError(f"bad tensor-name pattern {pattern!r}: use {{layer}} and {{K|V}}")
        else:
            regex += re.escape(part)
    if seen != {"layer", "kv"}:
        raise UsageError(f"tensor-name pattern {pattern!r} needs both {{layer}} and {{K|V}}, e.g. L{{layer:02d}}.{{k|v}}")
    return re.compile(regex)


def _match_names(names: list[str], pattern: str, path: Path) -> dict[int, tuple[str, str]]:
    regex = compile_pattern(pattern)
    key_name = re.search(r"\{([^{}|]+)\|", pattern).group(1)
    found: dict[int, dict[str, str]] = {}
    for name in names:
        m = regex.fullmatch(name)
        if m:
            role = "k" if m["kv"] == key_name else "v"
            found.setdefault(int(m["layer"]), {})[role] = name
    if not found:
        raise UsageError(f"{path}: no tensor matches the pattern {pattern!r} (it holds e.g. {names[:3]})")
    incomplete = [lid for lid, kv in found.items() if len(kv) != 2]
    if incomplete:
        raise UsageError(f"{path}: layers {sorted(incomplete)} lack a key or a value tensor")
    return {lid: (kv["k"], kv["v"]) for lid, kv in sorted(found.items())}


def _read_tensor(f, name: str, tokens: slice | None, path: Path) -> np.ndarray:
    sl = f.get_slice(name)
    shape = sl.get_shape()
    dtype = dtype_of(sl.get_dtype())
    if len(shape) == 4 and shape[0] == 1:
        shape = shape[1:]
    elif len(shape) != 3:
        raise UsageError(f"{path}: tensor {name} has shape {shape}; expected {list(AXES)} or [1, {', '.join(AXES)}]")
    if dtype.name.startswith("fp8"):
        # safetensors' numpy reader has no fp8 type; map the bytes and view them through ml_dtypes.
        return _mapped_tensor(path, name, dtype)[:, tokens or slice(None)].copy()
    if len(sl.get_shape()) == 4:
        return sl[0:1, :, tokens or slice(None), :][0]
    return sl[:, tokens, :] if tokens is not None else sl[:]


def _mapped_tensor(path: Path, name: str, dtype: DType) -> np.ndarray:
    """A read-only memory map of one tensor, located through the (already validated) safetensors header."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(length))[name]
    start, end = entry["data_offsets"]
    array = np.memmap(path, dtype=dtype.numpy, mode="r", offset=8 + length + start, shape=(end - start,))
    return array.reshape(entry["shape"][-3:])
