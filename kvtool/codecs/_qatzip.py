"""A ctypes binding to Intel QATzip (``libqatzip.so.3``, QATzip >= 1.2): finding and loading it, once.

Only what the qat codec needs: find and load the library (this module), keep
one deflate session per thread and parameter set and compress a buffer in one
call (``_qatzip_session``), against the C interface of ``qatzip.h``
(``_qatzip_abi``), with the software fallback's flaws worked around
(``_qatzip_fallback``). ``load`` says why when the library cannot be used.

Where the library comes from, first match wins:

1. ``$KVTOOL_QATZIP_LIB``, a path; when set it is the only place tried.
2. The system loader (``ld.so.cache``, ``LD_LIBRARY_PATH``).
3. ``$XDG_DATA_HOME/kvtool/qatzip/usr/lib/*/`` (``~/.local/share/kvtool/qatzip``), filled by
   ``scripts/install-qatzip.sh``.
4. In a source checkout, ``<repo>/.local/qatzip/usr/lib/*/``, where that script unpacked it before.
"""

from __future__ import annotations

import ctypes
import gzip
import os
import re
import threading
from ctypes import POINTER, byref, c_char_p, c_void_p
from pathlib import Path

from kvtool.codecs._qatzip_abi import declare
from kvtool.codecs._qatzip_session import Library
from kvtool.errors import UnavailableError
from kvtool.paths import data_home, source_checkout

ENV_VAR = "KVTOOL_QATZIP_LIB"
SONAME = "libqatzip.so.3"
# libqatzip needs libqat, which needs libusdm: loaded first, in this order, from the same folder.
_DEPENDENCIES = ("libusdm.so.0", "libqat.so.4")


class _DlInfo(ctypes.Structure):  # dladdr's Dl_info
    _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p), ("dli_saddr", c_void_p)]


_lock = threading.Lock()
_loaded: Library | UnavailableError | None = None


def load() -> Library:
    """The process's libqatzip, loaded once; raises ``UnavailableError`` saying why not."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                cdll = _open()
                declare(cdll)
                path = _loaded_path(cdll)
                _loaded = Library(cdll, path, _package_version(Path(path)))
            except UnavailableError as exc:
                _loaded = exc
    if isinstance(_loaded, UnavailableError):
        raise _loaded
    return _loaded


def _open() -> ctypes.CDLL:
    env = os.environ.get(ENV_VAR)
    if env:
        return _open_path(Path(env), f"{ENV_VAR}={env}")
    try:
        return ctypes.CDLL(SONAME)
    except OSError as exc:
        system_error = str(exc)
    roots = _unpacked_roots()
    for candidate in (path for root in roots for path in sorted(root.glob(f"usr/lib/*/{SONAME}"))):
        return _open_path(candidate, str(candidate))
    raise UnavailableError(
        f"{SONAME} not found ({system_error}; nothing under {' or '.join(map(str, roots))}); "
        f"run scripts/install-qatzip.sh or set {ENV_VAR} to its path"
    )


def _unpacked_roots() -> list[Path]:
    """Where scripts/install-qatzip.sh unpacks QATzip: the user's data directory, and a checkout's .local."""
    checkout = source_checkout()
    return [data_home() / "qatzip"] + ([checkout / ".local" / "qatzip"] if checkout else [])


def _open_path(path: Path, origin: str) -> ctypes.CDLL:
    if not path.is_file():
        raise UnavailableError(f"{origin}: no such file")
    try:
        for dep in _DEPENDENCIES:
            if (path.parent / dep).is_file():
                ctypes.CDLL(str(path.parent / dep), mode=ctypes.RTLD_GLOBAL)
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise UnavailableError(f"{origin}: cannot load ({exc})") from None


def _loaded_path(cdll: ctypes.CDLL) -> str:
    """The file the dynamic loader picked for ``cdll``."""
    info = _DlInfo()
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        return cdll._name
    dladdr.argtypes = [c_void_p, POINTER(_DlInfo)]
    if dladdr(ctypes.cast(cdll.qzInit, c_void_p), byref(info)) and info.dli_fname:
        return os.fsdecode(info.dli_fname)
    return cdll._name


def _package_version(lib_path: Path) -> str | None:
    """QATzip's release from the Debian/Ubuntu package changelog next to the library.

    QATzip has no version call (``qzGetSoftwareComponentVersionList`` returns
    QZ_FAIL in 1.2 and 1.3), so the package's own record is the best source.
    """
    lib_dir = lib_path.resolve().parent
    for prefix in (lib_dir.parent, lib_dir.parent.parent):
        changelog = prefix / "share" / "doc" / "libqatzip3" / "changelog.Debian.gz"
        try:
            with gzip.open(changelog, "rt", encoding="utf-8") as f:
                first = f.readline()
        except OSError:
            continue
        match = re.match(r"\S+ \((?:\d+:)?([^)\s-]+)", first)
        if match:
            return match.group(1)
    return None
