"""Which part of a prompt a store holds, keyed exactly as the writer of its entries keys them.

Two writers name entries after a prompt's tokens, and a lookup must derive the
same keys to find them:

``scheme="prefix"``  ``kvtool.store.keys.PrefixKeyer``: chained hashes of
    token chunks with the model, recipe and tenant salt (``put_prefix``,
    ``examples/agent_session.py``).
``scheme="vllm"``    the vLLM connector: vLLM's own prefix-cache block hashes
    (the salt is the request's ``cache_salt``) named through the connector's
    ``EntryNamer``, one key per tensor-parallel rank, found with the
    connector's own ``find_stored_prefix`` (``kvtool.entries.names``).

vLLM's block hash of a block is ``H((parent hash, token ids, extra keys))``
where the first block's parent is ``H(seed)`` and its extra keys hold the
cache salt. ``sha256_cbor`` and ``xxhash_cbor`` serialise that tuple as
canonical CBOR, which any process can reproduce; vLLM's ``sha256`` and
``xxhash`` serialise it with Python's pickle, which kvtool does not use, so
those are only available where the lookup runs inside vLLM and vLLM computes
them (``BlockHasher(hash_fn=...)``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence, TypeVar

import xxhash

from kvtool.errors import UnavailableError, UsageError
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.store import PrefixKeyer, Store
from kvtool.entries.names import EntryNamer, blocks_per_entry, find_stored_prefix, tokens_in

SCHEMES = ("prefix", "vllm")
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed for cryptographic hashes when PYTHONHASHSEED is unset
MAX_TOKENS = 1 << 20

T = TypeVar("T")


@dataclass
class PrefixQuery:
    """A prompt and what its entries are keyed by; a field left None takes the server's default.

    ``tokens``: the prompt's token ids. ``model``, ``recipe``, ``salt``,
    ``chunk_tokens``: as the writer keyed them (for vLLM: the connector's
    ``model_id``, ``recipe``, ``chunk_tokens`` and the request's
    ``cache_salt``). ``scheme``: ``prefix`` or ``vllm``. vLLM only:
    ``block_size``, ``kv_dtype`` (as the connector names it, e.g.
    ``torch.bfloat16``), ``tp_size``, ``hash_algo`` (vLLM's
    ``prefix_caching_hash_algo``) and ``hash_seed`` (PYTHONHASHSEED of the
    vLLM server, if it sets one).
    """

    tokens: list[int]
    model: str | None = None
    salt: str | None = None
    recipe: str | None = None
    chunk_tokens: int | None = None
    scheme: str | None = None
    block_size: int | None = None
    kv_dtype: str | None = None
    tp_size: int | None = None
    hash_algo: str | None = None
    hash_seed: str | None = None

    def with_defaults(self, defaults: dict[str, Any]) -> "PrefixQuery":
        """Fill fields left None from ``defaults``, then from kvtool's own defaults."""
        own = {"salt": "", "recipe": DEFAULT_RECIPE, "chunk_tokens": 256, "scheme": "prefix", "tp_size": 1,
               "hash_algo": "sha256_cbor", "hash_seed": VLLM_DEFAULT_SEED}
        filled = {name: value for name, value in {**own, **defaults}.items()
                  if name in self.__dataclass_fields__ and getattr(self, name) is None}
        query = replace(self, **filled)
        query.check()
        return query

    def check(self) -> None:
        if len(self.tokens) > MAX_TOKENS:
            raise UsageError(f"a lookup takes at most {MAX_TOKENS} tokens, not {len(self.tokens)}")
        if self.tokens and not 0 <= min(self.tokens) <= max(self.tokens) <= 0xFFFFFFFF:
            raise UsageError("token ids must lie in 0 .. 2**32-1")
        if not self.model:
            raise UsageError("a lookup needs the model id its entries were keyed with ('model')")
        if self.scheme not in SCHEMES:
            raise UsageError(f"unknown key scheme {self.scheme!r}; schemes: {', '.join(SCHEMES)}")
        for name in ("chunk_tokens", "tp_size") + (("block_size",) if self.scheme == "vllm" else ()):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UsageError(f"{name} must be a positive integer, not {value!r}")
        if self.scheme == "vllm" and not self.kv_dtype:
            raise UsageError("a vllm lookup needs the KV cache dtype the connector keys with ('kv_dtype')")


@dataclass
class StoredChunk:
    """One stored piece of the prompt: its keys (one per tensor-parallel rank), tokens and tiers."""

    keys: list[str]
    tokens: int
    tiers: list[str | None]


@dataclass
class LookupResult:
    """How many of the prompt's tokens are stored, chunk by chunk and per tier (the slowest of a chunk's keys)."""

    tokens: int
    stored_tokens: int
    chunks: list[StoredChunk] = field(default_factory=list)
    tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def keys(self) -> list[str]:
        return [key for chunk in self.chunks for key in chunk.keys]


