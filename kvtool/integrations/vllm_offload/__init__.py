"""kvtool below vLLM's own KV offloading: a secondary tier of ``TieringOffloadingSpec``.

vLLM moves KV blocks between the GPU and its CPU tier itself and hands whole
chunks to the secondary tiers its configuration names; vLLM's own factory loads
this one by class name and module path, with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvtoolSecondaryTier",
                             "module_path": "kvtool.integrations.vllm_offload",
                             "store": "file:///var/cache/kvtool?capacity=100GiB"}]}}'

Importing this package imports neither vLLM nor torch; ``KvtoolSecondaryTier`` is
resolved on first access. docs/VLLM.md says when to use it rather than kvtool's
own connector (``kvtool.integrations.vllm``).
"""

from __future__ import annotations

from typing import Any

# vLLM releases whose tiering classes this tier was tested against (major.minor).
SUPPORTED_VLLM = ("0.32",)


def __getattr__(name: str) -> Any:
    if name == "KvtoolSecondaryTier":
        from kvtool.integrations.vllm_offload.tier import KvtoolSecondaryTier

        return KvtoolSecondaryTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["SUPPORTED_VLLM", "KvtoolSecondaryTier"]
