"""The model's KV cache groups as vLLM allocates them, and whether kvtool can restore them exactly.

vLLM puts the layers that share a KV cache spec in one group, and gives every
group its own block table (``KVCacheConfig.kv_cache_groups``): a model with
full and sliding-window attention layers (Gemma 3) has a group of each, a
hybrid with linear-attention or Mamba layers (Qwen3-Next) has groups whose
"blocks" hold a recurrent state instead of keys and values. What kvtool does
with each kind of group (``SPEC_KINDS``, by vLLM's exact spec class; anything
else is refused):

- ``full``: every block of the prefix is restored and saved;
- ``sliding``: vLLM keeps only the blocks inside the window of the last token and
  hands the others out as its null block (block 0); kvtool restores the kept
  ones and never saves a null block's bytes (``SKIPPED``);
- ``mla``: one latent per token and layer (DeepSeek's multi-head latent attention);
- ``state``: Mamba and linear-attention layers; their state at the end of a prefix
  is not KV and kvtool does not store it, so no prefix of such a model is claimed.

``ModelKV.refusal`` is the one line saying why kvtool restores nothing for a
model (``REFUSALS``, checked in order): the connector then claims and saves
nothing, and vLLM computes every prompt. With more than one group, or a sliding
window, loads complete asynchronously: vLLM can recompute a failed load only per
request there (its per-block failure report needs a single group whose blocks
are all kept). Pure Python: vLLM's objects are read by attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

#: vLLM's KV cache spec classes kvtool knows, by exact class name (a subclass may mean something else).
SPEC_KINDS = {
    "FullAttentionSpec": "full",
    "SlidingWindowSpec": "sliding",
    "MLAAttentionSpec": "mla",
    "MambaSpec": "state",
}
#: The kinds whose blocks hold keys and values kvtool stores.
PAGED_KINDS = ("full", "sliding")
#: vLLM's null block (``BlockPool.null_block``, the first block, never handed to a request): a sliding-window
#: group's block vLLM dropped, or one it never filled.
NULL_BLOCK = 0
#: In a job's block list: a block vLLM does not keep for that group, neither restored nor saved.
SKIPPED = -1
#: vLLM's KV cache dtype names -> kvtool's ("auto" means the model's dtype).
KV_DTYPES = {
    "bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32",
    "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2",
}


@dataclass(frozen=True)
class KVGroup:
    """One of vLLM's KV cache groups: its kind, its layers and the shape of its blocks."""

    kind: str  # a SPEC_KINDS value, or vLLM's spec class name when kvtool does not know it
    layers: tuple[str, ...]
    block_size: int
    kv_heads: int = 0
    head_size: int = 0
    window: int | None = None
    dtype: str = ""  # the dtype of its cache tensors, as vLLM names it


@dataclass(frozen=True)
class ModelKV:
    """The model's KV cache as vLLM set it up: groups, dtype, what vLLM computes over cached tokens."""

    groups: tuple[KVGroup, ...]
    cache_dtype: str  # vLLM's name of the KV dtype: "bfloat16", "fp8", ...
    hash_block_size: int  # tokens per block hash
    cached_prefill: bool = True  # False where vLLM cannot compute a prompt over cached tokens (it turned its own prefix caching off)

    @classmethod
    def from_vllm(cls, vllm_config: Any, kv_cache_config: Any = None) -> "ModelKV":
        """From vLLM's config and the ``KVCacheConfig`` it hands every connector (one full-attention group
        of every layer when it hands none, as vLLM releases before hybrid allocation did)."""
        cache, model = vllm_config.cache_config, vllm_config.model_config
        cache_dtype = str(model.dtype if cache.cache_dtype == "auto" else cache.cache_dtype).removeprefix("torch.")
        cached_prefill = not (getattr(model, "use_mla", False) and _on_cpu(vllm_config) and not cache.enable_prefix_caching)
        if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
            group = KVGroup("full", (), cache.block_size, model.get_num_kv_heads(vllm_config.parallel_config),
                            model.get_head_size())
            return cls((group,), cache_dtype, cache.block_size, cached_prefill)
        groups = tuple(_group(g) for g in kv_cache_config.kv_cache_groups)
        hash_block_size = getattr(kv_cache_config, "hash_block_size", None) or cache.block_size
        return cls(groups, cache_dtype, hash_block_size, cached_prefill)

    @property
    def dtype(self) -> str | None:
        """kvtool's name of the KV dtype (``bf16``, ``fp8_e4m3``), None when kvtool holds no such dtype."""
        return KV_DTYPES.get(self.cache_dtype)

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def per_request_failures(self) -> bool:
        """Whether a failed restore must be reported per request (several groups, or blocks vLLM drops):
        loads then complete asynchronously, and vLLM recomputes a failed request from its start."""
        return len(self.groups) > 1 or self.groups[0].kind != "full"

    def group_of(self, layer: str) -> int:
        """The index of the group a registered layer belongs to (0 where vLLM named no layers)."""
        for index, group in enumerate(self.groups):
            if layer in group.layers:
                return index
        if not self.groups[0].layers:
            return 0
        raise KeyError(f"layer {layer!r} is in none of vLLM's KV cache groups")

    @property
    def refusal(self) -> str | None:
        """Why kvtool restores nothing for this model (one line), or None."""
        for check in REFUSALS:
            reason = check(self)
            if reason is not None:
                return reason
        return None

    def describe(self) -> str:
        """One line: the groups and dtype (``2 sliding + 1 full groups of 128-token blocks, bfloat16``)."""
        kinds: dict[str, int] = {}
        for group in self.groups:
            kinds[group.kind] = kinds.get(group.kind, 0) + 1
        sizes = sorted({g.block_size for g in self.groups})
        return (" + ".join(f"{n} {kind}" for kind, n in kinds.items())
                + f" group{'s' if len(self.groups) > 1 else ''} of {'/'.join(map(str, sizes))}-token blocks, {self.cache_dtype}")