class BlockHasher:
    """vLLM's prefix-cache block hashes of a prompt, computed as vLLM computes them.

    ``hash_fn`` is vLLM's own hash function where the lookup runs inside vLLM,
    and ``none_hash`` then reads vLLM's ``NONE_HASH`` (vLLM sets it after the
    connector starts, so it is read at the first lookup). Without them,
    ``algo`` must be one of the CBOR-based algorithms, reproduced here with the
    CBOR library vLLM uses, and the first block's parent is ``H(seed)``.
    """

    def __init__(self, algo: str = "sha256_cbor", seed: str = VLLM_DEFAULT_SEED,
                 hash_fn: Callable[[Any], bytes] | None = None, none_hash: Callable[[], bytes] | None = None) -> None:
        self.algo = algo
        self._hash = hash_fn or _cbor_hash(algo)
        self._none_hash = none_hash or (lambda: self._hash(seed))

    def hashes(self, tokens: Sequence[int], block_size: int, salt: str) -> list[bytes]:
        """One hash per full block of ``tokens``, chained over the prefix."""
        parent = self._none_hash()
        out = []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            extra = (("cache_salt", salt),) if start == 0 and salt else None
            parent = self._hash((parent, tuple(tokens[start:start + block_size]), extra))
            out.append(parent)
        return out


def lookup_prefix(store: Store, query: PrefixQuery, hasher: BlockHasher | None = None) -> LookupResult:
    """The longest stored prefix of ``query.tokens`` in ``store`` (``query`` with its defaults filled)."""
    if query.scheme == "vllm":
        chunks = _vllm_chunks(store, query, hasher)
    else:
        keyer = PrefixKeyer(_filled(query.model, "model"), _filled(query.recipe, "recipe"), _filled(query.salt, "salt"),
                            _filled(query.chunk_tokens, "chunk_tokens"))
        keys = keyer.keys(query.tokens)
        present = store.contains_many(keys)
        run = present.index(False) if False in present else len(keys)
        chunks = [([key], n) for key, n in zip(keys[:run], keyer.chunk_lengths(len(query.tokens)))]
    result = LookupResult(len(query.tokens), 0)
    for keys, tokens in chunks:
        tiers = [_tier_of(store, key) for key in keys]
        found = [tier for tier in tiers if tier is not None]
        if len(found) < len(tiers):  # gone since it was found: the stored prefix ends here
            break
        result.chunks.append(StoredChunk(keys, tokens, tiers))
        result.stored_tokens += tokens
        slowest = max(found, key=lambda name: _tier_rank(store, name))
        result.tokens_by_tier[slowest] = result.tokens_by_tier.get(slowest, 0) + tokens
    return result


def _vllm_chunks(store: Store, query: PrefixQuery, hasher: BlockHasher | None) -> list[tuple[list[str], int]]:
    hash_algo = _filled(query.hash_algo, "hash_algo")
    if hasher is None or hasher.algo != hash_algo:
        hasher = BlockHasher(hash_algo, _filled(query.hash_seed, "hash_seed"))
    block_size = _filled(query.block_size, "block_size")
    namer = EntryNamer(_filled(query.model, "model"), Recipe.parse(_filled(query.recipe, "recipe")).spec(),
                       _filled(query.kv_dtype, "kv_dtype"), block_size, _filled(query.tp_size, "tp_size"))
    hashes = hasher.hashes(query.tokens, block_size, _filled(query.salt, "salt"))
    per_entry = blocks_per_entry(_filled(query.chunk_tokens, "chunk_tokens"), block_size)
    spans = find_stored_prefix(hashes, len(hashes), per_entry, namer, store.contains_many, tokens_in(store))
    return [(namer.keys(span.entry_id), span.num_blocks * block_size) for span in spans]


def _filled(value: T | None, name: str) -> T:
    """A query field that ``PrefixQuery.with_defaults`` fills; None means the query skipped it."""
    if value is None:
        raise UsageError(f"a lookup needs {name!r}: fill the query's defaults (PrefixQuery.with_defaults) first")
    return value


def _tier_of(store: Store, key: str) -> str | None:
    return store.tier_of(key)


def _tier_rank(store: Store, name: str) -> int:
    return store.tier_names.index(name)


def _cbor_hash(algo: str) -> Callable[[Any], bytes]:
    digests: dict[str, Callable[[bytes], bytes]] = {
        "sha256_cbor": lambda data: hashlib.sha256(data).digest(),
        "xxhash_cbor": lambda data: xxhash.xxh3_128_digest(data),
    }
    if algo not in digests:
        raise UsageError(
            f"block hash {algo!r} cannot be computed outside vLLM (it pickles Python objects); start vLLM with "
            f"--prefix-caching-hash-algo sha256_cbor, or run the API inside the vLLM server "
            f"(kv_connector_extra_config 'api'); reproducible here: {', '.join(digests)}"
        )
    try:
        import cbor2
    except ImportError:
        raise UnavailableError("vLLM block hashes need the cbor2 package: pip install 'kvtool[api]'") from None
    digest = digests[algo]
    return lambda obj: digest(cbor2.dumps(obj, canonical=True))
