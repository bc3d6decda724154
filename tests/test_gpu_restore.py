"""The connector's GPU restore path, run on CPU tensors through Triton's interpreter.

The same code as on CUDA minus streams and pinned memory: entries of the GPU's
recipe (exphuff-lanes) decoded by the kernels straight into paged blocks laid
out as vLLM's CPU and CUDA backends lay them out, other entries of the same
step through the CPU decode, and a chunk the kernels refuse marking its
request's blocks for recompute.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the GPU decoder's tests need Triton (pip install kvtool[gpu])")

from kvtool.cache import KVCache, ModelFacts
from kvtool.integrations.vllm.paged import kv_views, scatter_blocks
from kvtool.integrations.vllm.plan import LoadJob
from kvtool.integrations.vllm.stats import StatsCollector
from kvtool.integrations.vllm.transfer import PagedLayers, Restore, encode_and_store
from kvtool.store import open_store

BLOCK, BLOCKS, LAYERS = 16, 6, 2
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged(backend: str, heads: int, dim: int, dtype=torch.bfloat16) -> PagedLayers:
    """The views of empty paged tensors in ``backend``'s layout ([blocks, heads, block, 2 * dim] in vLLM 0.32)."""
    tensors = [torch.zeros(BLOCKS, heads, BLOCK, 2 * dim, dtype=dtype, device=DEVICE) for _ in range(LAYERS)]
    views = [kv_views(t, backend, dim, BLOCK) for t in tensors]
    return PagedLayers([f"l{i}" for i in range(LAYERS)], [k for k, _ in views], [v for _, v in views], BLOCK, dtype)


def sample_entry(path, tokens: slice) -> KVCache:
    return KVCache.load(path, layers=list(range(LAYERS)), tokens=tokens)


def restore(store, layers, jobs, stats=None) -> set[int]:
    r = Restore(store, lambda e: f"key/{e}", layers, jobs, stats, gpu_decode=True)
    r.start(background=True)
    for i in range(LAYERS):
        r.copy_layer(i)
    return r.finish()


def expect(layers: PagedLayers, cache: KVCache, block_ids: list[int], first_block: int = 0) -> None:
    """What the paged blocks must hold: the cache's tokens from ``first_block`` on, scattered as vLLM's copy does
    (as integers of the values' width: torch's CPU copies do not take fp8)."""
    bits = {1: (torch.uint8, np.uint8), 2: (torch.int16, np.int16)}[layers.keys[0].element_size()]
    skip = first_block * BLOCK
    for i in range(LAYERS):
        for got, array in ((layers.keys[i], cache.keys[i]), (layers.values[i], cache.values[i])):
            want = torch.zeros_like(got.view(bits[0]))
            scatter_blocks(want, block_ids, torch.from_numpy(np.ascontiguousarray(array[:, skip:]).view(bits[1])))
            assert torch.equal(got.view(bits[0]), want)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_gpu_and_cpu_entries_of_one_step_restore_bit_exactly(samples, backend, monkeypatch):
    from kvtool.gpu import restore as gpu_restore

    launches = []
    real_run = gpu_restore.run_kernels
    monkeypatch.setattr(gpu_restore, "run_kernels", lambda *a, **k: launches.append(a[3:5]) or real_run(*a, **k))
    lanes = sample_entry(samples[0], slice(0, 2 * BLOCK))
    plain = sample_entry(samples[1], slice(5, 5 + BLOCK))
    heads, _, dim = lanes.keys[0].shape
    layers = paged(backend, heads, dim)
    stats = StatsCollector()
    with open_store("memory://") as store:
        assert encode_and_store(store, "key/a", lanes.keys, lanes.values, "exphuff-lanes:16", ModelFacts("m"))
        assert encode_and_store(store, "key/b", plain.keys, plain.values, "exphuff", ModelFacts("m"))
        jobs = {"r1": [LoadJob("a", 2, 0, [4, 1])], "r2": [LoadJob("b", 1, 0, [3])]}
        assert restore(store, layers, jobs, stats) == set()
    both = KVCache([np.concatenate([a, b], axis=1) for a, b in zip(lanes.keys, plain.keys)],
                   [np.concatenate([a, b], axis=1) for a, b in zip(lanes.values, plain.values)], ModelFacts("m"))
    expect(layers, both, [4, 1, 3])
    assert len(launches) == 2 * LAYERS  # entry a's keys and values of every layer on the GPU path; b on the CPU
    assert stats.take()["counts"] == {"tokens_restored": 3 * BLOCK, "entries_restored": 2}


