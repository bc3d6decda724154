"""The Hugging Face transformers engine of the TTFT experiment (the ``model`` extra).

The model runs in fp32 (as ``kvtool.sources.hf`` loads it) with a KV cache
kept in bf16, as a server would keep it: a recomputed turn's cache is rounded
to bf16 when it is stored, and a restored cache is widened back to fp32 before
the suffix runs. Prefill runs in chunks of ``prefill_chunk`` tokens, as a
server's chunked prefill does. Time to first token is the prefill plus the
argmax of the last position's logits.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Sequence

import numpy as np

from kvtool.cache import KVCache
from kvtool.sources import hf

CACHE_DTYPE = "bf16"


class HFEngine:
    name = "hf"

    def __init__(self, model: str | None = None, prefill_chunk: int = 512) -> None:
        import torch

        self._torch = torch
        self.loaded = hf.load(model)
        self.prefill_chunk = prefill_chunk
        self.model_id = self.loaded.facts.model_id
        forward = inspect.signature(self.loaded.model.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"  # renamed in newer transformers

    def tokenize(self, text: str) -> list[int]:
        return list(self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"])

    def recompute(self, tokens: Sequence[int]) -> tuple[float, int, KVCache]:
        """Prefill the whole prompt from nothing: ``(seconds to first token, first token, bf16 cache)``."""
        start = time.perf_counter()
        first, past = self._prefill(tokens, None)
        seconds = time.perf_counter() - start
        return seconds, first, self._to_kvcache(past)

    def resume(self, restored: KVCache, tokens: Sequence[int]) -> tuple[float, float, int]:
        """Build the model's cache from ``restored`` and prefill the rest of ``tokens``.

        Returns ``(seconds to build the cache, seconds to first token after it, first token)``.
        """
        start = time.perf_counter()
        past = self._to_model_cache(restored)
        built = time.perf_counter()
        first, _ = self._prefill(tokens[restored.num_tokens :], past)
        return built - start, time.perf_counter() - built, first

    def continuation_logits(self, restored: KVCache, tokens: Sequence[int]) -> Any:
        """The model's next-token logits ``[len(tokens), vocab]`` (fp32 torch) over ``tokens`` fed after ``restored``."""
        torch = self._torch
        past = self._to_model_cache(restored)
        ids = torch.tensor([list(tokens)])
        logits = []
        with torch.inference_mode():
            for begin in range(0, ids.shape[1], self.prefill_chunk):
                out = self.loaded.model(input_ids=ids[:, begin : begin + self.prefill_chunk], use_cache=True, **{self._cache_arg: past})
                past = getattr(out, self._cache_arg)
                logits.append(out.logits[0].float())
        return torch.cat(logits)

    def greedy(self, restored: KVCache, first: int, count: int) -> list[int]:
        """``count`` tokens chosen greedily, one decode step at a time, after ``restored`` and then ``first``."""
        torch = self._torch
        past, token, chosen = self._to_model_cache(restored), first, []
        with torch.inference_mode():
            for _ in range(count):
                out = self.loaded.model(input_ids=torch.tensor([[token]]), use_cache=True, **{self._cache_arg: past})
                past = getattr(out, self._cache_arg)
                token = int(out.logits[0, -1].argmax())
                chosen.append(token)
        return chosen

    def warm_up(self) -> None:
        self._prefill(list(range(100, 164)), None)

    def _prefill(self, tokens: Sequence[int], past: Any) -> tuple[int, Any]:
        torch = self._torch
        ids = torch.tensor([list(tokens)])
        with torch.inference_mode():
            for begin in range(0, ids.shape[1], self.prefill_chunk):
                chunk = ids[:, begin : begin + self.prefill_chunk]
                out = self.loaded.model(input_ids=chunk, use_cache=True, **{self._cache_arg: past})
                past = getattr(out, self._cache_arg)
            first = int(out.logits[0, -1].argmax())
        return first, past

    def _to_kvcache(self, past: Any) -> KVCache:
        torch = self._torch
        from kvtool.torchbits import to_numpy

        def bf16(t):
            return to_numpy(t[0].to(torch.bfloat16).contiguous())

        layers = past.layers
        return KVCache([bf16(layer.keys) for layer in layers], [bf16(layer.values) for layer in layers], self.loaded.facts)

    def _to_model_cache(self, cache: KVCache) -> Any:
        torch = self._torch
        from transformers import DynamicCache

        from kvtool.torchbits import from_numpy

        def fp32(a: np.ndarray):
            return from_numpy(a, torch.bfloat16).to(torch.float32).unsqueeze(0)

        data = [(fp32(k), fp32(v)) for k, v in zip(cache.keys, cache.values)]
        return DynamicCache(ddp_cache_data=data, config=self.loaded.model.config)
