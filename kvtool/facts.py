"""What a KV cache's axes mean, and what a reader must know about the model that produced it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

AXES = ("kv_heads", "tokens", "head_dim")


@dataclass(frozen=True)
class ModelFacts:
    """What a reader needs to know about the model that produced a cache."""

    model_id: str = "unknown"
    architecture: str = "unknown"
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    keys_post_rope: bool | None = None  # None: not known

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelFacts":
        """The facts in ``data`` (other keys are ignored); ``ValueError`` for a value of the wrong type."""
        if not isinstance(data, dict):
            raise ValueError(f"model facts must be a JSON object, not {type(data).__name__}")  # noqa: TRY004 - file content: readers catch ValueError
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        for name, value in known.items():
            if not _fits_field(name, value):
                raise ValueError(f"model fact {name!r} has a value of the wrong type: {str(value)[:80]!r}")
        return cls(**known)


def _fits_field(name: str, value: Any) -> bool:
    if name in ("model_id", "architecture"):
        return isinstance(value, str)
    if name == "keys_post_rope":
        return value is None or isinstance(value, bool)
    return type(value) is int and 0 <= value < 1 << 31
