"""``exphuff-lanes``: exphuff's values and code, its symbols in many independent lane streams.

Version 2 of the exphuff chunk: the same channel references, code table and
raw sign and mantissa bits, but the symbols are dealt round-robin to one bit
stream per ``lane`` symbols (512 by default) with a table of their lengths, so
a GPU decodes thousands of lanes at once (``kvtool.gpu``), each thread writing
next to its neighbours. It costs about 0.3% of ratio against ``exphuff`` at 512
symbols per lane and takes 1.5-3x exphuff's CPU time to decode on a CPU core
(one table lookup per symbol), so it is an opt-in recipe for GPU restores
(``--recipe exphuff-lanes``, ``exphuff-lanes:256`` for more lanes).

The C core writes and reads it; ``kvtool._native.lanes_reference`` is the
numpy reference, and docs/FORMAT.md the specification.
"""

from __future__ import annotations

import numpy as np

from kvtool import gpu
from kvtool._native import lanes_reference
from kvtool.codecs.exphuff import ExpHuffCodec
from kvtool.errors import UsageError


class ExpHuffLanesCodec(ExpHuffCodec):
    codec_id = "exphuff-lanes"
    params = ("lane",)
    spec_param = "lane"
    chunk_version = lanes_reference.VERSION
    gpu_decodes = True

    def __init__(self, lane: int = lanes_reference.DEFAULT_LANE):
        lo, hi = lanes_reference.MIN_LANE, lanes_reference.MAX_LANE
        if isinstance(lane, bool) or not isinstance(lane, int) or not lo <= lane <= hi:
            raise UsageError(f"exphuff-lanes: lane must be {lo}..{hi} symbols, not {lane!r}")
        self.lane = lane

    @classmethod
    def details(cls) -> dict[str, object]:
        """The GPU path, for ``kvtool codecs`` (asked only there: it imports torch and Triton where installed)."""
        ok, how = gpu.status()
        return {"gpu": ok, "gpu_reason": "" if ok else how, "gpu_implementation": how if ok else ""}

    @classmethod
    def spec_value(cls, arg: str) -> int:
        try:
            return int(arg)
        except ValueError:
            raise UsageError(f"codec 'exphuff-lanes': lane must be an integer, not {arg!r}") from None

    def _encode_args(self) -> tuple[int, ...]:
        return (self.lane,)

    def _lane(self) -> int:
        return self.lane

    def _reference_encode(self, block: np.ndarray, name: str) -> bytes:
        return lanes_reference.encode(block, name, self.lane)

    def _reference_decode(self, chunk: memoryview, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return lanes_reference.decode(chunk, name, shape)
