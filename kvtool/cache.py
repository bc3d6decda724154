"""The KV cache model: keys and values of every layer, with their meaning.

A ``KVCache`` holds, per layer, a key and a value array shaped
``[kv_heads, tokens, head_dim]`` (the ``AXES``), all of one dtype. Raw dumps
are plain safetensors files (``kvtool.safetensors_io``); caches dumped by other
tools load through a tensor-name pattern such as
``model.layers.{layer}.self_attn.{k|v}`` (``kvtool.tensor_names``).

The dtype table (``kvtool.dtypes``), the model facts (``kvtool.facts``) and the
token helpers (``kvtool.tokens``) live in their own modules, so layouts, codecs and
statistics use them without the cache model; their names are importable from
here too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from kvtool import safetensors_io
from kvtool.dtypes import DTYPES, DType, bits_of, dtype_of
from kvtool.errors import UsageError
from kvtool.facts import AXES, ModelFacts
from kvtool.safetensors_io import FORMAT_TAG, KVTOOL_PATTERN, parse_metadata
from kvtool.tensor_names import compile_pattern
from kvtool.tokens import token_ids_hash, token_range

__all__ = [
    "AXES",
    "DTYPES",
    "FORMAT_TAG",
    "KVTOOL_PATTERN",
    "DType",
    "KVCache",
    "ModelFacts",
    "compile_pattern",
    "dtype_of",
    "parse_metadata",
    "token_ids_hash",
    "token_range",
]


#: The largest layer id a cache (and a .kvz) may hold.
MAX_LAYER_ID = (1 << 31) - 1


@dataclass
class KVCache:
    """Keys and values of a run of consecutive layers over a run of consecutive tokens."""

    keys: list[np.ndarray]
    values: list[np.ndarray]
    model: ModelFacts = field(default_factory=ModelFacts)
    provenance: dict[str, Any] = field(default_factory=dict)
    layer_ids: list[int] = None  # type: ignore[assignment]  # model layer index of each entry; default 0..n-1
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
        for layer in self.layer_ids:  # the .kvz reader's bound too: nothing is made that kvtool cannot read back
            if type(layer) is not int or not 0 <= layer <= MAX_LAYER_ID:
                raise UsageError(f"a layer id must be an integer in 0..{MAX_LAYER_ID}, not {str(layer)[:40]}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise UsageError(f"a layer id appears twice in {self.layer_ids[:16]}")
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
        start, stop = token_range(tokens, self.num_tokens)
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
            a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits_of(a), bits_of(b)) for a, b in pairs
        )

    # -- files ---------------------------------------------------------------
    def header_metadata(self) -> dict[str, str]:
        """The string map kvtool writes into a safetensors header."""
        return safetensors_io.header_metadata(self.dtype.name, self.model, self.provenance, self.token_start)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write a plain safetensors file (atomically), tensor by tensor."""
        tensors = ((safetensors_io.tensor_name(layer, kind), array) for layer, kind, array in self.tensors())
        safetensors_io.write_safetensors(path, tensors, self.header_metadata())

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
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
        keys, values, facts, provenance, layer_ids, token_start = safetensors_io.read_cache(Path(path), layers, tokens, pattern, model)
        return cls(keys, values, facts, provenance, layer_ids=layer_ids, token_start=token_start)
