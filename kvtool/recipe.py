"""Recipes: a layout chain plus the codec for each plane it produces.

A recipe is written as a spec string, layouts then one codec stage::

    zstd:3                                  no reordering, zstd level 3
    byteplane|zstd:1                        split bytes, zstd level 1 on each plane
    channel-major|bf16-split|zstd:1,mant=none
                                            per-plane codecs: zstd:1 by default,
                                            the "mant" plane stored as is

    int:4,group=64|zstd:3                   lossy: 4-bit codes with keys quantized
                                            per channel, values per token, then zstd

The codec stage is a comma-separated list: an optional default codec, then
``PLANE=CODEC`` overrides for planes named by the layouts. In a file the recipe
is data (``to_config``) and is rebuilt only through the registries.

A lossy stage (``kvtool.layouts.lossy``) is never implied: a recipe has one only
when its spec names it, as its first stage, or its second after a side channel
that keeps some values exact (``outliers:0.01|int:3,group=128|zstd:3``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtool._native.batch import BatchCodec
from kvtool.codecs import ArrayCodec, Codec, codec_from_config, get_codec, registry as codec_registry
from kvtool.errors import KvtoolError, UsageError
from kvtool.layouts import LayoutChain, layout_from_config, parse_layouts
from kvtool.layouts import registry as layout_registry
from kvtool.layouts.base import PlaneSpec, StageKernel
from kvtool.layouts.lossy import SideChannel

DEFAULT_RECIPE = "exphuff"


@dataclass(frozen=True)
class Recipe:
    layouts: LayoutChain
    codec: Codec
    plane_codecs: dict[str, Codec] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "Recipe":
        """Parse ``LAYOUT[|LAYOUT...]|CODEC[:LEVEL][,PLANE=CODEC...]``; errors name the bad stage."""
        stages = [s.strip() for s in spec.split("|")]
        if not spec.strip() or any(not s for s in stages):
            raise UsageError(f"recipe {spec!r}: empty stage; write e.g. {DEFAULT_RECIPE!r}")
        *layout_stages, codec_stage = stages
        codec, plane_codecs = _parse_codec_stage(codec_stage, spec)
        try:
            layouts = parse_layouts("|".join(layout_stages))
        except KvtoolError as exc:
            raise type(exc)(f"recipe {spec!r}: {exc}") from None
        return cls(layouts, codec, plane_codecs)

    def __post_init__(self) -> None:
        lossy = [layout.spec() for layout in self.layouts if layout.lossy]
        lead = 1 if len(self.layouts) > 1 and isinstance(self.layouts[0], SideChannel) else 0
        if lossy and (len(lossy) > 1 or not self.layouts[lead].lossy):
            raise UsageError(
                f"recipe {self.spec()!r}: a lossy stage ({', '.join(lossy)}) must be the first stage (or the second, after "
                "a side channel such as outliers), and the only lossy one"
            )
        if isinstance(self.codec, ArrayCodec) and self.plane_codecs:
            raise UsageError(f"recipe {self.spec()!r}: codec {self.codec.codec_id!r} codes the whole block; it takes no plane codecs")
        if any(isinstance(c, ArrayCodec) for c in self.plane_codecs.values()):
            raise UsageError(f"recipe {self.spec()!r}: an array codec cannot code a single plane")

    @property
    def array_codec(self) -> ArrayCodec | None:
        """The codec, when it takes whole KV blocks: the layouts before it must leave one [heads, tokens, dim] plane."""
        return self.codec if isinstance(self.codec, ArrayCodec) else None

    @property
    def lossy(self) -> bool:
        """Whether a stage of the recipe stores an approximation: then decoding gives back other bits."""
        return self.layouts.lossy

    # -- what the recipe's stages can do, asked of the stages themselves ------------------------
    def batch_kernel(self, dtype: np.dtype) -> BatchCodec | None:
        """The native kernel that codes this recipe's tensors of ``dtype`` and decodes runs of its chunks straight into
        a destination: its codec's (``Codec.batch_kernel``), where no layout or plane codec comes before it."""
        if len(self.layouts) or self.plane_codecs:
            return None
        return self.codec.batch_kernel(dtype)

    def stage_kernel(self, dtype: np.dtype) -> StageKernel | None:
        """The native kernel of the recipe's only layout (``Layout.batch_kernel``), where every codec of its planes
        hands planes to it (``Codec.plane_batch``)."""
        if len(self.layouts) != 1 or not all(c.plane_batch for c in [self.codec, *self.plane_codecs.values()]):
            return None
        return self.layouts[0].batch_kernel(dtype)

    @property
    def gpu_decodes(self) -> bool:
        """Whether the GPU decoder reads this recipe's chunks (a codec that says so, with no layouts before it)."""
        return not len(self.layouts) and not self.plane_codecs and self.codec.gpu_decodes

    @property
    def uses_dictionary(self) -> bool:
        """Whether a model dictionary codes any of this recipe's planes."""
        return any(c.uses_dictionary for c in [self.codec, *self.plane_codecs.values()])

    def for_kind(self, kind: str, layer: int | None = None) -> "Recipe":
        """The recipe as it applies to keys (``"k"``) or values (``"v"``) of ``layer``; see ``Layout.for_kind``."""
        layouts = self.layouts.for_kind(kind, layer)
        return self if layouts is self.layouts else Recipe(layouts, self.codec, self.plane_codecs)

    def for_block(self, position: int, end: int) -> "Recipe":
        """The recipe as it applies to a block at sequence ``position`` of a cache ending before ``end``; see
        ``Layout.for_block``."""
        layouts = self.layouts.for_block(position, end)
        return self if layouts is self.layouts else Recipe(layouts, self.codec, self.plane_codecs)

    def spec(self) -> str:
        codec_stage = ",".join([self.codec.spec()] + [f"{p}={c.spec()}" for p, c in self.plane_codecs.items()])
        layouts = self.layouts.spec()
        return f"{layouts}|{codec_stage}" if layouts else codec_stage

    def codec_for(self, plane: str) -> Codec:
        return self.plane_codecs.get(plane, self.codec)

    def plan(self, tensor: PlaneSpec) -> list[PlaneSpec]:
        """The planes this recipe cuts a tensor block into, checking per-plane codec names."""
        planes = self.layouts.plan([tensor])
        if self.array_codec is not None:
            if len(planes) != 1 or len(planes[0].shape) != 3:
                raise UsageError(
                    f"recipe {self.spec()!r}: codec {self.codec.codec_id!r} takes one [heads, tokens, dim] block; "
                    f"its layouts leave {[p.name for p in planes]}"
                )
            if not self.array_codec.supports(planes[0].dtype):
                raise UsageError(f"recipe {self.spec()!r} cannot code {np.dtype(planes[0].dtype)} tensors; use e.g. 'byteplane|zstd:3'")
        unknown = set(self.plane_codecs) - {p.name for p in planes}
        if unknown:
            raise UsageError(
                f"recipe {self.spec()!r} names planes {sorted(unknown)}, but its layouts produce "
                f"{[p.name for p in planes]}"
            )
        return planes

    def to_config(self) -> dict[str, Any]:
        return {
            "layouts": self.layouts.get_config(),
            "codec": self.codec.get_config(),
            "plane_codecs": {p: c.get_config() for p, c in self.plane_codecs.items()},
        }

    @classmethod
    def from_config(cls, config: Any) -> "Recipe":
        if not isinstance(config, dict) or not isinstance(config.get("layouts"), list):
            raise UsageError("a recipe config needs a 'layouts' list and a 'codec'")
        plane_codecs = config.get("plane_codecs", {})
        if not isinstance(plane_codecs, dict):
            raise UsageError("a recipe config's 'plane_codecs' must be an object")
        return cls(
            LayoutChain([layout_from_config(c) for c in config["layouts"]]),
            codec_from_config(config.get("codec")),
            {str(p): codec_from_config(c) for p, c in plane_codecs.items()},
        )


