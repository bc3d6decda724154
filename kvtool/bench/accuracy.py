"""Lossy recipes judged by the model: what a stored approximation costs the next tokens.

For each text, the model (SmolLM2 in fp32 by default, as ``kvtool.sources.hf``
loads it) prefills the first ``prefix`` tokens. Their KV cache, in bf16 as
kvtool stores a cache, is the lossless reference. Each recipe stores that
cache as a ``.kvz`` in chunks of 256 tokens, as the store keeps entries (the
ratio is the cache's bytes over the ``.kvz``'s), restores it, and the model
goes on from the restored cache two ways:

teacher-forced
    over the text's next ``positions`` tokens: the share of positions whose
    top-1 next-token prediction equals the lossless cache's (top-1
    agreement), the perplexity of the text's own tokens and its change from
    the lossless cache's, and the mean KL divergence of the lossy cache's
    next-token distribution from the lossless one's (nats per token).
greedy
    the lossless cache's greedy continuation of ``greedy`` tokens (decoded one
    step at a time) is fed after the restored cache and after the lossless one,
    each in one pass; the identical length is the number of leading positions
    where their top choices agree: how long greedy decoding from the restored
    cache reproduces the lossless continuation.

With ``split_kv`` each lossy recipe also runs with only its keys lossy, then
only its values (the other half lossless). ``layers_of`` names one recipe to
apply to a single layer's keys, or values, at a time: which layers the model
is sensitive in. Only the restored prefix differs between runs; the tokens
after it are computed by the model as usual.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, astuple, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kvtool.bench.matrix import machine
from kvtool.cache import KVCache
from kvtool.kvz import KvzReader, encode_cache
from kvtool.errors import UsageError
from kvtool.paths import source_checkout
from kvtool.recipe import DEFAULT_RECIPE, Recipe

#: The recipes measured by default: the lossless default as the reference point, then
#: each lossy family from mild to harsh.
DEFAULT_RECIPES = (
    DEFAULT_RECIPE,
    "mant-round:4|byteplane|zstd:3",
    "fp8:e4m3|exphuff",
    "fp8:e5m2|exphuff",
    "int:8,group=64|zstd:3",
    "int:6,group=64|zstd:3",
    "int:4,group=64|zstd:3",
    "int:3,group=64|zstd:3",
)
#: The entry size the store uses, so the ratios are what a store would get.
CHUNK_TOKENS = 256
#: What a recipe writes for the model dictionary of the text it runs on (``--dict-per-text``).
DICT = "{dict}"


@dataclass(frozen=True)
class Target:
    """A ratio to reach, with the accuracy it must keep (``top1`` None: not required)."""

    ratio: float
    ppl_change_pct: float
    top1: float | None = None

    def met_by(self, row: "Row") -> bool:
        top1_ok = self.top1 is None or row.top1 >= self.top1
        return row.ratio >= self.ratio and abs(row.ppl_change_pct) <= self.ppl_change_pct and top1_ok

    def describe(self) -> str:
        top1 = f", top-1 agreement >= {100 * self.top1:g}%" if self.top1 is not None else ""
        return f"ratio >= {self.ratio:g} with perplexity within {self.ppl_change_pct:g}%{top1}, pooled and on every text"


TARGETS = (Target(2.0, 1.0, 0.99), Target(3.0, 1.0, 0.99), Target(5.0, 2.0, 0.97))


@dataclass
class Effect:
    """What a restored cache does to the teacher-forced predictions, against the lossless cache."""

    top1: float
    ppl: float
    ppl_change_pct: float
    kl: float


@dataclass
class Row:
    """One recipe on one text, or pooled over the texts (``text`` ``"all"``)."""

    text: str
    recipe: str
    lossy: bool
    positions: int
    raw_bytes: int
    stored_bytes: int
    ratio: float
    top1: float
    ppl: float
    ppl_change_pct: float
    kl: float
    greedy_identical: int  # the least over the texts when pooled
    greedy_tokens: int
    max_abs_error: float = 0.0
    rel_rms_error: float = 0.0  # RMS error over RMS value, over all tensors
    dictionary: str = ""  # the model dictionary a ``{dict}`` recipe coded this text with
    keys_only: Effect | None = None
    values_only: Effect | None = None


@dataclass
class Report:
    machine: dict[str, Any]
    settings: dict[str, Any]
    texts: list[dict[str, Any]]
    rows: list[Row]
    pooled: list[Row]
    layers: list[dict[str, Any]] = field(default_factory=list)
    targets: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class _Sums:
    """Per-position sums over one teacher-forced run, so runs pool over texts."""

    positions: int
    agree: int
    nll: float
    reference_nll: float
    kl: float

    def __add__(self, other: "_Sums") -> "_Sums":
        return _Sums(*(a + b for a, b in zip(astuple(self), astuple(other))))

    def effect(self) -> Effect:
        n = max(self.positions, 1)
        return Effect(
            top1=round(self.agree / n, 6),
            ppl=round(math.exp(self.nll / n), 6),
            ppl_change_pct=round(100 * math.expm1((self.nll - self.reference_nll) / n), 4),
            kl=round(self.kl / n, 8),
        )


class _Text:
    """One text's lossless reference: its prefix cache, the model's outputs from it, its greedy continuation."""

    def __init__(self, engine, name: str, tokens: list[int], prefix: int, positions: int, greedy: int):
        import torch

        self.engine, self.name, self.torch = engine, name, torch
        _, _, self.cache = engine.recompute(tokens[:prefix])
        self.fed = tokens[prefix : prefix + positions]
        self.targets = torch.tensor(tokens[prefix + 1 : prefix + positions + 1])
        reference = engine.continuation_logits(self.cache, self.fed)
        self.reference_logp = torch.log_softmax(reference, -1)
        self.reference_top1 = reference.argmax(-1)
        self.reference_nll = float(-self.reference_logp[torch.arange(positions), self.targets].sum())
        self.greedy = engine.greedy(self.cache, tokens[prefix], greedy)
        self.greedy_fed = [tokens[prefix], *self.greedy[:-1]]
        self.greedy_top1 = engine.continuation_logits(self.cache, self.greedy_fed).argmax(-1)

    def sums(self, restored: KVCache) -> _Sums:
        torch = self.torch
        logits = self.engine.continuation_logits(restored, self.fed)
        logp = torch.log_softmax(logits, -1)
        n = len(self.fed)
        return _Sums(
            positions=n,
            agree=int((logits.argmax(-1) == self.reference_top1).sum()),
            nll=float(-logp[torch.arange(n), self.targets].sum()),
            reference_nll=self.reference_nll,
            kl=float((self.reference_logp.exp() * (self.reference_logp - logp)).sum()),
        )

    def greedy_identical(self, restored: KVCache) -> int:
        """How many of the lossless greedy tokens the restored cache's greedy choice reproduces before the first difference.

        Both caches are fed the lossless greedy continuation in one pass and
        their top choices compared, so the lossless cache matches itself exactly.
        """
        chosen = self.engine.continuation_logits(restored, self.greedy_fed).argmax(-1)
        return next((i for i, same in enumerate((chosen == self.greedy_top1).tolist()) if not same), len(self.greedy))


def restore(cache: KVCache, recipe: str) -> tuple[KVCache, int, dict[str, Any] | None]:
    """``cache`` stored with ``recipe`` and read back: the restored cache, the .kvz's size, its lossy marker."""
    blob = encode_cache(cache, recipe, chunk_tokens=CHUNK_TOKENS)
    with KvzReader.from_bytes(blob) as reader:
        return reader.read(), len(blob), reader.lossy


