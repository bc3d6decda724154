"""``pca:DICT``: transform coding with a basis learnt once per model (lossy).

As NVIDIA's KVTC codes a KV cache: each token's keys or values of one layer
(the ``heads * dim`` values of the token, heads one after the other) are
decorrelated by a PCA basis learnt from real caches of the model, and the
coefficients are quantized and entropy coded. The basis of every layer and
kind lives in a transform dictionary (``kvtool train --basis``, a ``.kvd``
named by its id: ``kvtool.modeldict.basis``), found as ``ctxans`` finds its
dictionary. Keys may be de-rotated before their basis (the dictionary says so,
with the model's rotary frequencies): without the rotation, which turns with the
position, keys have far fewer dimensions that matter.

Parameters: ``step`` (relative to each tensor's RMS on the training data; the
error target: each coefficient comes back within ``step * RMS / 2``) or
``bits`` (the rate target: the finest step of the dictionary's calibration grid
whose rate over its training data, averaged over every tensor, is at most
``bits`` per value); ``kstep`` and ``vstep`` give keys or values a step of their
own. One step per tensor is the allocation that minimises the squared error at
a rate (reverse water-filling): every component is quantized with it, and the
components whose variance lies under the water (standard deviation below a
quarter step) get no bits at all. ``sink`` (default 4) keeps the first tokens
of a sequence exact, ``recent`` (default 0) the last tokens of the cache
written: attention leans on both. docs/FORMAT.md specifies the plane.

The C core (pca.c) writes and reads the same bytes as the numpy reference
(``kvtool.layouts.pca_reference``).
"""

from __future__ import annotations

import copy
import functools
import math
import threading
from typing import Any, Hashable, cast

import numpy as np

from kvtool import _native
from kvtool._native.core_api import NativeCore
from kvtool._native.pca_batch import PcaBatchKernel
from kvtool.dtypes import dtype_of
from kvtool.errors import DecodeError, UsageError
from kvtool.layouts import pca_reference as ref
from kvtool.layouts.base import PlaneSpec, child_name
from kvtool.layouts.lossy import LossyLayout, choice_param, finite_values, int_param
from kvtool.layouts.pca_bound import error_bound
from kvtool.modeldict import registry
from kvtool.modeldict.basis import PROB_BITS, BasisDictionary, coded_components
from kvtool.modeldict.registry import MissingDictionaryError
from kvtool.modeldict.coefficients import SYMBOLS, costs

KINDS = ("k", "v")
#: Tensor coders kept for reuse across recipes (a few models' worth of layers, keys and values, at a few steps).
CODERS = 1024
MAX_STEP = 16.0
MAX_TOKENS = 1 << 24


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(text)
    return value


