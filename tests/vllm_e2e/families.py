"""The model families of the vLLM matrix (``test_model_matrix.py``): a tiny config of each, written here, no download.

Each family is a real vLLM architecture with a few layers and a small hidden
size, run with ``load_format="dummy"`` and SmolLM2's tokenizer (the converted
model in ``out/smollm2-135m``; every config keeps its 49152-token vocabulary).
``expect`` is what kvtool's connector must do with it on vLLM's CPU build:
``exact`` (restored, the same tokens and log-probabilities as vLLM's own prefix
cache) or ``refused`` (one line saying why, nothing restored, vLLM computes);
``may_not_run`` names the vLLM error that may stop the family on some CPUs or
releases, which the matrix then reports as "not runnable" with vLLM's reason.
``tier`` is what kvtool's tier under vLLM's own offloading must do with the
family's chunk layout (``tier_rows.py``): ``exact`` or ``refused``.
"""

from __future__ import annotations

import json
import shutil
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

#: Where the matrix leaves its rows for the terminal summary (conftest.py prints them).
MATRIX_ROWS = pytest.StashKey[list]()

TEXT = (Path(__file__).resolve().parents[2] / "samples" / "texts" / "GPL-3.txt").read_text()
#: Every family is asked PROMPT + SUFFIX (about 665 tokens); OTHER + SUFFIX shows that the prefix's KV changes the output.
PROMPT, OTHER, SUFFIX = TEXT[:3000], TEXT[6000:9000], "\n\nIn short, this license"
MAX_TOKENS = 8
#: vLLM's dummy weights are uniform in +-0.001, so small that attention adds less to the residual stream than bf16
#: resolves: every output would be the same whatever the KV. The matrix draws them in +-DUMMY_RANGE.
DUMMY_RANGE = 0.2

BASE = {
    "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "hidden_act": "silu",
}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}


@dataclass(frozen=True)
class Family:
    name: str
    attention: str  # the attention kind, in the matrix's words
    config: dict[str, Any]
    expect: str  # "exact" or "refused"
    engine: dict[str, Any] = field(default_factory=dict)  # vLLM engine options (kv_cache_dtype)
    may_not_run: str | None = None  # vLLM's error where it cannot run the family
    tier: str = "exact"  # kvtool's tier under vLLM's offloading: "exact" or "refused"

    def write(self, root: Path, tokenizer_from: Path) -> Path:
        """The model folder: config.json and SmolLM2's tokenizer."""
        folder = root / self.name
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / name, folder / name)
        (folder / "config.json").write_text(json.dumps({**BASE, **self.config}, indent=1))
        return folder


FAMILIES = [
    Family("llama", "grouped-query (4 query, 2 KV heads)", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
           "exact"),
    Family("qwen3", "grouped-query, q/k norms", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}, "exact"),
    Family("qwen3-moe", "grouped-query, mixture of experts",
           {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **MOE, "decoder_sparse_step": 1,
            "mlp_only_layers": []}, "exact"),
    Family("gemma3", "sliding window (128) on 2 of 3 layers, global on 1",
           {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "num_hidden_layers": 3,
            "sliding_window": 128, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "query_pre_attn_scalar": 32, "hidden_activation": "gelu_pytorch_tanh",
            "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "exact", tier="refused"),
    Family("mistral", "sliding window (128) on every layer",
           {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 128}, "exact"),
    Family("llama-fp8", "grouped-query, fp8 (e4m3) KV cache", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
           "exact", engine={"kv_cache_dtype": "fp8"}, may_not_run="FP8 KV cache on CPU requires"),
    Family("deepseek-v2", "multi-head latent attention (512 + 64 latent)",
           {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "kv_lora_rank": 512,
            "q_lora_rank": None, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64, "v_head_dim": 32,
            "num_key_value_heads": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "moe_layer_freq": 1, "topk_method": "greedy",
            "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
            "norm_topk_prob": False}, "refused"),
    Family("qwen3-next", "3 gated-delta-net (linear attention) layers + 1 attention layer",
           {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "num_hidden_layers": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "full_attention_interval": 4,
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, **MOE, "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "partial_rotary_factor": 0.25}, "refused", tier="refused"),
    Family("nemotron-h", "Mamba-2 layer + attention layer",
           {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hybrid_override_pattern": "M*",
            "mamba_head_dim": 32, "mamba_num_heads": 8, "ssm_state_size": 16, "n_groups": 1, "conv_kernel": 4,
            "expand": 2, "chunk_size": 256, "mlp_hidden_act": "relu2"}, "refused", may_not_run="IndexError", tier="refused"),
]


def dummy_weights_in(bound: float) -> None:
    """vLLM's dummy weights drawn uniformly in +-``bound`` (the same in every process: vLLM seeds each tensor)."""
    from vllm.model_executor.model_loader import dummy_loader

    draw = dummy_loader.initialize_single_dummy_weight
    dummy_loader.initialize_single_dummy_weight = lambda tensor, *args, **kwargs: draw(tensor, -bound, bound)


def vllm_error(exc: BaseException) -> str:
    """vLLM's error in one line: its type, first line, and the innermost place in vLLM that raised it."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/vllm/" in f.filename]
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name})" if frames else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}{where}"
