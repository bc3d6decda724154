"""The symbols the ``pca`` stage codes its quantized coefficients as, and the choice of a table for each component.

A coefficient ``q`` (an integer, ``|q| <= MAX_Q``) is one of ``SYMBOLS`` symbols and
some extra bits. 0 is symbol 0. Otherwise, with ``m = |q| - 1``: below 4 its
magnitude class is ``m`` and no extra bits follow; else, with ``e = floor(log2 m)``
and ``h`` the bit below its top bit, its class is ``4 + 2 (e - 2) + h`` and its
``e - 1`` low bits are the extra bits. The symbol is ``1 + 2 * class + (q < 0)``:
1..60, the last three symbols never occur. A transform dictionary
(``kvtool.modeldict.basis``) holds tables of these symbols, narrow to wide; each
component of a block is coded with one of them, or with none where all its
coefficients are 0 (class 0).
"""

from __future__ import annotations

import functools

import numpy as np

from kvtool.modeldict.format import COST_UNIT, PROB_BITS as COST_BITS, cost_of

SYMBOLS = 64
MAX_Q = (1 << 15) - 1
#: The largest symbol that occurs: the class of ``MAX_Q`` is 29.
MAX_SYMBOL = 60


@functools.lru_cache(maxsize=1)
def _classes() -> tuple[np.ndarray, np.ndarray]:
    """The magnitude class and extra bits of every ``m = |q| - 1`` from 0 to ``MAX_Q - 1``."""
    m = np.arange(MAX_Q, dtype=np.int64)
    e = np.frexp(np.maximum(m, 1))[1].astype(np.int64) - 1  # floor(log2 m), exactly
    big = m >= 4
    h = np.where(big, (m >> np.maximum(e - 1, 0)) & 1, 0)
    return np.where(big, 4 + 2 * (e - 2) + h, m).astype(np.int64), np.where(big, e - 1, 0).astype(np.int64)


def symbols(q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(symbol, extra bits, extra value)`` of each ``q`` (int64, ``|q| <= MAX_Q``)."""
    cls_of, bits_of = _classes()
    m = np.abs(q) - 1
    index = np.maximum(m, 0)
    zero = q == 0
    nbits = np.where(zero, 0, bits_of[index])
    sym = np.where(zero, 0, 1 + 2 * cls_of[index] + (q < 0))
    return sym, nbits, np.where(zero, 0, index & ((1 << nbits) - 1))


def magnitude(sym: int) -> tuple[int, int, bool]:
    """``(|q| - 1 without its extra bits, extra bits, negative)`` of a symbol other than 0."""
    cls, negative = (sym - 1) >> 1, bool((sym - 1) & 1)
    if cls < 4:
        return cls, 0, negative
    e = ((cls - 4) >> 1) + 2
    return (2 + ((cls - 4) & 1)) << (e - 1), e - 1, negative


def costs(freq: np.ndarray, prob_bits: int) -> np.ndarray:
    """int64: the cost of each symbol of frequency tables summing to ``2**prob_bits``, in 1/8 bits, rounded
    (``round(8 * (prob_bits - log2 f))``, exact whatever the machine's ``log2``: see ``cost_of``)."""
    return cost_of(freq) - COST_UNIT * (COST_BITS - prob_bits)


def choose_classes(sym: np.ndarray, table_costs: np.ndarray, class_costs: np.ndarray) -> np.ndarray:
    """Each component's class for symbols ``[tokens, components]``: 0 where all are 0, else the table (1..C) whose
    cost of them plus the class's own cost (``class_costs[k]``) is least, the lowest on a tie.
    ``table_costs`` is ``[C, SYMBOLS]``."""
    components = sym.shape[1]
    index = (np.arange(components)[None, :] * SYMBOLS + sym).reshape(-1)
    counts = np.bincount(index, minlength=components * SYMBOLS).reshape(components, SYMBOLS)
    total = counts @ table_costs.T + class_costs[1:]
    return np.where(counts[:, 1:].any(axis=1), np.argmin(total, axis=1) + 1, 0)
