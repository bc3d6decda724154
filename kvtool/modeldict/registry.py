"""Finding model dictionaries by their id.

A ``.kvz`` file or store entry coded with a dictionary names it by id (a hash
of its content), so any copy of the right dictionary decodes it and no other
can. ``lookup`` finds one, in this order: dictionaries registered in this
process (``register``, ``load``); ``.kvd`` files on the dictionary path (the
``KVTOOL_DICT_PATH`` environment variable: directories or files separated by
``os.pathsep``, then the dictionaries kvtool ships); then the sources attached
with ``attach`` (a store that keeps dictionaries beside its entries,
``kvtool.store.dicts``).
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Callable, Union

from kvtool.errors import UnavailableError, UsageError
from kvtool.modeldict import filehead
from kvtool.modeldict.basis import BasisDictionary
from kvtool.modeldict.filehead import DictionaryError
from kvtool.modeldict.format import Dictionary

PATH_VARIABLE = "KVTOOL_DICT_PATH"
BUILTIN_DIR = Path(__file__).parent
#: The dictionary ``ctxans`` uses when a recipe names none: learnt from the committed samples.
DEFAULT_FILE = BUILTIN_DIR / "default.kvd"
MAX_FILE = filehead.MAX_FILE
ID_PATTERN = re.compile(r"^[0-9a-f]{32}$")
PREFIX_PATTERN = re.compile(r"^[0-9a-f]{8,32}$")

Source = Callable[[str], "bytes | None"]
#: Either kind of model dictionary: context models (version 1) or transform bases (version 2).
AnyDictionary = Union[Dictionary, BasisDictionary]

_lock = threading.Lock()
_known: dict[str, AnyDictionary] = {}
_files: dict[Path, tuple[tuple[int, int], str | None]] = {}  # path -> ((mtime_ns, size), id or None when unreadable)
_sources: list[Source] = []


class MissingDictionaryError(UnavailableError):
    """A recipe or a file names a dictionary that is not known here."""


def parse(data: bytes | bytearray | memoryview) -> AnyDictionary:
    """A ``.kvd`` file's dictionary, of the kind its version says (``DictionaryError`` if it is not one)."""
    return (BasisDictionary if filehead.version_of(data) == 2 else Dictionary).from_bytes(data)


def register(dictionary: AnyDictionary) -> str:
    """Make ``dictionary`` known to this process; returns its id."""
    with _lock:
        _known.setdefault(dictionary.id, dictionary)
    return dictionary.id


def read_file(path: str | os.PathLike[str]) -> AnyDictionary:
    """Read and validate a ``.kvd`` file (``DictionaryError`` if it is not one)."""
    path = Path(path)
    if path.stat().st_size > MAX_FILE:
        raise DictionaryError(f"{path}: larger than any dictionary ({MAX_FILE} bytes)")
    try:
        return parse(path.read_bytes())
    except DictionaryError as exc:
        raise DictionaryError(f"{path}: {exc}") from None


def load(path: str | os.PathLike[str]) -> AnyDictionary:
    """Read a ``.kvd`` file and register it."""
    dictionary = read_file(path)
    register(dictionary)
    return dictionary


def attach(source: Source) -> None:
    """Let ``lookup`` ask ``source(id)`` for the bytes of dictionaries it does not know (once per source)."""
    with _lock:
        if source not in _sources:
            _sources.append(source)


def detach(source: Source) -> None:
    with _lock:
        if source in _sources:
            _sources.remove(source)


def context_models(id_: str) -> Dictionary:
    """The dictionary with id ``id_``, which must hold context models (what ``ctxans`` and ``ctxtans`` code with)."""
    found = lookup(id_)
    if not isinstance(found, Dictionary):
        raise UsageError(f"dictionary {id_} holds transform bases (the pca stage's), not the context models ctxans needs")
    return found


def default_id() -> str:
    return load(DEFAULT_FILE).id


def lookup(id_: str) -> AnyDictionary:
    """The dictionary with id ``id_``; ``MissingDictionaryError`` if none is found."""
    if not ID_PATTERN.match(id_):
        raise UsageError(f"a dictionary id is 32 lowercase hex digits, not {id_!r}")
    with _lock:
        found = _known.get(id_)
    if found is not None:
        return found
    _scan_path()
    with _lock:
        found = _known.get(id_)
        sources = list(_sources)
    if found is not None:
        return found
    for source in sources:
        data = source(id_)
        if data is None:
            continue
        try:
            dictionary = parse(data)
        except DictionaryError:
            continue  # a damaged copy is as good as none
        if dictionary.id == id_:
            register(dictionary)
            return dictionary
    raise MissingDictionaryError(
        f"dictionary {id_} is not known here: put its .kvd file on {PATH_VARIABLE} (or, for kvtool's "
        "commands, beside the file or named with --dict FILE.kvd), name it in the recipe (ctxans:FILE.kvd, "
        "pca:FILE.kvd), or open the store that holds it"
    )


def resolve(arg: str) -> str:
    """The id a recipe's ``ctxans:ARG`` stands for: a ``.kvd`` file (read and registered), or an id or a prefix of one."""
    if arg.endswith(".kvd") or os.sep in arg or (os.altsep and os.altsep in arg):
        path = Path(arg).expanduser()
        if not path.is_file():
            raise UsageError(f"no dictionary file {arg}")
        return load(path).id
    arg = arg.lower()
    if not PREFIX_PATTERN.match(arg):
        raise UsageError(f"a dictionary is named by its .kvd file or its id (8 to 32 hex digits), not {arg!r}")
    if ID_PATTERN.match(arg):
        return arg
    _scan_path()
    with _lock:
        matches = sorted(i for i in _known if i.startswith(arg))
    if not matches:
        raise MissingDictionaryError(f"no known dictionary's id starts with {arg}: put its .kvd file on {PATH_VARIABLE} or name the file")
    if len(matches) > 1:
        raise UsageError(f"dictionary id prefix {arg!r} matches {len(matches)} known dictionaries; give more digits")
    return matches[0]


def known() -> list[AnyDictionary]:
    """Every dictionary registered or on the dictionary path."""
    _scan_path()
    with _lock:
        return sorted(_known.values(), key=lambda d: d.id)


def search_path() -> list[Path]:
    """The directories and files searched for ``.kvd`` files, in order."""
    entries = [Path(p).expanduser() for p in os.environ.get(PATH_VARIABLE, "").split(os.pathsep) if p]
    return entries + [BUILTIN_DIR]


def _scan_path() -> None:
    """Register every readable ``.kvd`` file on the search path (each file read once while unchanged)."""
    for entry in search_path():
        files = sorted(entry.glob("*.kvd")) if entry.is_dir() else [entry] if entry.is_file() else []
        for path in files:
            try:
                stat = path.stat()
            except OSError:
                continue
            stamp = (stat.st_mtime_ns, stat.st_size)
            with _lock:
                cached = _files.get(path)
            if cached is not None and cached[0] == stamp:
                continue
            try:
                id_ = load(path).id
            except (DictionaryError, OSError):
                id_ = None  # not a dictionary: skipped, not fatal for the others
            with _lock:
                _files[path] = (stamp, id_)
