"""The row layout of vLLM's CPU offload region as kvtool's tier reads it (no vLLM needed).

The configurations are shaped as vLLM 0.32's ``OffloadingConfig``; the tests with
vLLM's real classes are in tests/vllm_e2e/test_vllm_offload_tier.py.
"""

from __future__ import annotations

import mmap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import kvtool
from kvtool.errors import UsageError
from kvtool.integrations.vllm_offload.rows import RowLayout, chunk_namer

ROOT = Path(__file__).resolve().parents[1]
HEADS, DIM, BLOCK, BLOCKS, LAYERS = 3, 64, 16, 2, 2
PER_BLOCK = LAYERS * BLOCK * HEADS * 2 * DIM * 2  # bf16


def config(**changes):
    base = dict(
        canonical_layout=False, kv_cache_layout="LBNHC", worker_kv_bytes_per_block=PER_BLOCK,
        groups=(SimpleNamespace(tokens_per_block=BLOCK, layer_names=tuple(f"l{i}" for i in range(LAYERS))),),
        model=SimpleNamespace(name="m", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=BLOCK, blocks_per_chunk=BLOCKS),
        parallel=SimpleNamespace(world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1),
    )
    base.update(changes)
    return SimpleNamespace(**base)


def stride(workers: int = 1) -> int:
    used = workers * BLOCKS * PER_BLOCK
    return -(-used // mmap.PAGESIZE) * mmap.PAGESIZE


@pytest.mark.parametrize(("order", "head_dim"), [("LBNHC", DIM), ("LBHNC", DIM), ("NHD", None), ("HND", DIM)])
def test_decoding_into_the_offsets_gives_back_the_row(order, head_dim):
    """Every stored run lands where it was read from: split (encode) and row_offsets (decode) agree."""
    layout = RowLayout.from_config(config(kv_cache_layout=order), stride(), False, head_dim)
    region = np.zeros((3, layout.row_stride), np.uint8)
    sample = kvtool.load(ROOT / "samples" / "code.safetensors")
    region[1, :layout.used_bytes] = np.concatenate([sample.keys[0].reshape(-1), sample.values[0].reshape(-1)]) \
        .view(np.uint8)[:layout.used_bytes]
    arrays = [a for pair in layout.split(region[1, :layout.used_bytes].view(layout.dtype.numpy)) for a in pair]
    restored = np.zeros_like(region)
    offsets = layout.row_offsets() + 1 * layout.row_stride
    run = layout.array_shape[2] * layout.dtype.itemsize
    for array, where in zip(arrays, offsets):
        for (h, t), offset in np.ndenumerate(where):
            restored.reshape(-1)[offset:offset + run] = array[h, t].view(np.uint8)
    assert np.array_equal(restored, region)
    assert {a.shape for a in arrays} == {layout.array_shape}


def test_with_head_dim_the_arrays_are_heads_tokens_dim():
    layout = RowLayout.from_config(config(), stride(), False, DIM)
    assert layout.array_shape == (HEADS, BLOCK * BLOCKS, DIM) and layout.num_arrays == LAYERS
    assert RowLayout.from_config(config(parallel=two_workers()), stride(2), False, DIM).num_arrays == 2 * LAYERS
    replicated = RowLayout.from_config(config(parallel=two_workers()), stride(1), True, DIM)  # one copy for all
    assert replicated.num_arrays == LAYERS


def two_workers():
    return SimpleNamespace(world_size=2, tp_size=2, pp_size=1, pcp_size=1, dcp_size=1)


@pytest.mark.parametrize(("changes", "row", "head_dim", "message"), [
    ({"canonical_layout": True}, None, DIM, "canonical_layout is not supported"),
    ({"kv_cache_layout": "BLNHC"}, None, DIM, "layout 'BLNHC' is not supported"),
    ({"kv_cache_layout": None}, None, DIM, "layout None is not supported"),
    ({"kv_cache_layout": "HND"}, None, None, "LBHNC \\(HND\\) needs the model's head_dim"),
    ({"model": SimpleNamespace(name="m", dtype="int8_per_token_head")}, None, DIM, "dtype 'int8_per_token_head'"),
    ({"parallel": SimpleNamespace(world_size=2, tp_size=1, pp_size=2, pcp_size=1, dcp_size=1)}, None, DIM,
     "pipeline or context parallelism"),
    ({"groups": config().groups * 2}, None, DIM, "2 KV cache groups"),
    ({}, 2 * mmap.PAGESIZE * 64, DIM, "offload rows are"),
    ({}, None, 100, "not 16 tokens of whole 400-byte key/value runs"),
    ({}, None, 0, "head_dim must be a positive integer"),
])
def test_what_it_does_not_understand_is_refused_in_one_line(changes, row, head_dim, message):
    with pytest.raises(UsageError, match=message) as info:
        RowLayout.from_config(config(**changes), row or stride(), False, head_dim)
    assert "\n" not in str(info.value) and str(info.value).startswith("kvtool tier: ")


def test_keys_bind_everything_the_bytes_depend_on():
    layout = RowLayout.from_config(config(), stride(), False, DIM)
    namer = chunk_namer(config(), "exphuff", layout)
    key = b"h" * 32 + (0).to_bytes(4, "big")
    assert namer.key(key) == chunk_namer(config(), "exphuff", layout).key(key)
    others = [
        chunk_namer(config(), "zstd:3", layout),
        chunk_namer(config(model=SimpleNamespace(name="other", dtype="bfloat16")), "exphuff", layout),
        chunk_namer(config(), "exphuff", RowLayout.from_config(config(), stride(), False, None)),
        chunk_namer(config(parallel=two_workers()), "exphuff",
                    RowLayout.from_config(config(parallel=two_workers()), stride(2), False, DIM)),
        chunk_namer(config(), "exphuff", layout, model="served-name"),
    ]
    assert len({namer.key(key)} | {n.key(key) for n in others}) == 1 + len(others)
    assert namer.key(key) != namer.key(b"h" * 32 + (1).to_bytes(4, "big"))  # the KV cache group


def workers(n: int) -> SimpleNamespace:
    return SimpleNamespace(world_size=n, tp_size=n, pp_size=1, pcp_size=1, dcp_size=1)


def test_one_copy_is_shared_by_every_tp_size_a_shard_by_none():
    """vLLM's replicated_layout keeps one copy of KV every worker holds alike (an MLA latent): the
    same bytes as one worker's row, at any TP size. Sharded rows hold one cell per worker."""
    key = b"h" * 32 + (0).to_bytes(4, "big")
    one_copy = {chunk_namer(config(parallel=workers(n)), "exphuff",
                            RowLayout.from_config(config(parallel=workers(n)), stride(1), n > 1, DIM)).key(key)
                for n in (1, 2, 4, 8)}
    assert len(one_copy) == 1
    sharded = {chunk_namer(config(parallel=workers(n)), "exphuff",
                           RowLayout.from_config(config(parallel=workers(n)), stride(n), False, DIM)).key(key)
               for n in (2, 4, 8)}
    assert len(sharded) == 3 and not sharded & one_copy
