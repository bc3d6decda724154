"""One small generic registry for codecs, layouts and store backends.

Built-in components are named by import path and imported only when first asked
for, so ``import kvtool`` never pulls in an optional library. Third parties add
components through an entry-point group (``kvtool.codecs``, ``kvtool.layouts``,
``kvtool.stores``) with one line in their packaging metadata; entry points are
listed by name at first use and imported only when looked up. A package that
claims a built-in id is ignored with a warning: built-ins win, so installing it
cannot change how existing files decode.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Generic, TypeVar, cast

from kvtool.component import Component
from kvtool.errors import DuplicateIdError, UnavailableError, UnknownIdError, UsageError

T = TypeVar("T")  # what the registered classes make: Codec, Layout, Store
C = TypeVar("C", bound=Component)


@dataclass(frozen=True)
class _Entry:
    target: str  # "package.module:attribute"
    origin: str  # "kvtool" or the distribution that declared the entry point
    extra: str | None = None  # kvtool extra that provides the import, if any


class Registry(Generic[T]):
    """Maps ids to lazily imported classes whose instances are ``T``.

    ``builtins`` maps an id to ``"module:attr"`` or ``("module:attr", extra)``
    where ``extra`` names the kvtool extra whose packages the module imports.
    """

    def __init__(self, kind: str, group: str, builtins: dict[str, str | tuple[str, str]]):
        self.kind = kind
        self.group = group
        self._entries: dict[str, _Entry] = {}
        self._ambiguous: dict[str, list[str]] = {}
        self._loaded: dict[str, type[T]] = {}
        self._discovered = False
        self._lock = threading.Lock()
        for id_, target in builtins.items():
            path, extra = (target, None) if isinstance(target, str) else target
            self._entries[id_] = _Entry(path, "kvtool", extra)

    def register(self, id_: str, obj: type[T]) -> None:
        """Register an already imported class under ``id_`` (for tests and scripts)."""
        self._discover()
        if id_ in self._entries or id_ in self._loaded:
            raise DuplicateIdError(f"{self.kind} id {id_!r} is already registered")
        self._loaded[id_] = obj

    def unregister(self, id_: str) -> None:
        """Forget a class ``register`` added (tests and scripts); built-ins and entry points stay."""
        if id_ not in self._entries:
            self._loaded.pop(id_, None)

    def ids(self) -> list[str]:
        """Every known id, sorted; importing nothing."""
        self._discover()
        return sorted(set(self._entries) | set(self._loaded) | set(self._ambiguous))

    def get(self, id_: str) -> type[T]:
        """The class registered as ``id_``, imported on first use."""
        self._discover()
        if id_ in self._loaded:
            return self._loaded[id_]
        if id_ in self._ambiguous:
            raise DuplicateIdError(
                f"{self.kind} id {id_!r} is claimed by several packages: "
                + ", ".join(self._ambiguous[id_])
            )
        entry = self._entries.get(id_)
        if entry is None:
            raise UnknownIdError(
                f"unknown {self.kind} {id_!r}; known: {', '.join(self.ids())}. "
                f"Others come from packages that register under the entry-point group {self.group!r}"
            )
        with self._lock:
            if id_ not in self._loaded:
                self._loaded[id_] = self._import(id_, entry)
        return self._loaded[id_]

    def _import(self, id_: str, entry: _Entry) -> type[T]:
        module_name, _, attr = entry.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"; install it with: pip install 'kvtool[{entry.extra}]'" if entry.extra else ""
            raise UnavailableError(f"{self.kind} {id_!r} cannot be imported ({exc}){hint}") from exc
        return cast("type[T]", getattr(module, attr))

    def _discover(self) -> None:
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            for ep in metadata.entry_points(group=self.group):
                origin = ep.dist.name if ep.dist else "unknown"
                known = self._entries.get(ep.name)
                if known is not None and known.origin == "kvtool" and known.target != ep.value:
                    warnings.warn(
                        f"{origin} registers {self.kind} {ep.name!r} ({ep.value}) under {self.group!r}, "
                        f"but {ep.name!r} is built into kvtool; the built-in is used",
                        stacklevel=2,
                    )
                elif known is None:
                    self._entries[ep.name] = _Entry(ep.value, origin)
                elif known.target != ep.value:
                    self._ambiguous.setdefault(ep.name, [known.origin]).append(origin)
            for id_ in self._ambiguous:
                self._entries.pop(id_, None)
            self._discovered = True


class ComponentRegistry(Registry[C]):
    """A registry of components (codecs, layouts), which are also built from specs and configs."""

    def build(self, spec: str) -> C:
        """An instance from a spec: ``ID`` or ``ID:ARG`` (``zstd:19``, ``xor-delta:-1``)."""
        id_, sep, arg = spec.strip().partition(":")
        if not id_:
            raise UsageError(f"empty {self.kind} spec {spec!r}")
        cls = self.get(id_)
        return cls.from_spec_arg(arg) if sep else cls()

    def from_config(self, config: Any) -> C:
        """An instance rebuilt from its ``get_config()`` output, through this registry only."""
        if not isinstance(config, dict) or not isinstance(config.get("id"), str):
            raise UsageError(f"a {self.kind} config must be an object with a string 'id', not {config!r}")
        return self.get(config["id"]).from_config(config)
