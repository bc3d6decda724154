"""kvtool's vLLM KV connector: restore prompt prefixes from a kvtool store instead of recomputing them.

vLLM loads it by module path through its official KV-connector API::

    --kv-transfer-config '{"kv_connector": "KvtoolConnector",
                           "kv_connector_module_path": "kvtool.integrations.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "memory://?capacity=4GiB,file:///var/cache/kvtool"}}'

Importing this package imports neither vLLM nor torch; ``KvtoolConnector`` is
resolved on first access (vLLM imports the module, then reads the attribute).
docs/VLLM.md describes deployment, logs and supported versions.
"""

from __future__ import annotations

from typing import Any

# vLLM releases this connector was checked against (major.minor); others get a warning.
SUPPORTED_VLLM = ("0.32",)


def __getattr__(name: str) -> Any:
    if name in ("KvtoolConnector", "KvtoolConnectorMetadata"):
        from kvtool.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SUPPORTED_VLLM", "KvtoolConnector", "KvtoolConnectorMetadata"]
