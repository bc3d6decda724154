"""GPU restore of exphuff-lanes entries: decode speed, compressed against raw host-to-device, paged restores.

    python benchmarks/gpu/gpu_restore.py --json out/gpu-restore.json   # one CUDA GPU, under 5 minutes
    TRITON_INTERPRET=1 python benchmarks/gpu/gpu_restore.py --smoke    # tiny sizes on CPU tensors: it runs
    python benchmarks/gpu/gpu_restore.py --host-only                   # no GPU: the host's share of a restore

Needs kvtool's tree, torch and Triton; nothing is downloaded. Measures, on the committed samples
and on a Qwen3-8B-shaped entry (36 layers x 8 KV heads x 128, 256 tokens, bf16; its values are
the samples' channels tiled to that shape):

- GPU decode: GB of output per second, the kernels alone (chunks already on the device);
- restore per GB: host-to-device of the raw bf16 bytes from pinned memory, against host-to-device
  of the compressed bytes plus the decode;
- a restore of N entries into paged tensors laid out as vLLM's CUDA backends lay them out
  ([blocks, kv_heads, block_size, 2 * head_dim]), through the connector's own GPU path, checked
  bit for bit against the CPU decode, with its wall time and the CPU seconds it spent per GB;
- the same N entries coded with ``exphuff`` (which the GPU does not decode) restored by the
  connector's ``Restore`` into the same pages: decoded on the CPU into pinned staging in block
  order, copied to the device layer by layer; wall time, CPU seconds per GB, bit for bit.

``--host-only`` runs that restore on CPU tensors with the kernels left out (nothing is decoded):
the CPU seconds per GB the host spends on a GPU restore (checksums, the pinned buffer, the
descriptors and row tables), measurable without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvtool.cache import KVCache, ModelFacts
from kvtool.kvz import KvzReader, encode_cache

BLOCK = 16


def qwen_shaped(samples: list[Path], layers: int, heads: int, dim: int, tokens: int, seed: int) -> KVCache:
    """A cache of the given shape whose channels are the samples' channels, tiled (real exponent statistics)."""
    sources = [KVCache.load(p) for p in samples]
    rng = np.random.default_rng(seed)

    def tensor(kind: str) -> np.ndarray:
        cache = sources[int(rng.integers(len(sources)))]
        pool = cache.keys if kind == "k" else cache.values
        parts = []
        for _ in range(heads):
            chans = [pool[int(rng.integers(len(pool)))][int(rng.integers(pool[0].shape[0]))] for _ in range(-(-dim // pool[0].shape[2]))]
            head = np.concatenate(chans, axis=1)[:, :dim]
            reps = -(-tokens // head.shape[0])
            parts.append(np.concatenate([head] * reps, axis=0)[:tokens])
        return np.stack(parts)

    return KVCache([tensor("k") for _ in range(layers)], [tensor("v") for _ in range(layers)], ModelFacts("qwen3-8b-shaped"))


def timed(torch, device, fn, repeat: int) -> float:
    """Median seconds of ``fn`` (device work included)."""
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_entry(torch, device, name: str, cache: KVCache, recipe: str, repeat: int) -> dict:
    """Decode GB/s and restore per GB, raw against compressed, for one entry as one batch."""
    from kvtool.gpu import decode

    blob = encode_cache(cache, recipe, chunk_tokens=cache.num_tokens, threads=1)
    reader = KvzReader.from_bytes(blob)
    index = reader.index
    heads, _, dim = reader.tensors[0][2]
    host = np.frombuffer(blob, np.uint8)
    offsets, lengths = index["offset"].astype(np.int64), index["stored_len"].astype(np.int64)
    counts = index["token_count"].astype(np.int64)
    rows_per = heads * counts
    starts = np.cumsum(rows_per) - rows_per
    batch = decode.describe(host, offsets, lengths, counts, starts, "bf16", heads, dim)
    pinned = torch.from_numpy(host.copy()).pin_memory() if device.type == "cuda" else torch.from_numpy(host.copy())
    src = pinned.to(device)
    rows = (torch.arange(int(rows_per.sum()), dtype=torch.int64) * dim).to(device)
    out = torch.zeros(int(rows_per.sum()) * dim, dtype=torch.uint16, device=device)
    scratch = decode.Scratch.for_batch(batch, device)

    def run() -> None:
        decode.run_kernels(src, batch, scratch, 0, len(index), rows, out, 0, "bf16", heads, dim)

    run()
    decode.check(scratch.status)
    expected = np.concatenate([np.ascontiguousarray(a).view(np.uint16).reshape(-1) for _, _, a in reader.read().tensors()])
    exact = bool(np.array_equal(out.cpu().numpy(), expected))
    raw_bytes = expected.nbytes
    decode_s = timed(torch, device, run, repeat)
    raw_host = torch.from_numpy(expected.view(np.uint8).copy())
    raw_host = raw_host.pin_memory() if device.type == "cuda" else raw_host
    raw_dev = torch.empty(raw_bytes, dtype=torch.uint8, device=device)
    raw_s = timed(torch, device, lambda: raw_dev.copy_(raw_host, non_blocking=True), repeat)

    def compressed() -> None:
        src.copy_(pinned, non_blocking=True)
        run()

    compressed_s = timed(torch, device, compressed, repeat)
    gb = raw_bytes / 1e9
    return {
        "entry": name, "raw_bytes": raw_bytes, "stored_bytes": len(blob), "ratio": raw_bytes / len(blob),
        "chunks": len(index), "lanes": batch.lanes, "bit_exact": exact,
        "decode_GBps": gb / decode_s, "h2d_raw_GBps": gb / raw_s, "h2d_compressed_plus_decode_GBps": gb / compressed_s,
        "speedup_vs_raw": raw_s / compressed_s,
    }


def shuffled_pages(torch, device, caches: list[KVCache], seed: int):
    """Empty CUDA-layout paged tensors ([blocks, kv_heads, block_size, 2 * head_dim], vLLM's CUDA backends) with room
    for every entry, as the connector's ``PagedLayers``, and each entry's blocks, shuffled."""
    from kvtool.integrations.vllm.paged import kv_views
    from kvtool.integrations.vllm.transfer import PagedLayers

    layers, heads, dim = len(caches[0].keys), caches[0].keys[0].shape[0], caches[0].keys[0].shape[2]
    per_entry = caches[0].num_tokens // BLOCK
    blocks = per_entry * len(caches) + 3
    tensors = [torch.zeros(blocks, heads, BLOCK, 2 * dim, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    views = [kv_views(t, "FLASH_ATTN", dim, BLOCK) for t in tensors]
    paged = PagedLayers([f"l{i}" for i in range(layers)], [k for k, _ in views], [v for _, v in views], BLOCK, torch.bfloat16)
    ids = np.random.default_rng(seed).permutation(blocks)[: per_entry * len(caches)].reshape(len(caches), per_entry)
    return paged, [[int(b) for b in row] for row in ids]


def pages_hold(torch, paged, caches: list[KVCache], ids: list[list[int]]) -> bool:
    """Whether each entry's blocks hold its cache bit for bit, as vLLM's own copy would have put it there."""
    from kvtool.integrations.vllm.paged import scatter_blocks
    from kvtool.torchbits import from_numpy

    exact = True
    for cache, block_ids in zip(caches, ids):
        for i in range(len(paged.keys)):
            for view, array in ((paged.keys[i], cache.keys[i]), (paged.values[i], cache.values[i])):
                want = torch.zeros_like(view)
                scatter_blocks(want, block_ids, from_numpy(np.ascontiguousarray(array), torch.bfloat16))
                exact &= bool(torch.equal(view[block_ids].view(torch.int16), want[block_ids].view(torch.int16)))
    return exact


def restore_row(torch, device, caches: list[KVCache], restore, repeat: int) -> dict:
    """Wall time and CPU seconds per GB of ``restore()`` (which returns its CPU seconds) over these entries."""
    cpu_times: list[float] = []
    wall = timed(torch, device, lambda: cpu_times.append(restore()), repeat)
    gb = sum(c.nbytes for c in caches) / 1e9
    return {"entries": len(caches), "raw_bytes": int(gb * 1e9), "restore_GBps": gb / wall, "restore_seconds": wall,
            "cpu_seconds_per_GB": float(np.median(cpu_times)) / gb}


def bench_paged_restore(torch, device, caches: list[KVCache], recipe: str, repeat: int, check: bool = True) -> dict:
    """N entries restored into shuffled blocks of CUDA-layout paged tensors through the connector's GPU path."""
    from kvtool.entries import Expected, put_cache, restore_into
    from kvtool.gpu.pages import GpuPages
    from kvtool.store import open_store

    paged, ids = shuffled_pages(torch, device, caches, seed=1)
    store = open_store("memory://")
    for i, c in enumerate(caches):
        assert put_cache(store, f"e{i}", c, recipe).stored
    heads, tokens, dim = caches[0].keys[0].shape
    expected = Expected(len(paged.keys), (heads, tokens, dim), "bf16")
    assert not check or GpuPages.usable(paged.keys, paged.values), "the GPU path does not take these paged tensors"

    def restore() -> float:
        """The connector's GPU path: each entry fetched once and handed to the step's GPU pages stored, then every
        layer queued; the host's CPU time up to there."""
        cpu = time.process_time()
        pages = GpuPages(paged.keys, paged.values)
        for i, block_ids in enumerate(ids):
            restored = restore_into(store, f"e{i}", expected, pages.entry(block_ids))
            assert restored.ok, restored.detail
        pages.start()
        for i in range(len(paged.keys)):
            pages.wait_layer(i)
        cpu = time.process_time() - cpu  # the host's share: it has not waited for the device so far
        assert not pages.failures()
        return cpu

    restore()
    decoded = [KvzReader.from_bytes(store.fetch(f"e{i}").entry.value).read() for i in range(len(caches))]
    return {**restore_row(torch, device, caches, restore, repeat),
            "bit_exact": check and pages_hold(torch, paged, decoded, ids)}


def bench_fallback_restore(torch, device, caches: list[KVCache], repeat: int) -> dict:
    """N ``exphuff`` entries restored by the connector's ``Restore`` into CUDA-layout pages: CPU decode, pinned
    staging, per-layer copies (on CPU tensors, the same path with the pages taken for a device's)."""
    from kvtool.integrations.vllm.plan import LoadJob
    from kvtool.integrations.vllm.transfer import Restore, encode_and_store
    from kvtool.store import open_store

    paged, ids = shuffled_pages(torch, device, caches, seed=2)
    if device.type == "cpu":
        paged.__dict__["on_cpu"] = False  # the staging path a CUDA cache takes, on CPU tensors
    store = open_store("memory://")
    for i, c in enumerate(caches):
        assert encode_and_store(store, f"x{i}", c.keys, c.values, "exphuff", c.model)
    jobs = {f"r{i}": [LoadJob(f"x{i}", len(block_ids), 0, block_ids)] for i, block_ids in enumerate(ids)}

    def restore() -> float:
        cpu = time.process_time()
        r = Restore(store, lambda e: e, paged, jobs, gpu_decode=False)
        r.start(background=True)
        for i in range(len(paged.keys)):
            r.copy_layer(i)
        assert r.finish() == set()
        return time.process_time() - cpu

    restore()
    return {**restore_row(torch, device, caches, restore, repeat), "recipe": "exphuff",
            "bit_exact": pages_hold(torch, paged, caches, ids)}


def host_share(entries: int, repeat: int) -> dict:
    """CPU seconds per GB of the host's part of a GPU restore, on CPU tensors, the kernels not run."""
    os.environ["TRITON_INTERPRET"] = "1"  # CPU tensors taken as GPU pages; the kernels themselves are left out
    import torch

    from kvtool.gpu import restore

    samples = sorted((ROOT / "samples").glob("*.safetensors"))
    shaped = [qwen_shaped(samples, 36, 8, 128, 256, seed) for seed in range(entries)]
    restore.run_kernels = lambda *args, **kwargs: None  # the device's part
    result = bench_paged_restore(torch, torch.device("cpu"), shaped, "exphuff-lanes", repeat, check=False)
    return {"entries": entries, "raw_bytes": result["raw_bytes"], "host_cpu_seconds_per_GB": result["cpu_seconds_per_GB"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (for TRITON_INTERPRET=1 on CPU)")
    parser.add_argument("--entries", type=int, default=8, help="entries in the paged restore")
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--host-only", action="store_true", help="no GPU: the host's CPU s per GB of a GPU restore")
    args = parser.parse_args()
    import torch

    if args.host_only:
        share = host_share(args.entries, args.repeat)
        print(f"host share of a GPU restore of {share['entries']} Qwen3-8B-shaped entries "
              f"({share['raw_bytes'] / 1e6:.0f} MB): {share['host_cpu_seconds_per_GB']:.4f} CPU s per restored GB")
        if args.json:
            args.json.write_text(json.dumps(share, indent=1) + "\n")
        return 0

    from kvtool import gpu

    ok, how = gpu.status()
    if not ok:
        print(f"GPU decoding cannot run here: {how}", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() and not gpu.interpreted() else "cpu")
    samples = sorted((ROOT / "samples").glob("*.safetensors"))
    if args.smoke:
        recipe, repeat, entries = "exphuff-lanes:16", 1, min(args.entries, 2)
        cases = {p.stem: KVCache.load(p, layers=[0, 1], tokens=slice(0, 32)) for p in samples[:1]}
        shaped = [qwen_shaped(samples, 2, 2, 32, 32, seed) for seed in range(entries)]
    else:
        recipe, repeat, entries = "exphuff-lanes", args.repeat, args.entries
        cases = {p.stem: KVCache.load(p) for p in samples}
        shaped = [qwen_shaped(samples, 36, 8, 128, 256, seed) for seed in range(entries)]
    cases["qwen3-8b-shaped"] = shaped[0]
    gpu_name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU tensors, {how.split(' on ')[0]}"
    result = {"device": how, "recipe": recipe, "torch": torch.__version__,
              "entries": [bench_entry(torch, device, name, c, recipe, repeat) for name, c in cases.items()],
              "paged_restore": bench_paged_restore(torch, device, shaped, recipe, repeat),
              "cpu_decode_restore": bench_fallback_restore(torch, device, shaped, repeat)}
    for row in (*result["entries"], result["paged_restore"], result["cpu_decode_restore"]):
        row["device"] = gpu_name
    print(f"# {how}; recipe {recipe}")
    print("| device | entry | MB | ratio | bit-exact | GPU decode GB/s | H2D raw GB/s | H2D compressed + decode GB/s | vs raw |")
    print("|---|---|---|---|---|---|---|---|---|")
    for e in result["entries"]:
        print(f"| {gpu_name} | {e['entry']} | {e['raw_bytes'] / 1e6:.2f} | {e['ratio']:.3f} | {e['bit_exact']} | {e['decode_GBps']:.1f} | "
              f"{e['h2d_raw_GBps']:.1f} | {e['h2d_compressed_plus_decode_GBps']:.1f} | {e['speedup_vs_raw']:.2f}x |")
    r = result["paged_restore"]
    print(f"{gpu_name}: paged restore of {r['entries']} entries ({r['raw_bytes'] / 1e6:.1f} MB): {r['restore_GBps']:.1f} GB/s, "
          f"bit-exact {r['bit_exact']}, {r['cpu_seconds_per_GB']:.3f} CPU s per restored GB")
    f = result["cpu_decode_restore"]
    print(f"{gpu_name}: exphuff entries through the CPU decode into the same pages ({f['raw_bytes'] / 1e6:.1f} MB): "
          f"{f['restore_GBps']:.1f} GB/s, bit-exact {f['bit_exact']}, {f['cpu_seconds_per_GB']:.3f} CPU s per restored GB")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    exact = all(e["bit_exact"] for e in result["entries"]) and r["bit_exact"] and f["bit_exact"]
    return 0 if exact else 1


if __name__ == "__main__":
    if "--smoke" in sys.argv and not os.environ.get("TRITON_INTERPRET"):
        import importlib.util

        if importlib.util.find_spec("torch") and not __import__("torch").cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined
    sys.exit(main())
