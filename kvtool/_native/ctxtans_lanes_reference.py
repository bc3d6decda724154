"""ctxtans chunk version 3 in plain Python: its rANS stream of 64 lanes.

Each head's channels (in class order) go in groups of ``LANES``; a channel's place in its
group is its lane, and each lane has its own rANS state, so the 64 states of a group step
through their channels' tokens side by side: the lanes of SIMD registers. A *step* decodes
one symbol in each of some lanes (a group's coded channels at one token; or one side
information symbol), then refills in two rounds: each of those lanes whose state is below
``RANS_LOW`` takes the stream's next byte, in lane order, then each still below takes
another. The models are the dictionary's, brought to 11 bits as for tANS
(``ctxtans_tables.quantize``). The states start from the raw plane's last bits
(``HELD_BITS``) instead of from a constant, so the decoder's final states give them back.
docs/FORMAT.md specifies the bytes; ``ctxtans_reference`` the rest of the chunk.
"""

from __future__ import annotations

import bisect
import struct

import numpy as np

from kvtool._native.ctxtans_tables import TABLE_LOG
from kvtool.errors import DecodeError

#: States a stream has: one per lane of a group.
LANES = 64
#: States lie in [RANS_LOW, 2**31); the stream refills them a byte at a time.
RANS_LOW = 1 << 23
RANS_HIGH = 1 << 31
#: Each state starts from (and ends at) HELD_START plus HELD_PER_STATE bits of the raw plane.
HELD_PER_STATE = 30
HELD_START = 1 << HELD_PER_STATE
HELD_BITS = LANES * HELD_PER_STATE
STATES = struct.Struct(f"<{LANES}I")

__all__ = ["Decoder", "encode", "groups", "initial_states"]


def groups(channels: int, dim: int) -> list[range]:
    """The groups of places of the coding order: each head's ``LANES`` at a time (a head's last may be smaller)."""
    return [range(h + g, min(h + g + LANES, h + dim)) for h in range(0, channels, dim) for g in range(0, dim, LANES)]


def initial_states(tail: np.ndarray) -> list[int]:
    """The states an encoder starts from: the raw plane's last bits ``tail`` (at most HELD_BITS, LSB first), state
    k holding bits ``30k .. 30k + 29``, the bits past the tail 0."""
    bits = np.zeros(HELD_BITS, np.int64)
    bits[: len(tail)] = tail
    states: list[int] = (HELD_START + (bits.reshape(LANES, HELD_PER_STATE) << np.arange(HELD_PER_STATE)).sum(axis=1)).tolist()
    return states


def encode(steps: list[range], syms: list[int], models: list[int], lanes: list[int], initial: list[int],
           g: list[list[int]], cum: list[list[int]]) -> bytes:
    """The stream of ``syms``, symbol ``i`` coded with model ``models[i]`` by the state of lane ``lanes[i]``, the states
    starting from ``initial``; ``steps`` cut the symbols into steps (in order, each its lanes in order). The stream
    is the final states, then the bytes, the first a decoder reads first."""
    x = list(initial)
    out: list[int] = []  # the bytes as written, last step first: a decoder reads them backwards
    limit = 31 - TABLE_LOG  # a state codes a symbol of frequency f only below f << limit
    for step in reversed(steps):
        first, second = [], []  # the lanes' refill bytes, as a decoder reads them
        for i in step:
            s, m, k = syms[i], models[i], lanes[i]
            f, v = g[m][s], x[k]
            taken = []
            while v >= f << limit:  # at most twice: v < 2**31 and f >= 1
                taken.append(v & 0xFF)
                v >>= 8
            if taken:
                first.append(taken[-1])
                second += taken[:-1]
            x[k] = (v // f << TABLE_LOG) + v % f + cum[m][s]
        out += second[::-1] + first[::-1]
    return STATES.pack(*x) + bytes(out[::-1])


class Decoder:
    """Reads a stream: the states, then bytes for the states a step leaves below RANS_LOW."""

    def __init__(self, data: bytes, g: list[list[int]], cum: list[list[int]]):
        if len(data) < STATES.size:
            raise DecodeError("ctxtans: truncated entropy-coded stream")
        self.x = list(STATES.unpack_from(data))
        if not all(RANS_LOW <= v < RANS_HIGH for v in self.x):
            raise DecodeError("ctxtans: a state of the stream is out of range")
        self.data, self.pos, self.g, self.cum, self.i = data, STATES.size, g, cum, 0

    def step(self, coded: list[tuple[int, int]]) -> list[int]:
        """The symbols of a step: one for each (model, lane) of ``coded``, in order."""
        syms, mask = [], (1 << TABLE_LOG) - 1
        for model, k in coded:
            v, cum = self.x[k], self.cum[model]
            slot = v & mask
            s = bisect.bisect_right(cum, slot) - 1  # the last symbol starting at or before the slot: none of frequency 0
            self.x[k] = self.g[model][s] * (v >> TABLE_LOG) + slot - cum[s]
            syms.append(s)
        for _ in range(2):
            for _, k in coded:
                if self.x[k] < RANS_LOW:
                    if self.pos == len(self.data):
                        raise DecodeError("ctxtans: the entropy-coded stream ends early")
                    self.x[k] = self.x[k] << 8 | self.data[self.pos]
                    self.pos += 1
        return syms

    def next(self, model: int) -> int:
        """The next side information symbol (a step of its own, with the next lane in turn)."""
        self.i += 1
        return self.step([(model, (self.i - 1) % LANES)])[0]

    def finish(self) -> None:
        if self.pos != len(self.data):
            raise DecodeError("ctxtans: the entropy-coded stream does not end where its symbols do")

    def held_bits(self, count: int) -> np.ndarray:
        """The first ``count`` raw bits the final states hold; the states must hold no other."""
        held = np.array(self.x, np.int64) - HELD_START
        if (held < 0).any() or (held >= HELD_START).any():
            raise DecodeError("ctxtans: a final state holds no raw bits")
        bits = ((held[:, None] >> np.arange(HELD_PER_STATE)) & 1).reshape(-1)
        if bits[count:].any():
            raise DecodeError("ctxtans: the final states hold more bits than the raw plane misses")
        return bits[:count]