class Pca(LossyLayout):
    layout_id = "pca"
    params = ("dict", "step", "kstep", "vstep", "bits", "sink", "recent")
    spec_param = "dict"
    param_types = {"dict": registry.resolve, "step": _float, "kstep": _float, "vstep": _float, "bits": _float,  # noqa: RUF012 - a ClassVar
                   "sink": int, "recent": int}
    _coders: dict[tuple[str, int], ref.Tensor]  # annotated here: __init__'s parameter ``dict`` hides the builtin

    def __init__(self, dict: str = "", step: float = 0.0, kstep: float = 0.0, vstep: float = 0.0, bits: float = 0.0,
                 sink: int = 4, recent: int = 0):
        if not isinstance(dict, str) or not registry.ID_PATTERN.match(dict):
            raise UsageError(f"layout {self.layout_id!r}: dict must be a transform dictionary's id (32 hex digits) or .kvd "
                             f"file (kvtool train --basis makes one), not {dict!r}")
        self.dict = dict
        self.step, self.kstep, self.vstep, self.bits = (_step(name, value) for name, value in
                                                       (("step", step), ("kstep", kstep), ("vstep", vstep), ("bits", bits)))
        steps = (self.kstep or self.step, self.vstep or self.step)
        if (self.bits and any((self.step, self.kstep, self.vstep))) or not (self.bits or all(steps)):
            raise UsageError(f"layout {self.layout_id!r}: give one target, step= (an error: kstep= and vstep= for one "
                             "kind) or bits= (a rate)")
        self.sink = int_param(self.layout_id, "sink", sink, 0, MAX_TOKENS)
        self.recent = int_param(self.layout_id, "recent", recent, 0, MAX_TOKENS)
        self._kind: str | None = None
        self._layer: int | None = None
        self._position = 0  # set by for_block: where the block lies in its sequence
        self._end: int | None = None
        # the coders of each tensor, shared with bound copies (copy.copy keeps the lock and the dict)
        self._lock = threading.Lock()
        self._coders = {}

    def spec(self) -> str:
        parts = [self.dict] + [f"{name}={getattr(self, name)}" for name in self.params[1:]
                               if getattr(self, name) != {"sink": 4}.get(name, 0)]
        return f"{self.layout_id}:{','.join(parts)}"

    # -- binding ------------------------------------------------------------------------------------
    def for_kind(self, kind: str, layer: int | None = None) -> "Pca":
        choice_param(self.layout_id, "kind", kind, KINDS)
        bound = copy.copy(self)
        bound._kind, bound._layer = kind, layer
        return bound

    def for_block(self, position: int, end: int) -> "Pca":
        bound = copy.copy(self)
        bound._position, bound._end = position, end
        return bound

    def dictionary(self) -> BasisDictionary:
        """The transform dictionary the recipe names; ``MissingDictionaryError`` where it is not known here."""
        found = registry.lookup(self.dict)
        if not isinstance(found, BasisDictionary):
            raise UsageError(f"layout {self.layout_id!r}: dictionary {self.dict} holds context models (ctxans), not "
                             "transform bases; kvtool train --basis makes those")
        return found

    def tensor(self, block: PlaneSpec | None = None) -> ref.Tensor:
        """The bound tensor's coder: its basis rows that are coded, its step, the coefficient tables; ``UsageError``
        where ``block``'s heads and head size are not the dictionary's."""
        if self._kind is None or self._layer is None:
            raise UsageError(f"layout {self.spec()!r} codes each tensor with its own basis: bind it with for_kind(kind, layer) "
                             "(a .kvz recipe does)")
        key = (self._kind, self._layer)
        with self._lock:
            found = self._coders.get(key)
        if found is None:
            core = cast(Hashable, _native.core())  # a module, or None
            found = _shared_coder(self.dictionary().id, self._layer, self._kind, self._relative_step(self._kind), core)
            with self._lock:
                self._coders[key] = found
        if block is not None and (block.shape[0], block.shape[2]) != (found.heads, found.dim):
            raise UsageError(f"layout {self.layout_id!r}: dictionary {self.dict[:8]} was learnt from "
                             f"{self.dictionary().describe()}; these blocks are {block.shape[0]} KV heads x "
                             f"{block.shape[2]}: a dictionary of another model")
        return found

    def _relative_step(self, kind: str) -> float:
        own = self.kstep if kind == "k" else self.vstep
        if own or self.step:
            return own or self.step
        dictionary = self.dictionary()
        rates = [math.fsum(float(t.rates[g]) for t in dictionary.tensors) / len(dictionary.tensors)
                 for g in range(len(dictionary.steps))]
        within = [g for g, rate in enumerate(rates) if rate <= self.bits]
        return float(dictionary.steps[within[0] if within else -1])

    # -- planes -------------------------------------------------------------------------------------
    def plan_plane(self, spec: PlaneSpec) -> list[PlaneSpec]:
        """The plane's size follows from the block's alone; the dictionary is looked up when a block is coded."""
        dtype = self.check_input(spec)
        heads, tokens, dim = spec.shape
        if tokens > MAX_TOKENS:
            raise UsageError(f"layout {self.layout_id!r} takes blocks of at most {MAX_TOKENS} tokens")
        size = ref.plane_size(heads, tokens, dim, dtype.itemsize)
        return [PlaneSpec(child_name(spec.name, "pca"), (size,), np.dtype(np.uint8))]

    def exact_tokens(self, tokens: int) -> np.ndarray:
        """Which of a block's tokens are kept exact: positions before ``sink`` and the cache's last ``recent``."""
        positions = np.arange(tokens, dtype=np.int64) + self._position
        exact = positions < self.sink
        if self._end is not None and self.recent:
            exact |= positions >= self._end - self.recent
        return exact

    def forward_plane(self, plane: np.ndarray) -> list[np.ndarray]:
        (spec,) = self.plan_plane(PlaneSpec.of(plane))
        block, tensor = np.ascontiguousarray(plane), self.tensor(PlaneSpec.of(plane))
        exact = self.exact_tokens(block.shape[1])
        if self._position + block.shape[1] > ref.MAX_POSITION:
            raise UsageError(f"layout {self.layout_id!r} takes sequence positions below {ref.MAX_POSITION}")
        core, name = _native.core(), dtype_of(block.dtype).name
        if core is not None and tensor.native is not None:
            out = np.zeros(spec.shape, np.uint8)
            status = core.pca_encode(_native.byte_view(block), out, tensor.native, _native.DTYPE_CODES[name], block.shape[1],
                                     self._position, exact.astype(np.uint8).tobytes())
            if status == 0:
                return [out]
        finite_values(self.layout_id, block)  # the core declines a non-finite value; the reference says so
        return [ref.encode(block, tensor, self._position, exact, spec.shape[0])]

    def inverse_plane(self, planes: list[np.ndarray], spec: PlaneSpec) -> np.ndarray:
        out = np.empty(spec.shape, spec.dtype)
        self.inverse_plane_into(planes, spec, out)
        return out

    def inverse_plane_into(self, planes: list[np.ndarray], spec: PlaneSpec, out: np.ndarray) -> None:
        tensor, core = self.tensor(spec), _native.core()
        if core is None or tensor.native is None:
            heads, tokens, dim = spec.shape
            np.copyto(out, ref.decode(planes[0], tensor, (heads, tokens, dim), spec.dtype))
            return
        status = core.pca_decode(np.ascontiguousarray(planes[0]), _native.byte_view(out), tensor.native,
                                 _native.DTYPE_CODES[dtype_of(spec.dtype).name], spec.shape[1])
        if status:
            raise DecodeError(f"pca block: {'malformed' if status == 1 else f'decoder status {status}'}")

    def batch_kernel(self, dtype: np.dtype) -> PcaBatchKernel | None:
        return PcaBatchKernel.of(dtype)

    def error_bound(self, block: np.ndarray) -> np.ndarray:
        return error_bound(block, self.tensor(PlaneSpec.of(block)), self._position, self.exact_tokens(block.shape[1]))

    def describe(self) -> dict[str, Any]:
        """The stage's basis and allocation as a reader reports them (``kvtool inspect``); ``found`` False where
        the dictionary is not known here."""
        try:
            dictionary = self.dictionary()
        except MissingDictionaryError:
            return {"dictionary": self.dict, "found": False}
        return {"dictionary": self.dict, "found": True, "learnt_from": dictionary.describe(), "rope": dictionary.rope,
                "steps": {kind: self._relative_step(kind) for kind in KINDS}, "sink": self.sink, "recent": self.recent}


