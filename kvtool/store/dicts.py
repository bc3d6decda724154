"""Model dictionaries kept beside a store's entries, so every reader of a shared store finds them.

An entry coded with ``ctxans:ID`` needs dictionary ``ID`` to decode. A writer
``publish``es the dictionary into the store under ``kvd/ID`` (the key is its
content hash, so it is stored once however many entries use it, and a copy
is never wrong); a reader attaches ``source(store)`` to the dictionary
registry (``kvtool.modeldict.registry.attach``), and from then on lookups
fetch any dictionary they do not know from the store, and check it there.
Only the public ``get``/``put``/``contains`` of ``Store`` are used, and
nothing here knows what a dictionary or a recipe is: a dictionary is anything
with an ``id`` and ``to_bytes()``. If the store evicts a dictionary, the
entries that need it fail to decode (a miss with a clear reason), until a
writer publishes it again.
"""

from __future__ import annotations

from typing import Iterable, Protocol

from kvtool.store.base import Store

#: Keys under this prefix hold dictionaries, not KV cache entries.
PREFIX = "kvd/"


class Publishable(Protocol):
    """What a store keeps of a dictionary: its content id and its bytes."""

    @property
    def id(self) -> str: ...

    def to_bytes(self) -> bytes: ...


def key_of(dictionary_id: str) -> str:
    return PREFIX + dictionary_id


def publish(store: Store, dictionary: Publishable) -> bool:
    """Keep ``dictionary`` in ``store`` (once: nothing is written when it is there); ``False`` if it could not be stored."""
    key = key_of(dictionary.id)
    if store.contains(key):
        return True
    return store.put(key, dictionary.to_bytes(), {"kind": "kvtool-dictionary"})


def publish_all(store: Store, dictionaries: Iterable[Publishable]) -> bool:
    """Publish each of ``dictionaries`` (those a recipe codes with); ``False`` if one could not be stored."""
    published = [publish(store, dictionary) for dictionary in dictionaries]  # each, even after a refusal
    return all(published)


def fetch(store: Store, dictionary_id: str) -> bytes | None:
    """The stored bytes of dictionary ``dictionary_id``, unchecked (the registry parses and checks them); None if absent."""
    if store.closed:
        return None
    return store.get(key_of(dictionary_id))


class StoreSource:
    """A dictionary registry's source over one store: ``source(id)`` is the bytes kept there, or None."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def __call__(self, dictionary_id: str) -> bytes | None:
        return fetch(self.store, dictionary_id)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreSource) and other.store is self.store

    def __hash__(self) -> int:
        return id(self.store)


def source(store: Store) -> StoreSource:
    """What to ``attach`` to the dictionary registry so that lookups fall back to ``store`` (equal per store)."""
    return StoreSource(store)
