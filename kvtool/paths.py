"""Where kvtool finds files that are not part of the installed package.

An installed kvtool reads nothing beside its package: the sample caches and texts of a
source checkout are defaults only when kvtool runs from one (an editable install or
``PYTHONPATH``); elsewhere the commands ask for them. Libraries kvtool loads at run time
(libqatzip) live in the user's data directory, ``$XDG_DATA_HOME/kvtool``.
"""

from __future__ import annotations

import os
from pathlib import Path


def source_checkout() -> Path | None:
    """The repository root when kvtool is imported from a source checkout, else None."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").is_file() and (root / "samples").is_dir() else None


def data_home() -> Path:
    """``$XDG_DATA_HOME/kvtool`` (``~/.local/share/kvtool`` when the variable is unset or not absolute)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share") / "kvtool"