@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_blocks_vllm_already_has_are_left_alone(samples, dtype):
    """Also an fp8 cache (one byte per value: rows are counted in elements of the paged tensor's own size)."""
    import ml_dtypes

    cache = sample_entry(samples[1], slice(0, 3 * BLOCK))
    torch_dtype = torch.bfloat16
    if dtype == "fp8_e4m3":
        cast = [a.astype(np.float32).astype(ml_dtypes.float8_e4m3fn) for a in cache.keys + cache.values]
        cache = KVCache(cast[:LAYERS], cast[LAYERS:], cache.model)
        torch_dtype = torch.float8_e4m3fn
    heads, _, dim = cache.keys[0].shape
    layers = paged("FLASH_ATTN", heads, dim, torch_dtype)
    with open_store("memory://") as store:
        encode_and_store(store, "key/a", cache.keys, cache.values, "exphuff-lanes:16", ModelFacts("m"))
        if dtype == "fp8_e4m3":  # the path of a chunk stored raw is taken
            from kvtool.kvz import KvzReader

            assert KvzReader.from_bytes(store.get_entry("key/a").value).index["flags"].any()
        assert restore(store, layers, {"r": [LoadJob("a", 3, 1, [5, 2])]}) == set()
    expect(layers, cache, [5, 2], first_block=1)


@pytest.mark.parametrize("backend", ["CPU_ATTN", "FLASH_ATTN"])
def test_entries_the_gpu_does_not_decode_go_through_staging_in_block_order(samples, backend, monkeypatch):
    """On CUDA, an entry of another recipe decodes on the CPU into staging laid out as the blocks are, which the
    forward pass's thread copies into the pages per layer: the same path, run here on CPU pages (no pinned memory)."""
    cache = sample_entry(samples[1], slice(0, 3 * BLOCK))
    heads, _, dim = cache.keys[0].shape
    layers = paged(backend, heads, dim)
    monkeypatch.setattr(type(layers), "on_cpu", property(lambda self: False))  # what a CUDA cache says
    with open_store("memory://") as store:
        encode_and_store(store, "key/a", cache.keys, cache.values, "exphuff", ModelFacts("m"))
        r = Restore(store, lambda e: f"key/{e}", layers, {"r": [LoadJob("a", 3, 1, [5, 2])]}, gpu_decode=False)
        r.start(background=True)
        for i in range(LAYERS):
            r.copy_layer(i)
        assert r.finish() == set()
    expect(layers, cache, [5, 2], first_block=1)


def test_a_chunk_the_kernels_refuse_marks_its_blocks_for_recompute(samples, monkeypatch):
    from kvtool.gpu import decode

    cache = sample_entry(samples[0], slice(0, BLOCK))
    heads, _, dim = cache.keys[0].shape
    layers = paged("CPU_ATTN", heads, dim)
    real = decode.describe

    def lane_count_off_by_one(*args, **kwargs):
        batch = real(*args, **kwargs)
        batch.desc[-1, decode.DESC_LANES] += 1  # the last chunk's header no longer matches: refused on the device
        return decode.Batch(batch.desc, batch.lanes + 1, batch.widest + 1)

    monkeypatch.setattr("kvtool.gpu.restore.describe", lane_count_off_by_one)
    stats = StatsCollector()
    with open_store("memory://") as store:
        encode_and_store(store, "key/a", cache.keys, cache.values, "exphuff-lanes:16", ModelFacts("m"))
        assert restore(store, layers, {"r": [LoadJob("a", 1, 0, [2])]}, stats) == {2}
    assert stats.take()["counts"]["restore_failures|decode_error"] == 1


def test_the_gpu_benchmark_runs_and_checks_its_restores(tmp_path):
    """benchmarks/gpu/gpu_restore.py at tiny sizes (the interpreter without a GPU): every restore bit-exact."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "gpu_restore.py"
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, str(script), "--smoke", "--json", str(out)], check=False, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [e["entry"] for e in result["entries"]] == ["code", "qwen3-8b-shaped"]
    assert all(e["bit_exact"] for e in result["entries"]) and result["paged_restore"]["bit_exact"]
