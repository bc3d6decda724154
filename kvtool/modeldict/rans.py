"""The interleaved rANS coder that the dictionary coders share, in plain Python: their reference.

``ctxans`` and the ``pca`` stage code their symbols with it, each with its own
models, precision and number of states. States are 32-bit, in ``[2**16, 2**32)``,
renormalised 16 bits at a time; symbol ``i`` of a stream is coded by state
``i % states`` with the frequencies (``freq``, summing to ``2**prob_bits``) and
exclusive prefix sums (``cum``) of its model. The stream is the final states
(u32 each, state 0 first), then the 16-bit words in the order the decoder reads
them. The C core implements the same steps.
"""

from __future__ import annotations

import bisect
import struct
from typing import Sequence

import numpy as np

from kvtool.errors import DecodeError

LOW = 1 << 16


def encode(syms: Sequence[int], models: Sequence[int], freq: list[list[int]], cum: list[list[int]], prob_bits: int,
           states: int) -> bytes:
    """The stream of ``syms``, symbol ``i`` coded with model ``models[i]`` (rows of ``freq`` and ``cum``)."""
    x_of = [LOW] * states
    words: list[int] = []
    for i in range(len(syms) - 1, -1, -1):
        s, m = syms[i], models[i]
        f, c = freq[m][s], cum[m][s]
        x = x_of[i % states]
        if x >= f << (32 - prob_bits):
            words.append(x & 0xFFFF)
            x >>= 16
        x_of[i % states] = (x // f << prob_bits) + x % f + c
    words.reverse()
    return struct.pack(f"<{states}I", *x_of) + np.array(words, "<u2").tobytes()


class Decoder:
    """Reads a stream symbol by symbol; ``DecodeError`` (naming ``what``) where it is malformed."""

    def __init__(self, data: bytes, freq: list[list[int]], cum: list[list[int]], prob_bits: int, states: int, what: str):
        if len(data) < 4 * states or len(data) % 2:
            raise DecodeError(f"{what}: truncated entropy-coded stream")
        self.states = list(struct.unpack_from(f"<{states}I", data))
        self.words = np.frombuffer(data, "<u2", offset=4 * states).tolist()
        self.pos = self.i = 0
        self.freq, self.cum, self.prob_bits, self.what = freq, cum, prob_bits, what

    def next(self, model: int) -> int:
        j = self.i % len(self.states)
        self.i += 1
        x = self.states[j]
        slot = x & ((1 << self.prob_bits) - 1)
        cum = self.cum[model]
        s = bisect.bisect_right(cum, slot) - 1
        x = self.freq[model][s] * (x >> self.prob_bits) + slot - cum[s]
        if x < LOW:
            if self.pos == len(self.words):
                raise DecodeError(f"{self.what}: the entropy-coded stream ends early")
            x = x << 16 | self.words[self.pos]
            self.pos += 1
        self.states[j] = x
        return s

    def finish(self) -> None:
        if self.pos != len(self.words) or any(x != LOW for x in self.states):
            raise DecodeError(f"{self.what}: the entropy-coded stream does not end where its symbols do")
