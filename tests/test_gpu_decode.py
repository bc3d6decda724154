"""The Triton kernels of exphuff-lanes against the C core and the numpy reference, bit for bit.

Without a GPU they run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set
here before the kernels are imported), slowly: the blocks are kept small and use short
lanes (few lock steps). With a GPU the same tests run on it.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="the GPU decoder's tests need Triton (pip install kvtool[gpu])")

from float_blocks import float_blocks
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool import _native, gpu
from kvtool._native import lanes_reference
from kvtool.cache import KVCache
from kvtool.kvz import open_kvz
from kvtool.errors import DecodeError
from kvtool.gpu.decode import decode_chunks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "v1-array-exphuff-lanes.kvz")


def bits(block: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(block).view(f"u{block.itemsize}")


def native_decode(chunk: bytes, name: str, shape) -> np.ndarray:
    out = np.zeros(shape, f"u{lanes_reference.FAMILIES[name].width}")
    assert _native.core().exphuff_decode(chunk, out.reshape(-1).view(np.uint8), _native.DTYPE_CODES[name], *shape) == 0
    return out


def test_the_gpu_path_says_how_it_runs():
    ok, how = gpu.status()
    assert ok and ("interpreter" in how if DEVICE == "cpu" else "Triton" in how)


def test_real_samples_decode_as_the_core_and_the_reference_do(samples):
    """K and V of two layers of each sample, all chunks of one batch, as the restore path launches them."""
    chunks, shapes, expected = [], [], []
    for path in samples:
        cache = KVCache.load(path, layers=[0, 29], tokens=slice(0, 48))
        for _, _, block in cache.tensors():
            chunk = lanes_reference.encode(block, "bf16", 16)
            assert np.array_equal(lanes_reference.decode(chunk, "bf16", block.shape), bits(block))
            if _native.core() is not None:
                assert np.array_equal(native_decode(chunk, "bf16", block.shape), bits(block))
            chunks.append(chunk)
            shapes.append(block.shape)
            expected.append(bits(block))
    for got, want in zip(decode_chunks(chunks, shapes, "bf16", DEVICE), expected):
        assert np.array_equal(got, want)


def test_the_golden_file_decodes_on_the_gpu_path():
    with open_kvz(GOLDEN) as reader:
        cache = reader.read()
        chunks = [bytes(reader._source.read(int(e["offset"]), int(e["stored_len"]))) for e in reader.index]
        shape = reader.tensors[0][2]
    got = decode_chunks(chunks, [shape] * len(chunks), "bf16", DEVICE)
    for out, (_, _, array) in zip(got, cache.tensors()):
        assert np.array_equal(out, bits(array))


@settings(max_examples=12, deadline=None)
@given(float_blocks(max_heads=2, max_tokens=24, max_dim=16), st.sampled_from([16, 24]))
def test_generated_blocks_decode_bit_for_bit(case, lane):
    """Signed zeros, subnormals, NaN and Inf patterns, one-symbol blocks, empty and odd shapes, every dtype."""
    name, block = case
    chunk = lanes_reference.encode(block, name, lane)
    if _native.core() is not None:
        assert np.array_equal(native_decode(chunk, name, block.shape), bits(block))
    # two copies in one batch: the second chunk's lanes and rows start where the first's end
    for got in decode_chunks([chunk, chunk], [block.shape] * 2, name, DEVICE):
        assert np.array_equal(got, bits(block))


def test_damaged_chunks_are_refused_like_the_core_refuses_them(samples):
    block = KVCache.load(samples[0], layers=[3], tokens=slice(0, 16)).keys[0]
    chunk = lanes_reference.encode(block, "bf16", 16)
    heads, _, dim = block.shape
    table_at = 2 + heads * dim + block.size + 2
    flipped_length = bytearray(chunk)
    flipped_length[table_at + 32 + 8] ^= 0x01  # a code length: the code is no longer complete
    cases = {
        "truncated": chunk[:-1],
        "longer": chunk + b"\0",
        "version 1": b"\x01" + chunk[1:],
        "incomplete code": bytes(flipped_length),
    }
    for what, bad in cases.items():
        with pytest.raises(DecodeError):
            lanes_reference.decode(bad, "bf16", block.shape)
        assert _native.core() is None or _native.core().exphuff_decode(
            bad, np.zeros(block.size, np.uint16).view(np.uint8), 0, *block.shape) != 0, what
        with pytest.raises(DecodeError, match="does not decode on the GPU"):
            decode_chunks([chunk, bad], [block.shape] * 2, "bf16", DEVICE)


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvtool.gpu import kernels

def build(fn, types, consts):
    names = fn.arg_names
    source = ASTSource(fn=fn, signature={n: types.get(n, "constexpr") for n in names},
                       constexprs={(names.index(n),): v for n, v in consts.items()})
    try:
        return triton.compile(source, target=GPUTarget("cuda", 90, 32))
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower():
            print("no-ptxas", exc)
            sys.exit(0)
        raise

pointers = {"src": "*u8", "desc": "*i64", "table": "*i32", "lane_start": "*i64", "status": "*i32"}
table = build(kernels.code_table_kernel, pointers, {"HEADS": 8, "DIM": 128, "RAW_BYTES": 1, "LANE_TILE": 1024})
decode = build(kernels.decode_kernel, {**pointers, "rows": "*i64", "dst": "*u16", "row_base": "i64"},
               {"HEADS": 8, "DIM": 128, "WIDTH": 2, "RAW_BYTES": 1, "EMASK": 0xFF, "ESHIFT": 0, "LANES": 128})
for compiled in (table, decode):
    assert compiled.asm["cubin"] and ".local" not in compiled.asm["ptx"], "not built, or registers spilled"
print("built")
"""


def test_the_kernels_compile_for_a_hopper_gpu():
    """The same kernels through Triton's real compiler (to cubin for sm_90), which the interpreter skips:
    constexpr globals, types and control flow a GPU build takes, and no register spills. Needs no GPU, only
    Triton's bundled ptxas; it runs in a process of its own, without the interpreter."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    if done.stdout.startswith("no-ptxas"):
        pytest.skip(f"Triton's CUDA assembler cannot run here: {done.stdout[:300]}")
    assert done.stdout.strip().endswith("built")
