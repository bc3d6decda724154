"""The hot/cold scheduling API over the wire: ``kvtool serve`` and its Python client.

The party that knows the future (an agent framework that has just sent a long
tool call, a router that knows where a session returns) is another process,
often on another host. This package puts a ``TieredStore``'s scheduling calls
behind an authenticated HTTP API: lookup of a prompt's stored prefix, pin,
unpin, prefetch, offload, evict, touch, a "needed again in N seconds" hint that
the placement policy uses, a server-sent event stream and Prometheus metrics.
docs/API.md describes the endpoints, errors and security model. The vLLM connector
serves the same API from inside vLLM (``kvtool.integrations.vllm.embedded``);
this package never imports ``kvtool.integrations``.

Needs the ``api`` extra (FastAPI, uvicorn, httpx, prometheus_client, cbor2);
``import kvtool.server`` itself imports none of them.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ApiClient": "kvtool.server.client",
    "ApiError": "kvtool.server.client",
    "ApiServer": "kvtool.server.run",
    "Limits": "kvtool.server.context",
    "create_app": "kvtool.server.app",
    "PrefixQuery": "kvtool.server.lookup",
    "lookup_prefix": "kvtool.server.lookup",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:  # the lazily imported names, as their modules type them
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
