"""``byteplane``: each element split into its bytes, one ``uint8`` plane per byte.

Planes come most significant byte first, each with the input's shape: ``hi``
and ``lo`` for 16-bit elements, ``b3``, ``b2``, ``b1``, ``b0`` for 32-bit ones
(``bN`` holds bits ``8N`` to ``8N+7``), ``b7`` .. ``b0`` for 64-bit ones. The
byte order is that of the values, not of the machine. 8-bit planes pass through.
"""

from __future__ import annotations

import numpy as np

from kvtool.layouts.base import PlaneSpec, PlaneWiseLayout, bits_dtype, child_name


def byte_names(itemsize: int) -> list[str]:
    """Plane names, most significant byte first."""
    return ["hi", "lo"] if itemsize == 2 else [f"b{i}" for i in reversed(range(itemsize))]


class BytePlane(PlaneWiseLayout):
    layout_id = "byteplane"

    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        itemsize = bits_dtype(self.layout_id, spec.dtype).itemsize
        if itemsize == 1:
            return [spec]
        return [PlaneSpec(child_name(spec.name, n), tuple(spec.shape), np.dtype(np.uint8)) for n in byte_names(itemsize)]

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        bits = plane.view(bits_dtype(self.layout_id, plane.dtype))
        if bits.itemsize == 1:
            return [plane]
        # Shift-and-truncate on a contiguous copy beats gathering strided bytes.
        bits = np.ascontiguousarray(bits)
        return [(bits >> (8 * i) if i else bits).astype(np.uint8) for i in reversed(range(bits.itemsize))]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        bits_type = bits_dtype(self.layout_id, spec.dtype)
        if bits_type.itemsize == 1:
            return planes[0]
        bits = np.empty(spec.shape, bits_type)
        self._join(planes, bits)
        return bits.view(spec.dtype)

    def inverse_plane_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        bits_type = bits_dtype(self.layout_id, spec.dtype)
        if bits_type.itemsize == 1:  # the plane passed through with its own type (fp8): copy its bits
            np.copyto(out.view(np.uint8), planes[0].view(np.uint8))
        else:
            self._join(planes, out.view(bits_type))

    @staticmethod
    def _join(planes: list[np.ndarray], bits: np.ndarray) -> None:
        """The byte planes, most significant first, put back together in ``bits``."""
        np.copyto(bits, planes[0])
        for plane in planes[1:]:
            bits <<= 8
            bits |= plane
