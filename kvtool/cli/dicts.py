"""Where the commands that decode find the model dictionaries (.kvd) a ``ctxans`` file needs.

Besides what the library searches (``KVTOOL_DICT_PATH``, the shipped dictionary, a store
that holds its dictionaries), a command finds a dictionary named with ``--dict FILE.kvd``
and one lying beside its input, where ``kvtool train -o`` and ``kvtool compress`` leave
them in the usual case. A ``.kvd`` beside the input is read only when the input needs a
dictionary that is not known otherwise; a damaged or foreign one is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Optional

import typer

from kvtool.cli._common import existing_file
from kvtool.errors import UsageError

DICT_OPTION = typer.Option(
    None, "--dict", show_default=False,
    help="A model dictionary (.kvd) the input was coded with (repeatable). Without it one is found "
    "beside the input, on KVTOOL_DICT_PATH, or in the store that holds the input.",
)

#: A folder with more .kvd files than this is not searched beyond them (each read is bounded too).
MAX_BESIDE = 64


def use_dictionaries(inputs: Iterable[Path], named: Optional[List[Path]]) -> None:
    """Make the ``--dict`` files known, and let lookups search the folders of ``inputs``."""
    from kvtool.modeldict import registry
    from kvtool.modeldict.format import DictionaryError

    for path in named or []:
        existing_file(path)
        try:
            registry.load(path)
        except DictionaryError as exc:
            raise UsageError(f"--dict {path} is not a model dictionary: {exc}") from None
    for folder in sorted({Path(p).absolute().parent for p in inputs}):
        registry.attach(_Beside(folder))


@dataclass(frozen=True)
class _Beside:
    """``registry.attach``'s source for the ``.kvd`` files of one folder."""

    folder: Path

    def __call__(self, dictionary_id: str) -> bytes | None:
        from kvtool.modeldict import registry
        from kvtool.modeldict.format import DictionaryError

        for path in sorted(self.folder.glob("*.kvd"))[:MAX_BESIDE]:
            try:
                dictionary = registry.read_file(path) if path.is_file() else None
            except (DictionaryError, OSError):
                continue
            if dictionary is not None and dictionary.id == dictionary_id:
                return dictionary.to_bytes()
        return None
