"""Room in a Redis server that refuses writes for lack of memory, and what the server says of its memory.

Redis refuses a write with ``OOM`` when ``maxmemory`` is reached and it cannot
evict: under its default ``noeviction`` policy, or when what it may not evict
fills the room (every client's input and output buffers count as used memory,
so writers sending large values at once can fill it with nothing left to evict).
The redis tier then evicts by itself, as Redis's own ``allkeys-lru`` would, but
only among its own entries (keys under its prefix) on the server that refused:
it samples them with ``SCAN``, deletes the least recently used (Redis's
``OBJECT IDLETIME``) until it has freed a few times the refused record (room
for the write and for the buffers of the next ones), and tries again. A write
still refused is reported: ``False`` from ``put``, counted in ``put_refused``.

``server_memory`` reads what every server says of its memory for ``stats()``,
including how many writes it refused (Redis's ``errorstat_OOM``) from every
client, which a process's own counters cannot know.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

#: Times a write refused for lack of memory makes room and is tried again.
ROOM_TRIES = 5
#: Keys sampled per ``SCAN`` step when looking for entries to evict.
SAMPLE = 64
#: ``SCAN`` steps per attempt at making room, at most (a server with many other keys).
MAX_STEPS = 16


@dataclass
class Room:
    """Where the sampling of one server's keys goes on from (a ``SCAN`` cursor), kept between attempts so
    successive evictions sample other keys."""

    cursor: int = 0


def make_room(client: Any, pattern: str, keep: bytes, need: int, room: Room) -> tuple[list[bytes], int, bool]:
    """Delete the least recently used keys matching ``pattern`` (not ``keep``) on the server ``client`` talks to
    until ``need`` bytes are freed or the sample runs out: the keys this call deleted, the bytes they held, and
    whether room was made (also by another writer that deleted the same keys first)."""
    sample: list[bytes] = []
    for _ in range(MAX_STEPS):
        room.cursor, found = client.scan(room.cursor, match=pattern, count=SAMPLE)
        sample.extend(k for k in found if k != keep)
        if len(sample) >= SAMPLE or room.cursor == 0:
            break
    if not sample:
        return [], 0, False
    pipe = client.pipeline(transaction=False)
    for key in sample:
        pipe.object("idletime", key)
        pipe.strlen(key)
    replies = pipe.execute(raise_on_error=False)
    idle = [r if isinstance(r, int) else 0 for r in replies[0::2]]  # no idle time under an LFU policy: sample order
    sizes = [r if isinstance(r, int) else 0 for r in replies[1::2]]
    victims, freed = [], 0
    for i in sorted(range(len(sample)), key=lambda i: -idle[i]):
        if freed >= need:
            break
        victims.append(i)
        freed += sizes[i]
    pipe = client.pipeline(transaction=False)
    for i in victims:
        pipe.delete(sample[i])  # one key a command: a cluster node refuses keys of several slots in one
    deleted = pipe.execute(raise_on_error=False)
    gone = [sample[i] for i, n in zip(victims, deleted) if n == 1]
    return gone, sum(sizes[i] for i, n in zip(victims, deleted) if n == 1), bool(victims)


def server_memory(clients: Iterable[Any]) -> dict[str, Any]:
    """What the servers say of their memory, summed over them: ``maxmemory`` (0: unlimited), used memory, keys
    Redis evicted, writes it refused for lack of memory (from every client), and the eviction policy."""
    total = {"server_maxmemory_bytes": 0, "server_used_memory_bytes": 0, "server_evicted_keys": 0,
             "server_refused_writes": 0}
    policies = set()
    for client in clients:
        memory, stats, errors = client.info("memory"), client.info("stats"), client.info("errorstats")
        total["server_maxmemory_bytes"] += int(memory.get("maxmemory", 0))
        total["server_used_memory_bytes"] += int(memory.get("used_memory", 0))
        total["server_evicted_keys"] += int(stats.get("evicted_keys", 0))
        total["server_refused_writes"] += int(errors.get("errorstat_OOM", {}).get("count", 0))
        policies.add(str(memory.get("maxmemory_policy", "")))
    return {**total, "server_maxmemory_policy": ",".join(sorted(policies))}
