"""Placement policies for ``TieredStore``: which tiers may hold an entry, and who leaves first.

A policy answers two questions about the entries ``TieredStore`` tracks:
``admits(placement, tier_profile)`` -- may this entry live in this tier -- and
``coldest_first(placements, tier_profile, now)`` -- in which order entries leave
a tier that needs room. Policies are plain objects; a new one subclasses
``Policy``.
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvtool.errors import UsageError


@dataclass
class Placement:
    """What ``TieredStore`` knows about one entry: where it is and how it is used."""

    key: str
    tier: int  # the highest tier holding it
    size: int  # bytes of the stored record
    tokens: int | None  # tokens of KV cache the entry holds, from its metadata
    last_access: float  # time.monotonic() of the last put, get or touch
    hits: int = 0
    copy_in: int | None = None  # a persistent tier below that holds the same record (write-behind)


class TierProfile:
    """How long a tier takes to hand back ``n`` bytes: ``latency + n / bandwidth``.

    Starts from the store's typical figures and follows what the tier is
    measured doing: reads of at most ``SMALL_READ`` bytes update the latency,
    larger reads the bandwidth (both as exponentially weighted moving averages).
    """

    SMALL_READ = 64 * 1024
    ALPHA = 0.2

    def __init__(self, latency_s: float, bandwidth: float) -> None:
        self.latency_s = latency_s
        self.bandwidth = bandwidth
        self.samples = 0
        self._lock = threading.Lock()

    def restore_seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes / self.bandwidth

    def observe(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.samples += 1
            if nbytes <= self.SMALL_READ:
                self.latency_s += self.ALPHA * (seconds - self.latency_s)
            else:
                transfer = max(seconds - self.latency_s, 1e-9)
                self.bandwidth += self.ALPHA * (nbytes / transfer - self.bandwidth)

    def to_dict(self) -> dict[str, float]:
        return {"latency_ms": self.latency_s * 1000, "bandwidth_MBps": self.bandwidth / 1e6, "samples": self.samples}


class Policy(ABC):
    name = ""

    def admits(self, placement: Placement, profile: TierProfile) -> bool:
        """May ``placement``'s entry live in the tier ``profile`` describes? Every tier, by default."""
        return True

    @abstractmethod
    def coldest_first(self, placements: list[Placement], profile: TierProfile, now: float) -> list[Placement]:
        """``placements`` (all in one tier) in the order they should leave it."""

    def describe(self) -> str:
        return self.name


class LRUPolicy(Policy):
    """Least recently used leaves first; every tier admits every entry."""

    name = "lru"

    def coldest_first(self, placements: list[Placement], profile: TierProfile, now: float) -> list[Placement]:
        return sorted(placements, key=lambda p: p.last_access)


class CostAwarePolicy(Policy):
    """Keep an entry only where restoring it is cheaper than recomputing its prefill.

    Restoring an entry of ``size`` bytes from a tier costs the tier's measured
    ``latency + size / bandwidth``; recomputing it costs
    ``tokens * prefill_seconds_per_token``. The difference is the time the
    entry saves each time it is reused from that tier. A tier admits an entry
    only when that saving is positive. When a tier needs room, the entry with
    the smallest saving per byte it occupies leaves first, the saving discounted
    by time unused (an entry unused for ``half_life_s`` counts half).

    An entry without a token count in its metadata has no known saving: every
    tier admits it, and it leaves a full tier before any entry that has one.
    """

    name = "cost-aware"

    def __init__(self, prefill_seconds_per_token: float, half_life_s: float = 300.0) -> None:
        if not (math.isfinite(prefill_seconds_per_token) and prefill_seconds_per_token > 0):
            raise UsageError(f"prefill_seconds_per_token must be a positive number, not {prefill_seconds_per_token!r}")
        if not (math.isfinite(half_life_s) and half_life_s > 0):
            raise UsageError(f"half_life_s must be a positive number, not {half_life_s!r}")
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.half_life_s = half_life_s

    def saving_seconds(self, placement: Placement, profile: TierProfile) -> float | None:
        """Seconds saved per reuse by restoring from this tier instead of recomputing; None if unknown."""
        if placement.tokens is None:
            return None
        return placement.tokens * self.prefill_seconds_per_token - profile.restore_seconds(placement.size)

    def admits(self, placement: Placement, profile: TierProfile) -> bool:
        saving = self.saving_seconds(placement, profile)
        return saving is None or saving > 0

    def coldest_first(self, placements: list[Placement], profile: TierProfile, now: float) -> list[Placement]:
        def value(p: Placement) -> tuple[bool, float, float]:
            saving = self.saving_seconds(p, profile)
            if saving is None:
                return (False, 0.0, p.last_access)
            decay = 1.0 + max(0.0, now - p.last_access) / self.half_life_s
            return (True, saving / max(p.size, 1) / decay, p.last_access)

        return sorted(placements, key=value)

    def describe(self) -> str:
        return f"{self.name}(prefill_seconds_per_token={self.prefill_seconds_per_token:g}, half_life_s={self.half_life_s:g})"


