"""Another build of kvtool's core beside this tree's, for benchmarks that time a change to the core before and
after in one process, rounds alternated, so that the machine's load falls on both alike.

A build is a ``_core*.so`` made from another commit with ``python setup.py build_ext --inplace``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from kvtool import _native


def load_core(path: Path) -> ModuleType:
    """A build of kvtool's core loaded from ``path``, beside this tree's own."""
    spec = importlib.util.spec_from_file_location("_core", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"not an extension module: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def use_core(module: ModuleType) -> None:
    """Every kvtool call from here on runs ``module`` as its core."""
    _native._load = lambda: (module, "")  # type: ignore[assignment]
