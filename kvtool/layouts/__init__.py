"""Layouts: invertible, bit-exact reorderings of KV tensors, found through a registry.

The registry also holds the lossy stages (``mant-round``, ``fp8``, ``int``; see
``kvtool.layouts.lossy``): layouts with ``lossy`` set, which a recipe uses only
when it names them.

>>> import numpy as np
>>> from kvtool.layouts import parse_layouts
>>> from kvtool.layouts.base import PlaneSpec
>>> chain = parse_layouts("channel-major|byteplane")
>>> block = np.arange(2 * 5 * 4, dtype=np.uint16).reshape(2, 5, 4)
>>> [(p.name, p.shape) for p in chain.plan([PlaneSpec.of(block)])]
[('hi', (2, 4, 5)), ('lo', (2, 4, 5))]
>>> bool((chain.inverse(chain.forward([block]), [PlaneSpec.of(block)])[0] == block).all())
True
"""

from __future__ import annotations

from typing import Any

from kvtool.errors import KvtoolError, UsageError
from kvtool.layouts.base import TOKEN_AXIS, Layout, PlaneSpec
from kvtool.layouts.chain import LayoutChain
from kvtool.registry import ComponentRegistry

registry: ComponentRegistry[Layout] = ComponentRegistry(
    "layout",
    "kvtool.layouts",
    {
        "token-major": "kvtool.layouts.token_major:TokenMajor",
        "channel-major": "kvtool.layouts.channel_major:ChannelMajor",
        "byteplane": "kvtool.layouts.byteplane:BytePlane",
        "bf16-split": "kvtool.layouts.float_split:Bf16Split",
        "fp16-split": "kvtool.layouts.float_split:Fp16Split",
        "xor-delta": "kvtool.layouts.xor_delta:XorDelta",
        "sx-split": "kvtool.layouts.sign_exponent:SignExponentSplit",
        # lossless, a side channel for a lossy stage after it (kvtool.layouts.outliers)
        "outliers": "kvtool.layouts.outliers:Outliers",
        # lossy, opt-in only (kvtool.layouts.lossy)
        "mant-round": "kvtool.layouts.mant_round:MantRound",
        "fp8": "kvtool.layouts.fp8:Fp8",
        "int": "kvtool.layouts.int_quant:IntQuant",
        "pca": "kvtool.layouts.pca:Pca",
    },
)


def get_layout(spec: str) -> Layout:
    """Build a layout from a spec: ``ID`` or ``ID:ARG``."""
    return registry.build(spec)


def layout_from_config(config: Any) -> Layout:
    """Rebuild a layout from its ``get_config()`` output, through the registry only."""
    return registry.from_config(config)


def parse_layouts(spec: str) -> LayoutChain:
    """Parse ``a|b|...`` into a chain; ``""`` is the identity. Errors name the bad stage.

    A stage whose layout has an ``axis`` parameter and is written without an
    argument gets the axis where the stages before it moved the tokens, so
    ``channel-major|xor-delta`` works along the tokens of ``[heads, dim, tokens]``.
    """
    if not spec.strip():
        return LayoutChain()
    layouts: list[Layout] = []
    token_axis = TOKEN_AXIS
    for position, stage in enumerate(spec.split("|"), 1):
        text = stage.strip()
        try:
            if not text:
                raise UsageError("empty stage")
            layout = get_layout(text)
            if ":" not in text and "axis" in layout.params:
                layout = type(layout).from_config({**layout.get_config(), "axis": token_axis})
        except KvtoolError as exc:
            raise type(exc)(f"layout stage {position} {text!r}: {exc}") from None
        token_axis = layout.axis_after(token_axis)
        layouts.append(layout)
    return LayoutChain(layouts)


__all__ = ["Layout", "LayoutChain", "PlaneSpec", "get_layout", "layout_from_config", "parse_layouts", "registry"]