def mixed(base: KVCache, other: KVCache, keys_from: Sequence[int] = (), values_from: Sequence[int] = ()) -> KVCache:
    """``base`` with the keys of the layers at ``keys_from`` and the values at ``values_from`` taken from ``other``."""
    keys = [other.keys[i] if i in keys_from else k for i, k in enumerate(base.keys)]
    values = [other.values[i] if i in values_from else v for i, v in enumerate(base.values)]
    return KVCache(keys, values, base.model, dict(base.provenance), layer_ids=list(base.layer_ids))


def run_accuracy(
    texts: Sequence[Path],
    recipes: Sequence[str] = DEFAULT_RECIPES,
    prefix: int = 1024,
    positions: int = 256,
    greedy: int = 128,
    split_kv: bool = True,
    layers_of: str | None = None,
    model: str | None = None,
    on_step: Callable[[str], None] | None = None,
    dict_per_text: str | None = None,
) -> Report:
    """Every recipe on every text (see the module docstring); ``on_step`` hears each finished run.

    ``dict_per_text`` names a model dictionary for each text (``{text}`` standing for the text's name
    without its suffix, as ``out/basis-without-{text}.kvd``): a recipe's ``{dict}`` is that dictionary, so
    each text is coded with one learnt from other texts. Rows keep the recipe as written.
    """
    if prefix < 1 or positions < 1 or greedy < 1:
        raise UsageError("--prefix, --positions and --greedy must be at least 1")
    specs = list(dict.fromkeys(_normalised(r) for r in recipes))
    if any(DICT in spec for spec in specs) and dict_per_text is None:
        raise UsageError(f"a recipe names {DICT}: give --dict-per-text, the dictionary of each text")
    if layers_of is not None:
        layers_of = Recipe.parse(layers_of).spec()
    from kvtool.bench.ttft_hf import HFEngine

    engine = HFEngine(model)
    step = on_step or (lambda _: None)
    rows: list[Row] = []
    sums: dict[str, dict[str, _Sums]] = {}  # recipe -> part ("all", "keys", "values") -> sums over the texts
    infos, layers = [], []
    for path in texts:
        tokens = engine.tokenize(Path(path).read_text(encoding="utf-8"))
        needed = prefix + positions + 1
        if len(tokens) < needed:
            raise UsageError(f"{path}: {len(tokens)} tokens, but --prefix {prefix} and --positions {positions} need {needed}")
        started = time.perf_counter()
        text = _Text(engine, Path(path).name, tokens, prefix, positions, greedy)
        infos.append({"text": _shown(Path(path)), "tokens": len(tokens), "reference_ppl": round(math.exp(text.reference_nll / positions), 6),
                      "reference_seconds": round(time.perf_counter() - started, 1)})
        step(f"{text.name}: lossless reference")
        dictionary = _dictionary_of(Path(path), dict_per_text) if dict_per_text else ""
        for spec in specs:
            row, parts = _measure(text, spec, split_kv, dictionary)
            rows.append(row)
            by_part = sums.setdefault(spec, {})
            for part, run in parts.items():
                by_part[part] = by_part[part] + run if part in by_part else run
            step(f"{text.name}: {spec}")
        if layers_of is not None:
            layers += _layer_sensitivity(text, layers_of, step)
    settings = {
        "model": engine.model_id, "prefix": prefix, "positions": positions, "greedy": greedy,
        "chunk_tokens": CHUNK_TOKENS, "cache_dtype": "bf16", "split_kv": split_kv, "layers_of": layers_of,
        "dict_per_text": dict_per_text,
    }
    pooled = [_pooled([r for r in rows if r.recipe == spec], sums[spec]) for spec in specs]
    return Report(machine(), settings, infos, rows, pooled, layers, [verdict(t, pooled, rows) for t in TARGETS])


