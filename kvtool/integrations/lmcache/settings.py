"""The adapter's options, as LMCache passes them (``adapter_params`` of the ``--l2-adapter`` JSON).

``store`` (required) is any kvtool store URL, ``recipe`` the recipe each chunk is
coded with (default: kvtool's default lossless recipe), ``dictionary`` a ``.kvd``
model dictionary for a ``ctxans`` or ``ctxtans`` recipe, ``workers`` the threads that encode and
decode chunks. Checked once, at startup, with one clear line per mistake.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvtool.errors import UsageError
from kvtool.recipe import DEFAULT_RECIPE, Recipe

OPTIONS = ("store", "recipe", "dictionary", "workers")
MAX_WORKERS = 64


@dataclass(frozen=True)
class AdapterSettings:
    store: str
    recipe: str = DEFAULT_RECIPE
    dictionary: str | None = None
    workers: int = 2

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> "AdapterSettings":
        if not isinstance(params, Mapping):
            raise UsageError("kvtool L2 adapter: adapter_params must be a JSON object")
        unknown = sorted(set(params) - set(OPTIONS))
        if unknown:
            raise UsageError(f"kvtool L2 adapter: unknown option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}")
        store = params.get("store")
        if not isinstance(store, str) or not store.strip():
            raise UsageError("kvtool L2 adapter: 'store' must be a kvtool store URL, e.g. file:///var/cache/kvtool")
        recipe = params.get("recipe", DEFAULT_RECIPE)
        if not isinstance(recipe, str):
            raise UsageError(f"kvtool L2 adapter: 'recipe' must be a recipe spec, not {recipe!r}")
        recipe = Recipe.parse(recipe).spec()
        dictionary = params.get("dictionary")
        if dictionary is not None:
            if not isinstance(dictionary, str) or not Path(dictionary).is_file():
                raise UsageError(f"kvtool L2 adapter: 'dictionary' must be a .kvd file, not {dictionary!r}")
            if not Recipe.parse(recipe).codec.uses_dictionary:
                raise UsageError(f"kvtool L2 adapter: a dictionary needs a recipe whose codec codes with one (such as "
                                 f"ctxtans), not {recipe!r}")
        workers = params.get("workers", 2)
        if type(workers) is not int or not 1 <= workers <= MAX_WORKERS:
            raise UsageError(f"kvtool L2 adapter: 'workers' must be 1 to {MAX_WORKERS}, not {workers!r}")
        return cls(store, recipe, dictionary, workers)
