"""What codecs and layouts share: an id, a JSON config, a short spec, equality by config."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, ClassVar, cast

from kvtool.errors import UsageError

if TYPE_CHECKING:
    from typing_extensions import Self


class Component:
    """A registered component rebuilt from ``{"id": ..., **params}``.

    Subclasses name the class attribute holding their id (``id_attr``), list
    their config keys in ``params`` (taken as keyword arguments), and may let
    ``ID:ARG`` in a spec set one of them (``spec_param``).
    """

    kind: ClassVar[str]
    id_attr: ClassVar[str]
    params: ClassVar[tuple[str, ...]] = ()
    spec_param: ClassVar[str | None] = None

    @classmethod
    def component_id(cls) -> str:
        return cast(str, getattr(cls, cls.id_attr))

    @classmethod
    def config_id(cls) -> str:
        """The id written into configs: the component's own, or the format's where several ids share one."""
        return cls.component_id()

    def get_config(self) -> dict[str, Any]:
        return {"id": self.config_id(), **{name: getattr(self, name) for name in self.params}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Self:
        unknown = set(config) - {"id", *cls.params}
        if unknown:
            raise UsageError(f"{cls.kind} {cls.component_id()!r} has no parameter {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in config.items() if k != "id"})

    @classmethod
    def from_spec_arg(cls, arg: str) -> Self:
        """Build from the text after ``ID:`` in a spec (``zstd:3``, ``xor-delta:-1``)."""
        if cls.spec_param is None:
            raise UsageError(f"{cls.kind} {cls.component_id()!r} takes no ':' argument")
        return cls(**{cls.spec_param: cls.spec_value(arg)})

    @classmethod
    def spec_value(cls, arg: str) -> Any:
        """The ``spec_param`` value a spec's text stands for (the text itself by default)."""
        return arg

    def spec(self) -> str:
        """The short spec string (``zstd:3``); it keeps only the spec-settable parameter."""
        if self.spec_param is None:
            return self.component_id()
        return f"{self.component_id()}:{getattr(self, self.spec_param)}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Component) and self.kind == other.kind and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items() if k != "id")
        return f"{type(self).__name__}({args})"