def _step(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= MAX_STEP or not math.isfinite(value):
        raise UsageError(f"layout 'pca': {name} must be a number in 0..{MAX_STEP:g}, not {value!r}")
    return float(value)


@functools.lru_cache(maxsize=CODERS)
def _shared_coder(dictionary_id: str, layer: int, kind: str, relative: float, core: Hashable) -> ref.Tensor:
    """A tensor's coder, built once for every recipe and entry that names it: each .kvz or entry read parses its own
    recipe, and building 60 coders (their C tables among them) costs about as much as restoring an entry. Keyed by
    the core too, which owns the coder's tables (None: the numpy reference's alone)."""
    found = registry.lookup(dictionary_id)
    assert isinstance(found, BasisDictionary)  # the caller looked it up
    return _coder(found, layer, kind, relative, core)


def _coder(dictionary: BasisDictionary, layer: int, kind: str, relative: float, core: object) -> ref.Tensor:
    basis = dictionary.basis(layer, kind)
    if basis is None:
        raise UsageError(f"layout 'pca': dictionary {dictionary.id[:8]} ({dictionary.describe()}) has no basis for layer "
                         f"{layer}'s {'keys' if kind == 'k' else 'values'}: a dictionary of another model")
    step = np.float32(np.float64(relative) * np.float64(basis.rms))
    coded = coded_components(basis.variance, step)
    classes = dictionary.classes
    model = np.zeros(SYMBOLS, np.int64)
    model[: classes + 1] = dictionary.class_model
    freq = np.concatenate([model[None], dictionary.class_tables.astype(np.int64)])
    cum = np.cumsum(freq, axis=1) - freq
    rows = np.ascontiguousarray(basis.basis[:coded])
    frequencies = dictionary.frequencies if dictionary.rope and kind == "k" else None
    table_costs, class_costs = costs(dictionary.class_tables, PROB_BITS), costs(dictionary.class_model, PROB_BITS)
    native = None if core is None else cast(NativeCore, core).pca_model(
        basis.mean.astype("<f4").tobytes(), rows.astype("<i2").tobytes(),
        b"" if frequencies is None else frequencies.astype("<f4").tobytes(), freq[: classes + 1].astype("<u2").tobytes(),
        table_costs.astype("<i8").tobytes(), class_costs.astype("<i8").tobytes(), dictionary.heads, dictionary.dim, coded,
        classes, float(step), dictionary.tag)
    return ref.Tensor(dictionary.heads, dictionary.dim, dictionary.tag, basis.mean, rows, step, frequencies, freq.tolist(),
                      cum.tolist(), table_costs, class_costs, native)
