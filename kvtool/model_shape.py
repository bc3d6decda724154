"""A model's KV cache bytes per token, read from its Hugging Face ``config.json``: which layers keep what.

Per token, an attention layer keeps the keys and values of its KV heads
(``2 x kv_heads x head_dim`` elements), or one latent (DeepSeek's multi-head
latent attention: ``kv_lora_rank + qk_rope_head_dim`` elements, no K/V split).
A sliding-window layer keeps at most its window of tokens in the engine (a
store that saves whole prompts still holds every token of it). A state layer
(Mamba, linear attention) keeps one fixed state per sequence and nothing per
token; a layer with neither (an MLP-only block) keeps nothing.

Which layer is which, by the config conventions ``LAYER_KINDS`` and
``_layer_kinds`` read: ``layer_types`` (Gemma 3, Qwen3-Next, gpt-oss),
``hybrid_override_pattern`` (Nemotron-H), ``attn_layer_indices`` or
``attn_layer_period``/``attn_layer_offset`` (Bamba, Jamba),
``sliding_window_pattern`` (Gemma 2 and 3 configs without ``layer_types``), a
``sliding_window`` on every layer (Mistral) unless ``use_sliding_window`` is false
(Qwen).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtool.errors import UsageError

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}

#: ``layer_types`` values -> what the layer keeps: "full" (every token), "sliding" (a window), "state", "none".
LAYER_KINDS = {
    "full_attention": "full", "attention": "full", "global_attention": "full",
    "sliding_attention": "sliding", "local_attention": "sliding", "chunked_attention": "sliding",
    "linear_attention": "state", "mamba": "state", "mamba2": "state", "conv": "state", "short_conv": "state",
}
#: ``hybrid_override_pattern`` letters (Nemotron-H): attention, Mamba, MLP, mixture of experts.
PATTERN_KINDS = {"*": "full", "M": "state", "-": "none", "E": "none"}


@dataclass(frozen=True)
class ModelShape:
    """What a model's KV cache holds per token, and per sequence in the engine."""

    name: str
    layers: int  # layers that keep KV per token (windowed ones included)
    kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    latent_dim: int = 0  # MLA: elements of the one latent per token and layer; 0: keys and values per head
    window: int = 0  # the sliding window, in tokens, of ``window_layers`` of the layers
    window_layers: int = 0
    state_layers: int = 0  # Mamba or linear-attention layers: a fixed state per sequence, no per-token KV

    @property
    def bytes_per_layer_token(self) -> int:
        return (self.latent_dim or 2 * self.kv_heads * self.head_dim) * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_token(self) -> int:
        """Every KV layer's bytes for one token: what a stored prompt holds per token."""
        return self.layers * self.bytes_per_layer_token

    def engine_bytes(self, context: int) -> int:
        """The KV bytes one sequence of ``context`` tokens holds in the engine: windowed layers only their window."""
        windowed = min(context, self.window) if self.window_layers else 0
        return ((self.layers - self.window_layers) * context + self.window_layers * windowed) * self.bytes_per_layer_token

    def describe(self) -> str:
        """``30 layers x 3 KV heads x 64 dims x K,V x 2 bytes``, and what else the model keeps."""
        size = DTYPE_BYTES[self.dtype]
        text = (f"{self.layers} layers x {self.latent_dim}-element latent x {size} bytes" if self.latent_dim else
                f"{self.layers} layers x {self.kv_heads} KV heads x {self.head_dim} dims x K,V x {size} bytes")
        if self.window_layers:
            text += f"; {self.window_layers} of them keep a {self.window}-token window in the engine"
        if self.state_layers:
            text += f"; {self.state_layers} state layers keep no per-token KV"
        return text


def shape_from_config(path: str | Path, dtype: str = "bf16") -> ModelShape:
    """The KV shape of a Hugging Face ``config.json`` (its ``text_config`` where it has one), named after the model."""
    config = json.loads(Path(path).read_text())
    config = config.get("text_config", config)
    try:
        heads = config["num_attention_heads"]
        kinds = _layer_kinds(config)
        latent = (config["kv_lora_rank"] + config.get("qk_rope_head_dim", 0)) if config.get("kv_lora_rank") else 0
        kv_heads = 1 if latent else config.get("num_key_value_heads") or heads
        head_dim = latent or config.get("head_dim") or config["hidden_size"] // heads
    except (KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not a config kvtool can read a KV shape from (missing or malformed {exc})") from None
    window = config.get("sliding_window") or config.get("attention_chunk_size") or 0
    return ModelShape(
        name=_model_name(config, Path(path)), layers=sum(k in ("full", "sliding") for k in kinds), kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype, latent_dim=latent, window=window if "sliding" in kinds else 0,
        window_layers=kinds.count("sliding"), state_layers=kinds.count("state"),
    )


def _layer_kinds(config: dict[str, Any]) -> list[str]:
    """What each layer keeps ("full", "sliding", "state", "none"), by the first convention the config follows."""
    n = config["num_hidden_layers"]
    if config.get("layer_types"):
        unknown = sorted({t for t in config["layer_types"] if t not in LAYER_KINDS})
        if unknown:
            raise UsageError(f"layer types {unknown} are not known to kvtool; known: {', '.join(LAYER_KINDS)}")
        return [LAYER_KINDS[t] for t in config["layer_types"]]
    if config.get("hybrid_override_pattern"):
        return [PATTERN_KINDS.get(letter, "none") for letter in config["hybrid_override_pattern"]]
    if config.get("attn_layer_indices") is not None:
        return ["full" if i in config["attn_layer_indices"] else "state" for i in range(n)]
    if config.get("attn_layer_period"):
        period, offset = config["attn_layer_period"], config.get("attn_layer_offset", 0)
        return ["full" if i % period == offset else "state" for i in range(n)]
    if config.get("sliding_window") and config.get("sliding_window_pattern"):
        every = config["sliding_window_pattern"]  # every N-th layer is global, the others windowed
        return ["full" if (i + 1) % every == 0 else "sliding" for i in range(n)]
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        return ["sliding"] * n
    return ["full"] * n


def _model_name(config: dict[str, Any], path: Path) -> str:
    """The model a config describes: its ``_name_or_path``; the ``models--ORG--NAME`` folder of a
    Hugging Face cache it lies in; its architecture (``Qwen3ForCausalLM``); else its folder's name."""
    if config.get("_name_or_path"):
        return str(config["_name_or_path"])
    for folder in path.absolute().parents:
        if folder.name.startswith("models--"):
            return folder.name[len("models--"):].replace("--", "/")
    architectures = config.get("architectures") or []
    return str(architectures[0]) if architectures else str(config.get("model_type") or path.parent.name)
