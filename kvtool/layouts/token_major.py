"""``token-major``: the identity, planes as they come (``[heads, tokens, dim]`` for K/V)."""

from __future__ import annotations

import numpy as np

from kvtool.layouts.base import Layout, PlaneSpec, bits_dtype, check_planes


class TokenMajor(Layout):
    layout_id = "token-major"

    def plan(self, inputs: list[PlaneSpec]) -> list[PlaneSpec]:
        for spec in inputs:
            bits_dtype(self.layout_id, spec.dtype)
        return list(inputs)

    def forward(self, planes: list[np.ndarray]) -> list[np.ndarray]:
        self.plan([PlaneSpec.of(p) for p in planes])
        return list(planes)

    def inverse(self, planes: list[np.ndarray], inputs: list[PlaneSpec]) -> list[np.ndarray]:
        check_planes(self.layout_id, planes, self.plan(inputs))
        return list(planes)
