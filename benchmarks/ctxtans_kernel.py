"""The array codecs' C kernels alone, on the same 256-token blocks, decoding into buffers allocated once,
side by side with zstd-3 on the raw bytes.

    python benchmarks/ctxtans_kernel.py out/prose-4096.safetensors out/code.kvd [--repeat 5] [--json FILE] [--codec NAME]

The cache is cut into ``[heads, 256, dim]`` blocks (every tensor, every block); each
codec encodes every block, then decodes every block into its own output array,
allocated before the timer starts (no page faults: what an engine's KV pages or a
reused arena see). ``ctxtans`` runs once per instruction set, the whole core held to it
(``ctxtans/avx512``, ``ctxtans/avx2``, ``ctxtans/scalar``: the same bytes; a set the
CPU lacks, or ``KVTOOL_SIMD`` rules out, is reported as not run), the other codecs at the
process's own level, and ``ctxans`` once, each with the dictionary
given, which should be learnt from another text (``kvtool train``); ``exphuff`` needs
none; ``zstd-3`` is libzstd at level 3 on each block's raw bytes (its decoder
allocates its output); ``memcpy`` copies each block into its output (the floor).
Speed is CPU time (``time.process_time``) on one thread per GB (10^9 bytes) of
original data, the least of ``--repeat`` rounds; each round runs every codec in
turn, so a change in the machine's load reaches them alike. Every decoded block is
compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import zstandard

from kvtool import _native
from kvtool.cache import KVCache
from kvtool.codecs.ctxans import CtxAnsCodec
from kvtool.codecs.ctxtans import tables_of
from kvtool.modeldict import registry

CHUNK = 256
CODECS = ["memcpy", "exphuff", "zstd-3", "ctxans"] + [f"ctxtans/{isa}" for isa in reversed(_native.ISAS)]


def kernels(core, dictionary, code: int) -> dict[str, tuple[Callable, Callable] | str]:
    """Per codec name its (encode, decode) of one block, or why it does not run here."""
    view = _native.byte_view
    model = tables_of(dictionary)[1]
    rans_model = CtxAnsCodec(dictionary.id)._loaded()[1]
    compressor, decompressor = zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor()

    def copy(block, out):
        np.copyto(view(out), view(block))
        return 0

    def unzstd(chunk, out):
        np.copyto(view(out), np.frombuffer(decompressor.decompress(chunk), np.uint8))
        return 0

    found: dict[str, tuple[Callable, Callable] | str] = {
        "memcpy": (lambda b: b, copy),
        "exphuff": (lambda b: core.exphuff_encode(view(b), code, *b.shape),
                    lambda c, o: core.exphuff_decode(c, view(o), code, *o.shape)),
        "zstd-3": (lambda b: compressor.compress(view(b)), unzstd),
        "ctxans": (lambda b: core.ctxans_encode(view(b), rans_model, code, *b.shape),
                   lambda c, o: core.ctxans_decode(c, view(o), rans_model, code, *o.shape)),
    }
    for index, isa in enumerate(_native.ISAS):
        if index > core.isa():
            found[f"ctxtans/{isa}"] = f"not run: this process has no {isa} (its level: {_native.isa_here()})"
            continue
        found[f"ctxtans/{isa}"] = (lambda b: core.ctxtans_encode(view(b), model, code, *b.shape),
                                   lambda c, o: core.ctxtans_decode(c, view(o), model, code, *o.shape))
    return found


def level_of(name: str, here: int) -> int:
    """The vector level (of ``_native.ISAS``) codec `name` runs at: its own for ``ctxtans/ISA``, else ``here``."""
    return _native.ISAS.index(name.split("/")[1]) if name.startswith("ctxtans/") else here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache", type=Path)
    parser.add_argument("dictionary", type=Path, help="a .kvd learnt from another text of the same model and dtype")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--codec", action="append", choices=CODECS, help="only these codecs (repeatable; default all)")
    args = parser.parse_args()
    core = _native.core()
    if core is None:
        sys.exit(f"the native core is not there: {_native.status()}")
    cache = KVCache.load(args.cache)
    dictionary = registry.load(args.dictionary)
    view = _native.byte_view
    blocks = [np.ascontiguousarray(a[:, t : t + CHUNK]) for _, _, a in cache.tensors() for t in range(0, a.shape[1], CHUNK)]
    outs = [np.empty_like(b) for b in blocks]
    raw = sum(b.nbytes for b in blocks)
    found = kernels(core, dictionary, _native.DTYPE_CODES[cache.dtype.name])
    names = [n for n in CODECS if not args.codec or n in args.codec]
    runs = {n: found[n] for n in names if not isinstance(found[n], str)}
    best = {n: [float("inf"), float("inf")] for n in runs}
    stored = {}
    here = core.isa()
    for _ in range(args.repeat):
        for name, (encode, decode) in runs.items():
            core.isa(level_of(name, here))
            start = time.process_time()
            chunks = [encode(b) for b in blocks]
            best[name][0] = min(best[name][0], time.process_time() - start)
            start = time.process_time()
            status = [decode(c, o) for c, o in zip(chunks, outs)]
            best[name][1] = min(best[name][1], time.process_time() - start)
            if any(status) or not all(np.array_equal(view(b), view(o)) for b, o in zip(blocks, outs)):
                sys.exit(f"{name}: decoded data differs")
            stored[name] = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
    rows = []
    for name in names:
        if name not in runs:
            rows.append({"codec": name, "not_run": found[name]})
            continue
        enc_s, dec_s = best[name]
        rows.append({"codec": name, "ratio": raw / stored[name], "encode_s_per_gb": enc_s / raw * 1e9,
                     "decode_s_per_gb": dec_s / raw * 1e9, "decode_gb_per_s": raw / dec_s / 1e9})
    print(f"{args.cache.name}, {len(blocks)} blocks of {CHUNK} tokens, dictionary {dictionary.id[:12]} ({args.dictionary.name}), "
          f"best of {args.repeat} rounds")
    print("| codec | ratio | encode CPU s/GB | decode CPU s/GB | decode GB/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        if "not_run" in r:
            print(f"| {r['codec']} | {r['not_run']} | | | |")
            continue
        encode = f"{r['encode_s_per_gb']:.2f}" if r["codec"] != "memcpy" else ""
        print(f"| {r['codec']} | {r['ratio']:.4f} | {encode} | {r['decode_s_per_gb']:.2f} | {r['decode_gb_per_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
