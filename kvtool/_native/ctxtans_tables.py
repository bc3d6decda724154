"""The tANS tables of the ``ctxtans`` codec, derived from a model dictionary once, in one place.

A dictionary's models have 15-bit frequencies; a tANS decoder needs one table
of ``2**TABLE_LOG`` states per model, so every model is first brought to
``TABLE_LOG`` bits (``quantize``), then its symbols are spread over the table
as FSE spreads them (``spread``). Both coders of the format, the numpy
reference and the C core, take these arrays as they are (the core is handed
them as bytes): the derivation is part of the format and exists only here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.modeldict.format import COST_UNIT, SYMBOLS, CoderTables

#: States per model table: 2**11. At 12 bits ratio rises by 0.05% and the tables no longer fit
#: a core's L2 cache; at 10 it falls by 0.2%.
TABLE_LOG = 11
TABLE_SIZE = 1 << TABLE_LOG
#: FSE's spread step: odd, so stepping by it visits every slot once.
STEP = (TABLE_SIZE >> 1) + (TABLE_SIZE >> 3) + 3


def quantize(freq: np.ndarray) -> np.ndarray:
    """15-bit frequencies ``[models, 64]`` brought to TABLE_LOG bits: int64, each row summing to TABLE_SIZE.

    A symbol of frequency 0 keeps 0; any other gets ``max(1, round(f / 16))`` (halves up); then
    the row's largest frequency (the lowest symbol on a tie) takes or gives one unit at a time
    until the row sums to TABLE_SIZE.
    """
    f = np.asarray(freq, np.int64)
    shift = 15 - TABLE_LOG
    g = np.where(f > 0, np.maximum(1, (f + (1 << (shift - 1))) >> shift), 0)
    for row in g:
        while (diff := TABLE_SIZE - int(row.sum())) != 0:
            row[int(np.argmax(row))] += 1 if diff > 0 else -1
    return g


def spread(g: np.ndarray) -> np.ndarray:
    """The symbol of every state ``[models, TABLE_SIZE]``: symbol 0's ``g[0]`` slots first, then symbol 1's, ...,
    the k-th of them at slot ``k * STEP mod TABLE_SIZE``."""
    slots = (np.arange(TABLE_SIZE, dtype=np.int64) * STEP) % TABLE_SIZE
    table = np.empty(g.shape[:1] + (TABLE_SIZE,), np.int64)
    for m, row in enumerate(g):
        table[m, slots] = np.repeat(np.arange(SYMBOLS), row)
    return table


@dataclass(frozen=True)
class TansTables:
    """What both coders use. Per model ``m`` and state ``u`` (``TABLE_SIZE`` states):

    ``symbol[m, u]``, ``nbits[m, u]`` and ``base[m, u]``: decoding state ``u`` gives that symbol and the
    next state ``base + (nbits bits read)``; ``encode[m, start[m, s] + r]`` is the state that codes
    symbol ``s`` from rank ``g[m, s] + r``; ``cost`` and ``class_cost`` as ``CoderTables``' but of
    the quantized models (the encoder's choice of class).
    """

    g: np.ndarray  # int64 [models, 64]
    start: np.ndarray  # int64 [models, 64]: exclusive prefix sums of g
    symbol: np.ndarray  # int64 [models, TABLE_SIZE]
    nbits: np.ndarray
    base: np.ndarray
    encode: np.ndarray  # int64 [models, TABLE_SIZE]
    cost: np.ndarray  # int32 [contexts * 64, classes]
    class_cost: np.ndarray  # int32 [classes]
    coder: CoderTables

    @classmethod
    def of(cls, t: CoderTables) -> "TansTables":
        g = quantize(t.freq)
        start = np.cumsum(g, axis=1) - g
        symbol = spread(g)
        models = g.shape[0]
        order = np.argsort(symbol, axis=1, kind="stable")  # each symbol's states, in increasing state order
        rank = np.empty_like(symbol)
        rows = np.arange(models)[:, None]
        # the k-th state of symbol s (in increasing order) has rank g[s] + k
        rank[rows, order] = np.arange(TABLE_SIZE)[None, :] - np.take_along_axis(start, symbol, axis=1)[rows, order] \
            + np.take_along_axis(g, symbol, axis=1)[rows, order]
        nbits = TABLE_LOG - np.floor(np.log2(rank)).astype(np.int64)
        base = (rank << nbits) - TABLE_SIZE
        encode = order  # encode[m, start[s] + k] = the k-th state of s
        n, x = t.classes, t.contexts
        cost = _cost(g[: n * x].reshape(n, x, SYMBOLS)).transpose(1, 2, 0).reshape(x * SYMBOLS, n)
        class_cost = _cost(g[n * x, :n])
        return cls(g, start, symbol, nbits, base, encode, np.ascontiguousarray(cost).astype(np.int32),
                   class_cost.astype(np.int32), t)


def _cost(g: np.ndarray) -> np.ndarray:
    """A symbol's cost in 1/COST_UNIT bits, ``round(COST_UNIT * (TABLE_LOG - log2 g))``; exact (see format.cost_of)."""
    bits = TABLE_LOG - np.log2(np.maximum(g, 1).astype(np.float64))
    cost: np.ndarray = np.floor(COST_UNIT * bits + 0.5).astype(np.int64)
    return cost
