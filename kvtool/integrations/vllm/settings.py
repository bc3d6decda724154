"""The connector's options, read from vLLM's ``kv_connector_extra_config``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from kvtool.errors import UsageError
from kvtool.integrations.vllm.dictionary import check_setting as check_dictionary
from kvtool.recipe import DEFAULT_RECIPE, Recipe
from kvtool.store.file import default_path
from kvtool.entries.names import blocks_per_entry
from kvtool.store.tiered import DEFAULT_WRITE_BEHIND


def default_store() -> str:
    """4 GiB of memory over 20 GiB of disk in the user's cache: shared by vLLM's processes, kept across restarts."""
    return f"memory://?capacity=4GiB,file://{default_path()}?capacity=20GiB"


@dataclass(frozen=True)
class ConnectorSettings:
    """``store``: a kvtool store URL list; ``recipe``: how entries are encoded (a
    lossy recipe such as ``int:8,group=64|zstd:3`` only when named here: its
    entries are keyed apart from lossless ones and restore as approximations);
    ``chunk_tokens``: about how many tokens one store entry holds (rounded to
    whole vLLM blocks); ``model_id``: the name that keys the cache (default: the
    model vLLM was given; set it when several hosts load the same model from
    different paths); ``overlap``: restore layer by layer while the model runs,
    or everything before the forward pass (default: overlap when the KV cache
    lives on an accelerator; on vLLM's CPU backend the decoding thread competes
    with the model's own threads and measured slower); ``write_behind``: how
    many entries saved into a memory tier may wait for their copy in the
    persistent tier below (0: none are copied before they leave memory or the
    server shuts down); ``api``: serve kvtool's HTTP API from this server over
    the live store (``kvtool.integrations.vllm.embedded``); ``dictionary``: with a
    ``ctxans`` or ``ctxtans`` recipe, a ``.kvd`` model dictionary to code with, or
    ``train[:TOKENS]`` to learn one from the first entries saved
    (``kvtool.integrations.vllm.dictionary``)."""

    store: str = field(default_factory=default_store)
    recipe: str = DEFAULT_RECIPE
    chunk_tokens: int = 256
    model_id: str | None = None
    overlap: bool | None = None
    write_behind: int = DEFAULT_WRITE_BEHIND
    api: dict[str, Any] | None = None
    dictionary: str | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - known)
        if unknown:
            raise UsageError(f"unknown kvtool connector options {unknown}; known: {sorted(known)}")
        settings = cls(**extra)
        if not isinstance(settings.chunk_tokens, int) or settings.chunk_tokens <= 0:
            raise UsageError(f"chunk_tokens must be a positive integer, not {settings.chunk_tokens!r}")
        if settings.overlap is not None and not isinstance(settings.overlap, bool):
            raise UsageError(f"overlap must be true or false, not {settings.overlap!r}")
        if not isinstance(settings.write_behind, int) or settings.write_behind < 0:
            raise UsageError(f"write_behind must be a number of entries (0 or more), not {settings.write_behind!r}")
        Recipe.parse(settings.recipe)  # fail at startup, not on the first save
        check_dictionary(settings.dictionary, settings.recipe)
        return settings

    def blocks_per_entry(self, block_size: int) -> int:
        return blocks_per_entry(self.chunk_tokens, block_size)
