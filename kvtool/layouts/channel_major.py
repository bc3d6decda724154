"""``channel-major``: every plane of 3 or more axes with its last two axes swapped.

A K/V block ``[heads, tokens, dim]`` becomes ``[heads, dim, tokens]``: all the
values of one channel lie together, and a channel's values share their scale,
so their exponent bytes repeat. Planes of fewer axes pass through. ``forward``
returns a contiguous copy, made in cache-sized tiles when the plane is large.
"""

from __future__ import annotations

import numpy as np

from kvtool.layouts.base import PlaneSpec, PlaneWiseLayout, bits_dtype


class ChannelMajor(PlaneWiseLayout):
    layout_id = "channel-major"

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        bits_dtype(self.layout_id, spec.dtype)
        if len(spec.shape) < 3:
            return [spec]
        return [PlaneSpec(spec.name, (*spec.shape[:-2], spec.shape[-1], spec.shape[-2]), np.dtype(spec.dtype))]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        return [swap_last_axes(plane) if plane.ndim >= 3 else plane]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        (plane,) = planes
        return swap_last_axes(plane) if plane.ndim >= 3 else plane

    def inverse_plane_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        (plane,) = planes
        if plane.ndim >= 3:
            swap_last_axes(plane, out)
        else:
            np.copyto(out, plane)

    def axis_after(self, axis: int) -> int:
        return {-1: -2, -2: -1}.get(axis, axis)


#: Planes up to this size are transposed in one copy; larger ones tile by tile.
ONE_COPY_BYTES = 1 << 18
TILE = 256


def swap_last_axes(plane: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A C-contiguous copy of ``plane`` with its last two axes swapped.

    One strided copy is fast while the plane fits in cache. Beyond that, walking
    a long axis with a large power-of-two stride thrashes the cache, so the copy
    goes in tiles of ``TILE`` rows, or, when the rows are the short axis, of
    ``TILE`` columns gathered into a contiguous block first.
    """
    bits = plane.view(f"u{plane.itemsize}")  # plain integer copies, whatever the float type
    rows, cols = bits.shape[-2:]
    out = np.empty((*bits.shape[:-2], cols, rows), bits.dtype) if out is None else out.view(bits.dtype)
    if bits.nbytes <= ONE_COPY_BYTES:
        np.copyto(out, bits.swapaxes(-1, -2))
    elif rows >= cols:
        for start in range(0, rows, TILE):
            np.copyto(out[..., start : start + TILE], bits[..., start : start + TILE, :].swapaxes(-1, -2))
    else:
        for start in range(0, cols, TILE):
            block = np.ascontiguousarray(bits[..., start : start + TILE])
            np.copyto(out[..., start : start + TILE, :], block.swapaxes(-1, -2))
    return out.view(plane.dtype)