def _shown(path: Path) -> str:
    """A text's path as the report records it: inside the source checkout relative to it, so a
    report names no machine's folders; elsewhere as given."""
    checkout = source_checkout()
    resolved = path.resolve()
    return str(resolved.relative_to(checkout)) if checkout is not None and resolved.is_relative_to(checkout) else str(path)


def verdict(target: Target, pooled: list[Row], rows: list[Row]) -> dict[str, Any]:
    """Which lossy recipes meet ``target``, pooled and on each text alone; where none does, the nearest misses on each side.

    Pooling alone would let a recipe pass on an average that one text fails.
    """

    def meets(goal: Target, row: Row) -> bool:
        return goal.met_by(row) and all(goal.met_by(r) for r in rows if r.recipe == row.recipe)

    lossy = [r for r in pooled if r.lossy]
    accurate = [r for r in lossy if meets(Target(0.0, target.ppl_change_pct, target.top1), r)]
    big = [r for r in lossy if r.ratio >= target.ratio]
    result: dict[str, Any] = {"target": target.describe(), "met_by": [r.recipe for r in lossy if meets(target, r)]}
    if not result["met_by"]:
        result["most_compact_accurate_enough"] = max(accurate, key=lambda r: r.ratio).recipe if accurate else None
        result["most_accurate_large_enough"] = min(big, key=lambda r: abs(r.ppl_change_pct)).recipe if big else None
    return result


