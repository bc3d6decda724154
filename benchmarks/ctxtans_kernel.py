"""The array codecs' C kernels alone, on the same 256-token blocks, decoding into buffers allocated once.

    python benchmarks/ctxtans_kernel.py out/prose-4096.safetensors out/code.kvd [--repeat 5] [--json FILE] [--codec NAME]

The cache is cut into ``[heads, 256, dim]`` blocks (every tensor, every block); each
codec encodes every block, then decodes every block into its own output array,
allocated before the timer starts (no page faults: what an engine's KV pages or a
reused arena see). ``ctxtans`` and ``ctxans`` code with the dictionary given, which
should be learnt from another text (``kvtool train``); ``exphuff`` needs none;
``memcpy`` copies each block into its output (the floor). Speed is CPU time
(``time.process_time``) on one thread, the least of ``--repeat`` runs, per GB
(10^9 bytes) of original data; every decoded block is compared bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from kvtool import _native
from kvtool.cache import KVCache
from kvtool.codecs.ctxans import CtxAnsCodec
from kvtool.codecs.ctxtans import tables_of
from kvtool.modeldict import registry

CHUNK = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cache", type=Path)
    parser.add_argument("dictionary", type=Path, help="a .kvd learnt from another text of the same model and dtype")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--codec", action="append", choices=["memcpy", "exphuff", "ctxans", "ctxtans"],
                        help="only these codecs (repeatable; default all)")
    args = parser.parse_args()
    core = _native.core()
    if core is None:
        sys.exit(f"the native core is not there: {_native.status()}")
    cache = KVCache.load(args.cache)
    dictionary = registry.load(args.dictionary)
    tans_model = tables_of(dictionary)[1]
    rans_model = CtxAnsCodec(dictionary.id)._loaded()[1]
    code = _native.DTYPE_CODES[cache.dtype.name]
    blocks = [np.ascontiguousarray(a[:, t : t + CHUNK]) for _, _, a in cache.tensors() for t in range(0, a.shape[1], CHUNK)]
    outs = [np.empty_like(b) for b in blocks]
    raw = sum(b.nbytes for b in blocks)
    view = _native.byte_view

    def copy(block, out):
        np.copyto(view(out), view(block))
        return 0

    codecs = {
        "memcpy": (lambda b: b, copy),
        "exphuff": (lambda b: core.exphuff_encode(view(b), code, *b.shape),
                    lambda c, o: core.exphuff_decode(c, view(o), code, *o.shape)),
        "ctxans": (lambda b: core.ctxans_encode(view(b), rans_model, code, *b.shape),
                   lambda c, o: core.ctxans_decode(c, view(o), rans_model, code, *o.shape)),
        "ctxtans": (lambda b: core.ctxtans_encode(view(b), tans_model, code, *b.shape),
                    lambda c, o: core.ctxtans_decode(c, view(o), tans_model, code, *o.shape)),
    }
    rows = []
    for name, (encode, decode) in codecs.items():
        if args.codec and name not in args.codec:
            continue
        enc_s = dec_s = float("inf")
        for _ in range(args.repeat):
            start = time.process_time()
            chunks = [encode(b) for b in blocks]
            enc_s = min(enc_s, time.process_time() - start)
            start = time.process_time()
            status = [decode(c, o) for c, o in zip(chunks, outs)]
            dec_s = min(dec_s, time.process_time() - start)
        if any(status) or not all(np.array_equal(view(b), view(o)) for b, o in zip(blocks, outs)):
            sys.exit(f"{name}: decoded data differs")
        stored = sum(len(c) if isinstance(c, bytes) else c.nbytes for c in chunks)
        rows.append({"codec": name, "ratio": raw / stored, "encode_s_per_gb": enc_s / raw * 1e9,
                     "decode_s_per_gb": dec_s / raw * 1e9, "decode_gb_per_s": raw / dec_s / 1e9})
    print(f"{args.cache.name}, {len(blocks)} blocks of {CHUNK} tokens, dictionary {dictionary.id[:12]} ({args.dictionary.name})")
    print("| codec | ratio | encode CPU s/GB | decode CPU s/GB | decode GB/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['codec']} | {r['ratio']:.4f} | {r['encode_s_per_gb']:.2f} | {r['decode_s_per_gb']:.2f} | {r['decode_gb_per_s']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
