"""The ``kvtool`` command line: one Typer app, one module per command group.

``kvtool --version`` answers before Typer or any command module is imported; the app
itself (``kvtool.cli.app``, built in :mod:`kvtool.cli.root`) imports a command's module
only when that command runs, so a command pays only for what it uses.
"""

from __future__ import annotations

import sys


def main() -> None:
    """The ``kvtool`` entry point."""
    if sys.argv[1:] == ["--version"]:
        from kvtool import __version__

        print(f"kvtool {__version__}")
        return
    from kvtool.cli.root import run

    run()


def __getattr__(name: str):
    if name == "app":
        from kvtool.cli.root import app

        return app
    raise AttributeError(f"module 'kvtool.cli' has no attribute {name!r}")