def _normalised(recipe: str) -> str:
    """A recipe's canonical spec; one naming ``{dict}`` as written (it is a recipe once a text's dictionary is in)."""
    return recipe.strip() if DICT in recipe else Recipe.parse(recipe).spec()


def _dictionary_of(text: Path, pattern: str) -> str:
    """The id of the dictionary ``pattern`` names for ``text``, loaded."""
    from kvtool.modeldict import registry

    path = Path(pattern.replace("{text}", text.name.rsplit(".", 1)[0]))
    if not path.is_file():
        raise UsageError(f"--dict-per-text: no dictionary {path} for {text.name}")
    return registry.load(path).id


def _measure(text: _Text, spec: str, split_kv: bool, dictionary: str = "") -> tuple[Row, dict[str, _Sums]]:
    """The row of one recipe on one text, and its sums per part (all lossy; only keys; only values); a ``{dict}``
    in the recipe is ``dictionary``."""
    used = dictionary if DICT in spec else ""
    restored, stored, marker = restore(text.cache, spec.replace(DICT, dictionary))
    parts = {"all": text.sums(restored)}
    if split_kv and marker is not None:
        everything = range(text.cache.num_layers)
        parts["keys"] = text.sums(mixed(text.cache, restored, keys_from=everything))
        parts["values"] = text.sums(mixed(text.cache, restored, values_from=everything))
    row = _row(text.name, spec, marker, text.cache.nbytes, stored, parts, text.greedy_identical(restored), len(text.greedy))
    row.dictionary = used
    return row, parts


def _row(text: str, spec: str, marker, raw: int, stored: int, parts: dict[str, _Sums], identical: int, greedy: int) -> Row:
    errors = (marker or {}).get("error", [])
    return Row(
        text=text, recipe=spec, lossy=marker is not None, positions=parts["all"].positions,
        raw_bytes=raw, stored_bytes=stored, ratio=round(raw / stored, 4), **asdict(parts["all"].effect()),
        greedy_identical=identical, greedy_tokens=greedy,
        max_abs_error=max((e["max_abs"] for e in errors), default=0.0),
        rel_rms_error=round(math.sqrt(sum(e["rel_rms"] ** 2 for e in errors) / len(errors)), 6) if errors else 0.0,
        keys_only=parts["keys"].effect() if "keys" in parts else None,
        values_only=parts["values"].effect() if "values" in parts else None,
    )


def _layer_sensitivity(text: _Text, spec: str, step: Callable[[str], None]) -> list[dict[str, Any]]:
    """``spec`` applied to one layer's keys, or values, at a time: what each costs."""
    restored, _, _ = restore(text.cache, spec)
    out = []
    for i, layer in enumerate(text.cache.layer_ids):
        for kind in ("k", "v"):
            trial = mixed(text.cache, restored, keys_from=[i] if kind == "k" else (), values_from=[i] if kind == "v" else ())
            out.append({"text": text.name, "recipe": spec, "layer": layer, "kind": kind, **asdict(text.sums(trial).effect())})
        step(f"{text.name}: {spec} on layer {layer}")
    return out


def _pooled(rows: list[Row], parts: dict[str, _Sums]) -> Row:
    """One recipe's rows over every text as one: sizes and positions summed, the least identical greedy length."""
    pooled = _row("all", rows[0].recipe, None, sum(r.raw_bytes for r in rows), sum(r.stored_bytes for r in rows), parts,
                  min(r.greedy_identical for r in rows), rows[0].greedy_tokens)
    pooled.lossy = rows[0].lossy
    pooled.max_abs_error = max(r.max_abs_error for r in rows)
    pooled.rel_rms_error = round(math.sqrt(sum(r.rel_rms_error ** 2 for r in rows) / len(rows)), 6)
    return pooled
