"""The exphuff chunk format in numpy: the reference the C core must match bit for bit.

Used where the core is not built, and by the tests as the oracle: encoding a
block here and in C gives the same bytes, and both decode each other's chunks.
docs/FORMAT.md specifies the format; exphuff.c and huffman.c explain the why.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.errors import DecodeError

VERSION = 1
MODE_CODED, MODE_ONE_SYMBOL = 0, 1
MAXBITS = 10
STREAMS = 4


@dataclass(frozen=True)
class Family:
    """How a dtype's values split into a coded byte and raw bits."""

    width: int  # bytes per value
    raw_bytes: int  # raw bytes per value
    emask: int  # the exponent field within the coded byte
    eshift: int


FAMILIES = {
    "bf16": Family(2, 1, 0xFF, 0),
    "fp16": Family(2, 1, 0xF8, 3),
    "fp32": Family(4, 3, 0xFF, 0),
    "fp8_e4m3": Family(1, 0, 0x78, 3),
    "fp8_e5m2": Family(1, 0, 0x7C, 2),
}


# -- Huffman --------------------------------------------------------------------------------


def huffman_lengths(count: np.ndarray) -> np.ndarray:
    """Code lengths (0 = unused) for 256 symbol counts, exactly as kvn_huf_lengths computes them."""
    counts = [int(c) for c in count]
    length = np.zeros(256, np.uint8)
    leaves = sorted((c, s) for s, c in enumerate(counts) if c)  # by count, then symbol
    n = len(leaves)
    if n == 0:
        return length
    if n == 1:
        length[leaves[0][1]] = 1
        return length
    weight = [0] * (n - 1)
    leaf_parent, node_parent = [0] * n, [0] * (n - 1)
    next_leaf = next_node = 0
    for k in range(n - 1):
        w = 0
        for _ in range(2):
            if next_leaf < n and (next_node >= k or leaves[next_leaf][0] <= weight[next_node]):
                w += leaves[next_leaf][0]
                leaf_parent[next_leaf] = k
                next_leaf += 1
            else:
                w += weight[next_node]
                node_parent[next_node] = k
                next_node += 1
        weight[k] = w
    depth = [0] * (n - 1)
    for k in range(n - 3, -1, -1):
        depth[k] = depth[node_parent[k]] + 1
    bl_count = [0] * (max(n, MAXBITS) + 1)
    for i in range(n):
        bl_count[depth[leaf_parent[i]] + 1] += 1
    maxlen = max(i for i, c in enumerate(bl_count) if c)
    for i in range(maxlen, MAXBITS, -1):  # JPEG's adjustment (Annex K.3)
        while bl_count[i] > 0:
            j = i - 2
            while bl_count[j] == 0:
                j -= 1
            bl_count[i] -= 2
            bl_count[i - 1] += 1
            bl_count[j + 1] += 2
            bl_count[j] -= 1
    i = 0
    for bits in range(MAXBITS, 0, -1):
        for _ in range(bl_count[bits]):
            length[leaves[i][1]] = bits
            i += 1
    return length


def canonical_codes(length: np.ndarray) -> np.ndarray:
    """Canonical codes, bit-reversed for an LSB-first stream."""
    bl_count = np.bincount(length, minlength=MAXBITS + 2)
    bl_count[0] = 0
    next_code, code = [0] * (MAXBITS + 2), 0
    for bits in range(1, MAXBITS + 1):
        code = (code + int(bl_count[bits - 1])) << 1
        next_code[bits] = code
    codes = np.zeros(256, np.uint32)
    for s in range(256):
        bits = int(length[s])
        if bits:
            c = next_code[bits]
            next_code[bits] += 1
            codes[s] = int(f"{c:0{bits}b}"[::-1], 2)
    return codes


