"""The API inside a vLLM server, on the connector's live store.

The connector's scheduler side starts it when ``kv_connector_extra_config``
has an ``api`` object (options below). With vLLM's single-process executor the
scheduler and the worker share one store, so pins and prefetches act on the
memory tier the model restores from. Lookups need only token ids and the
request's ``cache_salt``: the model, recipe, chunk size, block size, KV dtype
and tensor-parallel size default to the connector's, and block hashes are
computed by vLLM's own hash function.

Options: ``listen`` (default ``127.0.0.1:8470``), ``token_file``,
``allow_remote``, ``tls_cert``, ``tls_key``, ``rate``, ``burst``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

from kvtool.errors import UsageError
from kvtool.server.context import Limits
from kvtool.server.auth import DEFAULT_LISTEN, load_token
from kvtool.server.lookup import BlockHasher
from kvtool.server.run import ApiServer
from kvtool.store import Store, as_stack

log = logging.getLogger("kvtool.vllm")

_OPTIONS = {"listen", "token_file", "allow_remote", "tls_cert", "tls_key", "rate", "burst"}


def start_in_vllm(store: Store, options: Mapping[str, Any], settings: Any, namer: Any, vllm_config: Any) -> ApiServer:
    """Serve the API over the connector's ``store`` on a background thread; ``stop()`` it at shutdown."""
    options = dict(options)
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise UsageError(f"unknown kvtool connector api options {unknown}; known: {sorted(_OPTIONS)}")
    if len(store.tiers) < 2:
        raise UsageError(
            "the kvtool API needs a tiered store to pin and move entries: set 'store' to two or more tiers, "
            "e.g. memory://?capacity=4GiB,file:///var/cache/kvtool"
        )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    algo = vllm_config.cache_config.prefix_caching_hash_algo
    hasher = BlockHasher(algo, hash_fn=get_hash_fn_by_name(algo), none_hash=lambda: kv_cache_utils.NONE_HASH)
    defaults = {
        "scheme": "vllm",
        "model": namer.model_id,
        "recipe": namer.recipe,
        "chunk_tokens": settings.chunk_tokens,
        "block_size": namer.block_size,
        "kv_dtype": namer.kv_dtype,
        "tp_size": namer.tp_size,
        "hash_algo": algo,
    }
    token_file = options.get("token_file")
    limits = Limits(**{k: options[k] for k in ("rate", "burst") if k in options})
    server = ApiServer(
        as_stack(store),  # a stack already: it has two or more tiers
        load_token(None if token_file is None else Path(token_file), create=True),
        options.get("listen", DEFAULT_LISTEN),
        allow_remote=bool(options.get("allow_remote", False)),
        tls_cert=_path(options.get("tls_cert")),
        tls_key=_path(options.get("tls_key")),
        limits=limits,
        lookup_defaults=defaults,
        block_hasher=hasher,
        log_level=None,
    ).start()
    log.info("kvtool API on %s over the connector's store %s", server.url, store.describe())
    return server


def _path(value: Any) -> Path | None:
    return None if value is None else Path(value)