def recipe_for(codec_id: str) -> str:
    """The simplest recipe that exercises codec ``codec_id`` on a KV cache (byte planes for a bytes codec)."""
    cls = codec_registry.get(codec_id)
    return codec_id if issubclass(cls, ArrayCodec) else f"byteplane|{codec_id}"


def _parse_codec_stage(stage: str, spec: str) -> tuple[Codec, dict[str, Codec]]:
    default: Codec | None = None
    overrides: dict[str, Codec] = {}
    for part in (p.strip() for p in stage.split(",")):
        plane, eq, codec_spec = part.rpartition("=") if "=" in part else ("", "", part)
        codec_id = codec_spec.partition(":")[0]
        if codec_id not in codec_registry.ids():
            hint = ""
            if codec_id in layout_registry.ids():
                hint = (f"; {codec_id!r} is a layout: end the recipe with a codec stage such as '|zstd:1' or '|none'"
                        + ("" if "|" in spec else f", and quote the whole recipe ('{spec}|zstd:1'): unquoted, "
                           "a shell reads '|' as a pipe and drops what follows it"))
            raise UsageError(
                f"recipe {spec!r}: last stage {part!r} is not a codec{hint} (codecs: {', '.join(codec_registry.ids())})"
            )
        codec = get_codec(codec_spec)
        if not eq:
            if default is not None:
                raise UsageError(f"recipe {spec!r}: two default codecs in {stage!r}; name the plane as PLANE=CODEC")
            default = codec
        elif not plane or plane in overrides:
            raise UsageError(f"recipe {spec!r}: bad or repeated plane name in {part!r}")
        else:
            overrides[plane] = codec
    return (default or get_codec("none")), overrides