def _group(group: Any) -> KVGroup:
    spec = group.kv_cache_spec
    kind = SPEC_KINDS.get(type(spec).__name__, type(spec).__name__)
    return KVGroup(kind, tuple(group.layer_names), int(spec.block_size), int(getattr(spec, "num_kv_heads", 0) or 0),
                   int(getattr(spec, "head_size", 0) or 0), getattr(spec, "sliding_window", None),
                   str(getattr(spec, "dtype", "")).removeprefix("torch."))


def _on_cpu(vllm_config: Any) -> bool:
    device = getattr(vllm_config, "device_config", None)
    return str(getattr(device, "device_type", "")) == "cpu"


# -- refusals: each returns the reason kvtool restores nothing for a model, or None ---------------------------
def _unknown_specs(model: ModelKV) -> str | None:
    unknown = sorted({g.kind for g in model.groups if g.kind not in SPEC_KINDS.values()})
    if unknown:
        return f"KV cache groups of kinds kvtool does not know ({', '.join(unknown)})"
    return None


def _state_layers(model: ModelKV) -> str | None:
    layers = [name for g in model.groups if g.kind == "state" for name in g.layers]
    if layers:
        return (f"{len(layers)} state layers (Mamba or linear attention, e.g. {layers[0]}) keep a recurrent state, "
                "not KV, which kvtool does not store, and every prefix needs it")
    return None


def _mla(model: ModelKV) -> str | None:
    if not any(g.kind == "mla" for g in model.groups):
        return None
    if not model.cached_prefill:
        return ("multi-head latent attention on vLLM's reference CPU backend, which computes no prompt over cached "
                "tokens (vLLM turns its own prefix caching off for it)")
    return "multi-head latent attention: kvtool's entries hold keys and values per layer, not MLA's one latent per token"


def _block_sizes(model: ModelKV) -> str | None:
    sizes = sorted({g.block_size for g in model.groups} | {model.hash_block_size})
    if len(sizes) > 1:
        return f"KV cache groups with different block sizes or block hashes ({'/'.join(map(str, sizes))} tokens)"
    return None


def _kv_shapes(model: ModelKV) -> str | None:
    shapes = sorted({(g.kv_heads, g.head_size) for g in model.groups})
    if len(shapes) > 1:
        return f"layers with different KV shapes ({', '.join(f'{h} heads x {d}' for h, d in shapes)})"
    return None


def _kv_dtype(model: ModelKV) -> str | None:
    if model.dtype is None:
        return f"KV cache dtype {model.cache_dtype!r} (kvtool holds {', '.join(sorted(set(KV_DTYPES)))})"
    dtypes = sorted({g.dtype for g in model.groups})
    if len(dtypes) > 1:
        return f"layers whose KV caches differ in dtype ({', '.join(dtypes)}; a quantized cache with skipped layers?)"
    return None


REFUSALS: tuple[Callable[[ModelKV], str | None], ...] = (
    _unknown_specs, _state_layers, _mla, _block_sizes, _kv_shapes, _kv_dtype,
)
