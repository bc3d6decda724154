"""What the endpoints share: the client-facing bounds (``Limits``) and the store and its helpers (``ApiContext``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtool.server.events import EventHub
from kvtool.server.later import Later
from kvtool.server.lookup import BlockHasher
from kvtool.store import TieredStore
from kvtool.store.policy import HintedPolicy


@dataclass(frozen=True)
class Limits:
    """Bounds on what clients may ask: body sizes, request rate per client, open event streams."""

    max_json_bytes: int = 8 << 20  # a lookup of MAX_TOKENS token ids fits
    max_value_bytes: int = 256 << 20
    rate: float = 1000.0  # requests a second per client; 0 turns the limit off
    burst: int = 2000
    max_event_streams: int = 64
    prefetch_wait_s: float = 60.0


@dataclass
class ApiContext:
    """What the endpoints share."""

    store: TieredStore
    policy: HintedPolicy
    hub: EventHub
    later: Later
    lookup_defaults: dict[str, Any] = field(default_factory=dict)
    block_hasher: BlockHasher | None = None