def segments(n: int) -> list[tuple[int, int]]:
    """(start, count) of each stream's symbols."""
    seg = -(-n // STREAMS)
    out = []
    for k in range(STREAMS):
        start = min(k * seg, n)
        out.append((start, max(0, min(n, start + seg) - start)))
    return out


def _pack(sym: np.ndarray, codes: np.ndarray, length: np.ndarray) -> bytes:
    lens = length[sym].astype(np.int64)
    total = int(lens.sum())
    starts = np.cumsum(lens) - lens
    owner = np.repeat(np.arange(len(sym)), lens)
    offset = np.arange(total) - np.repeat(starts, lens)
    bits = ((codes[sym][owner] >> offset.astype(np.uint32)) & 1).astype(np.uint8)
    return np.packbits(bits, bitorder="little").tobytes()


def _unpack(stream: bytes, count: int, length: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """Decode ``count`` symbols; the stream must be used up to its last partial byte."""
    total = len(stream) * 8
    bits = np.unpackbits(np.frombuffer(stream, np.uint8), bitorder="little").astype(np.int64)
    padded = np.concatenate([bits, np.zeros(MAXBITS, np.int64)])
    # The MAXBITS-bit window starting at every bit position, then the symbol each begins with.
    windows = np.zeros(total + 1, np.int64)
    for j in range(MAXBITS):
        windows |= padded[j : j + total + 1] << j
    table_sym = np.zeros(1 << MAXBITS, np.int64)
    table_len = np.zeros(1 << MAXBITS, np.int64)
    for s in np.flatnonzero(length):
        step = 1 << int(length[s])
        table_sym[int(codes[s]) :: step] = s
        table_len[int(codes[s]) :: step] = length[s]
    sym_at, len_at = table_sym[windows].tolist(), table_len[windows].tolist()
    out = np.empty(count, np.uint8)
    pos = 0
    for i in range(count):
        if pos > total:
            raise DecodeError("exphuff: a stream ends before its symbols")
        out[i] = sym_at[pos]
        pos += len_at[pos]
    if pos > total or total - pos >= 8:
        raise DecodeError("exphuff: a stream's length does not match its symbols")
    return out


# -- splitting values -----------------------------------------------------------------------


def _fields(block: np.ndarray, family: Family) -> tuple[np.ndarray, np.ndarray]:
    """The coded bytes (the block's shape) and the raw plane (bytes, C order) of a block."""
    bits = block.view(f"u{family.width}")
    if family.width == 2:
        coded = (bits >> 7).astype(np.uint8)
        raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).astype(np.uint8).reshape(-1)
    elif family.width == 4:
        coded = (bits >> 23).astype(np.uint8)
        low = (((bits >> 8) & 0x800000) | (bits & 0x7FFFFF)).astype("<u4").reshape(-1, 1)
        raw = low.view(np.uint8)[:, :3].reshape(-1)
    else:
        coded = bits.astype(np.uint8)
        raw = np.zeros(0, np.uint8)
    return coded, raw


def _rebuild(coded: np.ndarray, raw: np.ndarray, family: Family) -> np.ndarray:
    if family.width == 2:
        raw16 = raw.reshape(coded.shape).astype(np.uint16)
        return ((raw16 & 0x80) << 8) | (coded.astype(np.uint16) << 7) | (raw16 & 0x7F)
    if family.width == 4:
        triples = raw.reshape(-1, 3).astype(np.uint32)
        low = (triples[:, 0] | triples[:, 1] << 8 | triples[:, 2] << 16).reshape(coded.shape)
        return ((low & 0x800000) << 8) | (coded.astype(np.uint32) << 23) | (low & 0x7FFFFF)
    return coded


def split_symbols(block: np.ndarray, family: Family) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A block's channel references, raw plane and symbols (C order): what every exphuff version codes."""
    heads, tokens, dim = block.shape
    coded, raw = _fields(block, family)
    exps = (coded & family.emask) >> family.eshift
    if tokens:
        refs = (exps.sum(axis=1, dtype=np.uint64) // tokens).astype(np.uint8)
    else:
        refs = np.zeros((heads, dim), np.uint8)
    shifted = (refs << family.eshift).astype(np.uint8)[:, None, :]
    keep = np.uint8(~family.emask & 0xFF)
    sym = ((coded & keep) | ((coded - shifted) & np.uint8(family.emask))).reshape(-1)
    return refs, raw, sym


def write_code_table(length: np.ndarray) -> bytes:
    """The used-symbol bitmap and the 4-bit code lengths of a code of >= 2 symbols."""
    used = np.flatnonzero(length)
    bitmap = np.zeros(256, np.uint8)
    bitmap[used] = 1
    nibbles = length[used]
    if len(nibbles) % 2:
        nibbles = np.append(nibbles, 0)
    table: bytes = np.packbits(bitmap, bitorder="little").tobytes() + (nibbles[0::2] | nibbles[1::2] << 4).astype(np.uint8).tobytes()
    return table


def encode(block: np.ndarray, dtype_name: str) -> bytes:
    """The exphuff chunk of a block ``[heads, tokens, dim]`` (any strides)."""
    family = FAMILIES[dtype_name]
    refs, raw, sym = split_symbols(block, family)
    length = huffman_lengths(np.bincount(sym, minlength=256))
    head = bytes([VERSION]) + refs.tobytes() + raw.tobytes()
    if np.count_nonzero(length) <= 1:
        return head[:1] + bytes([MODE_ONE_SYMBOL]) + head[1:] + bytes([int(sym[0]) if sym.size else 0])
    codes = canonical_codes(length)
    streams = [_pack(sym[start : start + count], codes, length) for start, count in segments(sym.size)]
    sizes = np.array([len(s) for s in streams], "<u4").tobytes()
    return head[:1] + bytes([MODE_CODED]) + head[1:] + write_code_table(length) + sizes + b"".join(streams)


def decode(chunk: bytes | memoryview, dtype_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The block an exphuff chunk holds, as unsigned integers of the dtype's width; ``DecodeError`` if malformed."""
    frame = ChunkFrame.read(chunk, dtype_name, shape, VERSION, "exphuff")
    sym = frame.one_symbol_run() if frame.one_symbol else _decode_symbols(frame.data[frame.fixed:], frame.n)
    return frame.values(sym)


@dataclass(frozen=True)
class ChunkFrame:
    """What every exphuff version's chunk starts with: version, mode, channel references, the raw plane.

    Versions differ only in how the symbols that follow are laid out (``fixed`` is where they begin).
    """

    family: Family
    shape: tuple[int, ...]
    data: bytes
    codec: str
    n: int
    fixed: int
    refs: np.ndarray
    raw: np.ndarray

    @classmethod
    def read(cls, chunk: bytes | memoryview, dtype_name: str, shape: tuple[int, ...], version: int, codec: str) -> ChunkFrame:
        family = FAMILIES[dtype_name]
        heads, tokens, dim = shape
        n, channels = heads * tokens * dim, heads * dim
        data = bytes(chunk)
        fixed = 2 + channels + n * family.raw_bytes
        if len(data) < fixed + 1 or data[0] != version or data[1] not in (MODE_CODED, MODE_ONE_SYMBOL):
            raise DecodeError(f"{codec}: not a chunk of this format, or truncated")
        refs = np.frombuffer(data, np.uint8, channels, 2)
        if np.any(refs > family.emask >> family.eshift):
            raise DecodeError(f"{codec}: a channel reference is out of range")
        raw = np.frombuffer(data, np.uint8, n * family.raw_bytes, 2 + channels)
        return cls(family, shape, data, codec, n, fixed, refs, raw)

    @property
    def one_symbol(self) -> bool:
        return self.data[1] == MODE_ONE_SYMBOL

    def one_symbol_run(self) -> np.ndarray:
        """The symbols of a one-symbol chunk: its last byte, ``n`` times."""
        if len(self.data) != self.fixed + 1:
            raise DecodeError(f"{self.codec}: bad length for a one-symbol chunk")
        return np.full(self.n, self.data[self.fixed], np.uint8)

    def values(self, sym: np.ndarray) -> np.ndarray:
        return merge_symbols(sym, self.refs, self.raw, self.family, self.shape)


def merge_symbols(sym: np.ndarray, refs: np.ndarray, raw: np.ndarray, family: Family, shape: tuple[int, ...]) -> np.ndarray:
    """The values (unsigned integers of the dtype's width) that symbols, references and raw bits stand for."""
    heads, _, dim = shape
    shifted = (refs.reshape(heads, 1, dim) << family.eshift).astype(np.uint8)
    sym = sym.reshape(shape)
    keep = np.uint8(~family.emask & 0xFF)
    coded = (sym & keep) | ((sym + shifted) & np.uint8(family.emask))
    return _rebuild(coded, raw, family)


def read_code_table(data: bytes, at: int, name: str = "exphuff") -> tuple[np.ndarray, int]:
    """The code lengths of the table at ``data[at:]``, checked to form a complete code, and where the table ends."""
    if len(data) < at + 32:
        raise DecodeError(f"{name}: truncated code table")
    used = np.flatnonzero(np.unpackbits(np.frombuffer(data, np.uint8, 32, at), bitorder="little"))
    table_len = (len(used) + 1) // 2
    if len(used) < 2 or len(data) < at + 32 + table_len:
        raise DecodeError(f"{name}: bad code table")
    packed = np.frombuffer(data, np.uint8, table_len, at + 32)
    nibbles = np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)
    if len(used) % 2 and nibbles[-1]:
        raise DecodeError(f"{name}: bad code table padding")
    length = np.zeros(256, np.uint8)
    length[used] = nibbles[: len(used)]
    kraft = sum(1 << (MAXBITS - int(b)) for b in length[used] if 1 <= b <= MAXBITS)
    if np.any(length[used] == 0) or np.any(length > MAXBITS) or kraft != 1 << MAXBITS:
        raise DecodeError(f"{name}: the code lengths do not form a complete code")
    return length, at + 32 + table_len


def _decode_symbols(rest: bytes, n: int) -> np.ndarray:
    length, at = read_code_table(rest, 0)
    if len(rest) < at + 4 * STREAMS:
        raise DecodeError("exphuff: bad code table")
    sizes = np.frombuffer(rest, "<u4", STREAMS, at).astype(np.int64)
    at += 4 * STREAMS
    if int(sizes.sum()) != len(rest) - at:
        raise DecodeError("exphuff: stream lengths do not add up to the chunk")
    codes = canonical_codes(length)
    out = np.empty(n, np.uint8)
    for (start, count), size in zip(segments(n), sizes):
        out[start : start + count] = _unpack(rest[at : at + int(size)], count, length, codes)
        at += int(size)
    return out