class HintedPolicy(Policy):
    """Another policy, plus what a caller knows of the future: ``hint(key, returns_in_s)``.

    The party that knows when an entry is needed again (an agent framework that
    has just sent a 30-second tool call) says so. While a hinted entry is not
    due for more than ``soon_s`` seconds it leaves a full tier before any other
    entry, the one due last leaving first; once it is due within ``soon_s`` (or
    overdue by less than ``soon_s``) it leaves after every other entry. Entries
    without a live hint keep the wrapped policy's order and admission. A hint
    lapses when the entry is used after it was given (``Placement.last_access``),
    ``soon_s`` after it fell due, or on ``hint(key, None)``.

    ``TieredStore`` consults only ``admits`` and ``coldest_first``, so wrapping
    the policy of a running store (``store.policy = HintedPolicy(store.policy)``)
    is all it takes.
    """

    def __init__(self, inner: Policy, soon_s: float = 5.0, max_hints: int = 100_000) -> None:
        if not (math.isfinite(soon_s) and soon_s >= 0):
            raise UsageError(f"soon_s must be a number of seconds, not {soon_s!r}")
        self.inner = inner
        self.name = inner.name
        self.soon_s = soon_s
        self.max_hints = max_hints
        self._hints: dict[str, tuple[float, float]] = {}  # key -> (due, hinted at), both time.monotonic()
        self._lock = threading.Lock()

    def hint(self, key: str, returns_in_s: float | None, now: float | None = None) -> None:
        """``key`` is needed again in about ``returns_in_s`` seconds, not before; None forgets the hint."""
        now = time.monotonic() if now is None else now
        with self._lock:
            if returns_in_s is None:
                self._hints.pop(key, None)
                return
            if not (math.isfinite(returns_in_s) and returns_in_s >= 0):
                raise UsageError(f"returns_in_s must be a non-negative number of seconds, not {returns_in_s!r}")
            if key not in self._hints and len(self._hints) >= self.max_hints:
                self._hints = {k: h for k, h in self._hints.items() if h[0] + self.soon_s >= now}
                if len(self._hints) >= self.max_hints:
                    raise UsageError(f"{self.max_hints} hints are live; wait for some to fall due")
            self._hints[key] = (now + returns_in_s, now)

    def due_in(self, key: str, now: float | None = None) -> float | None:
        """Seconds until ``key`` is due by its hint (negative when overdue); None without a hint."""
        now = time.monotonic() if now is None else now
        with self._lock:
            hint = self._hints.get(key)
        return None if hint is None or hint[0] + self.soon_s < now else hint[0] - now

    def admits(self, placement: Placement, profile: TierProfile) -> bool:
        return self.inner.admits(placement, profile)

    def coldest_first(self, placements: list[Placement], profile: TierProfile, now: float) -> list[Placement]:
        ordered = self.inner.coldest_first(placements, profile, now)
        with self._lock:
            due = {p.key: self._live_due(p, now) for p in ordered if p.key in self._hints}
        later = sorted((p for p in ordered if (due.get(p.key) or -math.inf) > now + self.soon_s),
                       key=lambda p: -(due.get(p.key) or -math.inf))
        leaving_first = {p.key for p in later}
        soon = [p for p in ordered if due.get(p.key) is not None and p.key not in leaving_first]
        rest = [p for p in ordered if due.get(p.key) is None]
        return later + rest + soon

    def _live_due(self, placement: Placement, now: float) -> float | None:
        due, hinted_at = self._hints[placement.key]
        if placement.last_access > hinted_at or due + self.soon_s < now:
            del self._hints[placement.key]  # used since, or long overdue: the hint has lapsed
            return None
        return due

    def describe(self) -> str:
        return f"{self.inner.describe()} with hints"
