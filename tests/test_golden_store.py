"""Golden vectors for the store entry record and the prefix keys: what a store holds and how it is keyed
must not change unnoticed, since stores outlive the processes (and kvtool versions) that wrote them."""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import pytest
import xxhash

from kvtool.store.entry import CorruptEntryError, unwrap, wrap
from kvtool.store.keys import PrefixKeyer

sys.path.insert(0, str(Path(__file__).parent / "golden"))
from make_golden import ENTRY_INPUTS, PREFIX_INPUTS, STORE_VECTORS  # noqa: E402

VECTORS = json.loads(STORE_VECTORS.read_text())


def test_the_vectors_cover_the_inputs():
    assert [{k: v for k, v in e.items() if k != "record"} for e in VECTORS["entries"]] == ENTRY_INPUTS
    assert [{k: v for k, v in p.items() if k != "keys"} for p in VECTORS["prefix_keys"]] == PREFIX_INPUTS


@pytest.mark.parametrize("vector", VECTORS["entries"], ids=lambda v: v["key"][:12])
def test_entry_records_are_written_and_read_byte_for_byte(vector):
    record = bytes.fromhex(vector["record"])
    value = bytes.fromhex(vector["value"])
    assert wrap(vector["key"], value, vector["meta"]).record == record
    entry = unwrap(record, vector["key"])
    assert (entry.key, bytes(entry.value), entry.meta) == (vector["key"], value, vector["meta"])


@pytest.mark.parametrize("vector", VECTORS["entries"], ids=lambda v: v["key"][:12])
def test_entry_records_follow_the_documented_layout(vector):
    """The layout of kvtool.store.entry's docstring, decoded here without kvtool."""
    record = bytes.fromhex(vector["record"])
    magic, version, key_len, meta_len, value_len, checksum = struct.unpack_from("<4sBHIQQ", record)
    assert (magic, version, len(record)) == (b"KVSE", 1, 27 + key_len + meta_len + value_len)
    key = record[27 : 27 + key_len].decode("utf-8")
    meta = json.loads(record[27 + key_len : 27 + key_len + meta_len])
    assert (key, meta, record[27 + key_len + meta_len :].hex()) == (vector["key"], vector["meta"], vector["value"])
    assert checksum == xxhash.xxh3_64_intdigest(record[:19] + record[27:])


@pytest.mark.parametrize("vector", VECTORS["entries"], ids=lambda v: v["key"][:12])
def test_a_golden_record_changed_anywhere_is_refused(vector):
    record = bytes.fromhex(vector["record"])
    for pos in range(0, len(record), max(1, len(record) // 40)):
        damaged = bytearray(record)
        damaged[pos] ^= 0x01
        with pytest.raises(CorruptEntryError):
            unwrap(bytes(damaged), vector["key"])
    with pytest.raises(CorruptEntryError):
        unwrap(record[:-1], vector["key"])
    with pytest.raises(CorruptEntryError):
        unwrap(record, vector["key"] + "x")


@pytest.mark.parametrize("vector", VECTORS["prefix_keys"], ids=lambda v: f"{v['chunk_tokens']}x{len(v['tokens'])}")
def test_prefix_keys_are_derived_as_before(vector):
    keyer = PrefixKeyer(vector["model_id"], vector["recipe"], vector["salt"], vector["chunk_tokens"])
    assert keyer.keys(vector["tokens"]) == vector["keys"]


@pytest.mark.parametrize("vector", VECTORS["prefix_keys"], ids=lambda v: f"{v['chunk_tokens']}x{len(v['tokens'])}")
def test_prefix_keys_follow_the_documented_derivation(vector):
    """root = H(model, recipe, salt); hash_i = H(hash_{i-1}, tokens of chunk i), as kvtool.store.keys documents."""

    def field(data: bytes) -> bytes:
        return len(data).to_bytes(8, "little") + data

    def h(*parts: bytes) -> bytes:
        return hashlib.blake2b(b"".join(parts), digest_size=32, person=b"kvtool/prefix/1").digest()

    previous = h(*(field(text.encode()) for text in (vector["model_id"], vector["recipe"], vector["salt"])))
    keys = []
    step = vector["chunk_tokens"]
    for start in range(0, len(vector["tokens"]), step):
        chunk = b"".join(t.to_bytes(4, "little") for t in vector["tokens"][start : start + step])
        previous = h(previous, field(chunk))
        keys.append(previous.hex())
    assert keys == vector["keys"]
