"""``LayoutChain``: layouts applied left to right, with the exact inverse right to left."""

from __future__ import annotations

from typing import Any, Iterable, Iterator

import numpy as np

from kvtool.layouts.base import Layout, PlaneSpec, check_planes


class LayoutChain:
    """A sequence of layouts that acts as one: ``plan``, ``forward`` and ``inverse`` over all of them.

    ``forward`` returns C-contiguous planes, so their bytes are a free view
    (``plane.view(np.uint8)``): a stage may return a view of its input (the
    identity does), and only such planes are copied at the end. ``inverse`` also
    returns C-contiguous arrays. An empty chain is the identity.
    """

    def __init__(self, layouts: Iterable[Layout] = ()):
        self.layouts: tuple[Layout, ...] = tuple(layouts)
        self._spec = "|".join(layout.spec() for layout in self.layouts)
        self._plans: dict[tuple[PlaneSpec, ...], list[list[PlaneSpec]]] = {}
        self._by_kind: dict[tuple[str, int | None], LayoutChain] = {}

    @property
    def lossy(self) -> bool:
        """Whether any stage gives back an approximation instead of the input's bits."""
        return any(layout.lossy for layout in self.layouts)

    def for_kind(self, kind: str, layer: int | None = None) -> "LayoutChain":
        """The chain as it applies to keys (``"k"``) or values (``"v"``) of ``layer``: itself unless a stage tells
        tensors apart."""
        chain = self._by_kind.get((kind, layer))
        if chain is None:
            bound = [layout.for_kind(kind, layer) for layout in self.layouts]
            same = all(b is layout for b, layout in zip(bound, self.layouts))
            chain = self._by_kind[kind, layer] = self if same else LayoutChain(bound)
        return chain

    def for_block(self, position: int, end: int) -> "LayoutChain":
        """The chain as it applies to a block at ``position`` of a cache ending before ``end``: itself unless a stage
        tells blocks apart (``Layout.for_block``)."""
        bound = [layout.for_block(position, end) for layout in self.layouts]
        return self if all(b is layout for b, layout in zip(bound, self.layouts)) else LayoutChain(bound)

    def plan(self, inputs: list[PlaneSpec]) -> list[PlaneSpec]:
        return list(self._stage_specs(inputs)[-1])

    def forward(self, planes: list[np.ndarray]) -> list[np.ndarray]:
        for layout in self.layouts:
            planes = layout.forward(planes)
        return [np.ascontiguousarray(p) for p in planes]

    def inverse(self, planes: list[np.ndarray], inputs: list[PlaneSpec]) -> list[np.ndarray]:
        """Rebuild the chain's inputs, described by ``inputs``, from its outputs; ``DecodeError`` on a size mismatch."""
        stage_specs = self._stage_specs(inputs)
        check_planes(self.spec() or "token-major", planes, stage_specs[-1])
        for layout, specs in zip(reversed(self.layouts), reversed(stage_specs[:-1])):
            planes = layout.inverse(planes, specs)
        return [np.ascontiguousarray(p) for p in planes]

    def inverse_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        """``inverse`` of one input plane, its last stage writing straight into ``out`` (C-contiguous,
        ``spec``'s shape and dtype): a reader's destination, with no result array and copy."""
        stage_specs = self._stage_specs([spec])
        check_planes(self.spec() or "token-major", planes, stage_specs[-1])
        if not self.layouts:
            np.copyto(out, planes[0])
            return
        for layout, specs in zip(reversed(self.layouts[1:]), reversed(stage_specs[1:-1])):
            planes = layout.inverse(planes, specs)
        self.layouts[0].inverse_into(planes, spec, out)

    def _stage_specs(self, inputs: list[PlaneSpec]) -> list[list[PlaneSpec]]:
        """The specs before each stage and after the last (remembered: a container asks per chunk)."""
        key = tuple(inputs)
        specs = self._plans.get(key)
        if specs is None:
            specs = [list(inputs)]
            for layout in self.layouts:
                specs.append(layout.plan(specs[-1]))
            if len(self._plans) >= 64:
                self._plans.clear()
            self._plans[key] = specs
        return specs

    def get_config(self) -> list[dict[str, Any]]:
        return [layout.get_config() for layout in self.layouts]

    def spec(self) -> str:
        """``a|b`` as ``parse_layouts`` reads it; empty for the identity."""
        return self._spec

    def __iter__(self) -> Iterator[Layout]:
        return iter(self.layouts)

    def __len__(self) -> int:
        return len(self.layouts)

    def __getitem__(self, index: int) -> Layout:
        return self.layouts[index]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LayoutChain) and self.layouts == other.layouts

    def __hash__(self) -> int:
        return hash(self.layouts)

    def __repr__(self) -> str:
        return f"LayoutChain({self.spec()!r})"
