"""A ctypes binding to Intel QATzip (``libqatzip.so.3``, QATzip >= 1.2).

Only what the qat codec needs: find and load the library, keep one deflate
session per thread and parameter set, and compress a buffer in one call.
Struct layouts follow ``include/qatzip.h`` of QATzip 1.2 and 1.3 as
distributions build it (without ``ERR_INJECTION``); the defaults the library
fills in are checked before use, so a different layout is reported as
unavailable instead of corrupting memory.

Where the library comes from, first match wins:

1. ``$KVTOOL_QATZIP_LIB``, a path; when set it is the only place tried.
2. The system loader (``ld.so.cache``, ``LD_LIBRARY_PATH``).
3. ``$XDG_DATA_HOME/kvtool/qatzip/usr/lib/*/`` (``~/.local/share/kvtool/qatzip``), filled by
   ``scripts/install-qatzip.sh``.
4. In a source checkout, ``<repo>/.local/qatzip/usr/lib/*/``, where that script unpacked it before.

Sessions are opened with software backup, so without a QAT device QATzip
compresses in software (zlib) and still writes its own gzip format. That
fallback has two flaws kvtool works around, each only where it is safe:

- It leaks a pthread key per call. With libqatzip 1.3.1 exactly, whose private
  ``g_process`` layout is known (and its size is confirmed by ``nm -D``), the
  key is deleted after each call (``_KeyReclaimer``); with any other version a
  process stops calling the fallback after ``SOFTWARE_CALL_BUDGET`` calls.
- libqat prints "Cannot open /dev/vfio" on every call. Dropping that line means
  pointing file descriptor 2 at a temporary file during the call, which hides
  every other thread's stderr meanwhile, so it is done only when the caller is
  the process's only Python thread, or when ``KVTOOL_QATZIP_FILTER_STDERR=1``
  asks for it (``0`` turns it off).

``kvtool codecs`` reports which of them run (``Library.workarounds``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gzip
import os
import re
import subprocess
import sys
import tempfile
import threading
import weakref
from ctypes import POINTER, byref, c_char_p, c_int, c_long, c_ubyte, c_uint, c_ulong, c_void_p
from pathlib import Path

import numpy as np

from kvtool.errors import KvtoolError, UnavailableError
from kvtool.paths import data_home, source_checkout

ENV_VAR = "KVTOOL_QATZIP_LIB"
FILTER_ENV_VAR = "KVTOOL_QATZIP_FILTER_STDERR"  # "1": always, "0": never, unset: single-threaded callers only
RECLAIM_VERSION = "1.3.1"  # the only libqatzip whose g_process layout _KeyReclaimer knows
SONAME = "libqatzip.so.3"
# libqatzip needs libqat, which needs libusdm: loaded first, in this order, from the same folder.
_DEPENDENCIES = ("libusdm.so.0", "libqat.so.4")

# Values from qatzip.h.
DEFAULT_HW_BUFFER_SIZE = 64 * 1024  # QZ_HW_BUFF_SZ
MIN_HW_BUFFER_SIZE = 1024  # QZ_HW_BUFF_MIN_SZ
MAX_HW_BUFFER_SIZE = 512 * 1024  # QZ_HW_BUFF_MAX_SZ
QZ_OK = 0
QZ_DIR_COMPRESS = 0
QZ_DEFLATE_GZIP_EXT = 2
QZ_DEFLATE = 8
_LOG_NONE = 0
_STATUS = {
    -1: "QZ_PARAMS", -2: "QZ_FAIL", -3: "QZ_BUF_ERROR", -4: "QZ_DATA_ERROR", -5: "QZ_TIMEOUT",
    11: "QZ_NO_HW", 12: "QZ_NO_MDRV", 13: "QZ_NO_INST_ATTACH", 14: "QZ_LOW_MEM", 15: "QZ_LOW_DEST_MEM",
    16: "QZ_UNSUPPORTED_FMT", -101: "QZ_NOSW_NO_HW", -102: "QZ_NOSW_NO_MDRV", -103: "QZ_NOSW_NO_INST_ATTACH",
    -104: "QZ_NOSW_LOW_MEM", -105: "QZ_NO_SW_AVAIL", -116: "QZ_NOSW_UNSUPPORTED_FMT",
}
# One qzCompress call per gigabyte at most: lengths are 32-bit, and each call
# writes a complete gzip member, so larger input becomes several members.
_MAX_CALL = 1 << 30


class _Session(ctypes.Structure):  # QzSession_T
    _fields_ = [
        ("hw_session_stat", c_long),
        ("thd_sess_stat", c_int),
        ("internal", c_void_p),
        ("total_in", c_ulong),
        ("total_out", c_ulong),
    ]


class _ParamsCommon(ctypes.Structure):  # QzSessionParamsCommon_T
    _fields_ = [
        ("direction", c_int),
        ("comp_lvl", c_uint),
        ("comp_algorithm", c_ubyte),
        ("max_forks", c_uint),
        ("sw_backup", c_ubyte),
        ("hw_buff_sz", c_uint),
        ("strm_buff_sz", c_uint),
        ("input_sz_thrshold", c_uint),
        ("req_cnt_thrshold", c_uint),
        ("wait_cnt_thrshold", c_uint),
        ("polling_mode", c_int),
        ("is_sensitive_mode", c_uint),
    ]


class _ParamsDeflate(ctypes.Structure):  # QzSessionParamsDeflate_T, plus slack against a larger build
    _fields_ = [("common_params", _ParamsCommon), ("huffman_hdr", c_int), ("data_fmt", c_int), ("_slack", c_ubyte * 64)]


class _DlInfo(ctypes.Structure):  # dladdr's Dl_info
    _fields_ = [("dli_fname", c_char_p), ("dli_fbase", c_void_p), ("dli_sname", c_char_p), ("dli_saddr", c_void_p)]


def _status_name(rc: int) -> str:
    return _STATUS.get(rc, f"status {rc}")


#: Without a device, each qzCompress of libqatzip 1.3 re-runs its hardware probe, which
#: creates a pthread key and never deletes it. A process has 1024 such keys; once they are
#: gone, any library that creates one fails (Rust's thread locals abort the process).
#: Where kvtool knows the library's layout it deletes that key after each call (see
#: ``_KeyReclaimer``); elsewhere, after this many software-fallback calls a process stops
#: calling QATzip (see QatCodec.encode).
SOFTWARE_CALL_BUDGET = 512


class Library:
    """A loaded libqatzip: where it is, which version, hardware or not, and ``compress``."""

    def __init__(self, cdll: ctypes.CDLL):
        self._cdll = cdll
        self._declare()
        self._defaults = self._read_defaults()
        self._local = threading.local()
        self.path = _loaded_path(cdll)
        self.version = _package_version(Path(self.path))
        # The first session tells whether QATzip attached to a device or fell back to software.
        probe = self._sessions().get(self, 1, self._defaults.common_params.hw_buff_sz)
        self.hardware = probe.hw_session_stat == QZ_OK
        self.session_status = _status_name(probe.hw_session_stat)
        self.software_calls = 0  # see SOFTWARE_CALL_BUDGET
        self._reclaimer = None if self.hardware else _KeyReclaimer.attach(cdll, self.version)

    @property
    def implementation(self) -> str:
        where = f"libqatzip {self.version or '(version unknown)'} at {self.path}"
        return f"QAT hardware ({where})" if self.hardware else f"QATzip software fallback ({where})"

    def workarounds(self) -> dict[str, str]:
        """Which software-fallback workarounds run here, in words (for ``kvtool codecs``)."""
        if self.hardware:
            return {"thread_keys": "not needed (QAT device)", "stderr_filter": "not needed (QAT device)"}
        keys = (
            f"deleted after each call (libqatzip {RECLAIM_VERSION} layout)" if self._reclaimer is not None
            else f"leaked by libqatzip {self.version or '(version unknown)'}: zlib after {SOFTWARE_CALL_BUDGET} calls"
        )
        setting = os.environ.get(FILTER_ENV_VAR, "")
        stderr = {"1": "on (" + FILTER_ENV_VAR + "=1)", "0": "off (" + FILTER_ENV_VAR + "=0)"}.get(
            setting, f"only while one Python thread runs (set {FILTER_ENV_VAR}=1 or 0 to choose)"
        )
        return {"thread_keys": keys, "stderr_filter": stderr}

    @property
    def budget_spent(self) -> bool:
        """True once the software fallback has used the thread keys this process can spare."""
        return not self.hardware and self._reclaimer is None and self.software_calls >= SOFTWARE_CALL_BUDGET

    def compress(self, view: memoryview, level: int, hw_buffer_size: int) -> bytes:
        """Gzip ``view`` through QATzip; the GIL is released while QATzip works."""
        sessions = self._sessions()
        src = np.frombuffer(view, dtype=np.uint8) if len(view) else np.zeros(1, dtype=np.uint8)
        base = src.ctypes.data
        members = []
        with sessions.in_use:
            sess = sessions.get(self, level, hw_buffer_size)
            for start in range(0, max(len(view), 1), _MAX_CALL):
                size = min(_MAX_CALL, len(view) - start)
                bound = self._cdll.qzMaxCompressedLength(size, byref(sess))
                out = bytearray(bound)
                src_len, dest_len = c_uint(size), c_uint(bound)
                dest = (ctypes.c_char * bound).from_buffer(out)
                with contextlib.nullcontext() if self.hardware else _software_call():
                    self.software_calls += not self.hardware
                    rc = self._cdll.qzCompress(byref(sess), base + start, byref(src_len), dest, byref(dest_len), 1)
                    if self._reclaimer is not None:
                        self._reclaimer.reclaim()
                del dest  # releases the export so that ``out`` can shrink
                if rc != QZ_OK or src_len.value != size:
                    raise KvtoolError(
                        f"QATzip compression failed: {_status_name(rc)} ({src_len.value} of {size} bytes taken)"
                    )
                del out[dest_len.value :]
                members.append(out)
        return bytes(members[0]) if len(members) == 1 else b"".join(members)

    def _declare(self) -> None:
        lib = self._cdll
        if not hasattr(lib, "qzSetupSessionDeflate"):  # QATzip 1.2 and later
            raise UnavailableError(f"{lib._name} is older than QATzip 1.2 (no qzSetupSessionDeflate)")
        sess = POINTER(_Session)
        for name, args in {
            "qzInit": [sess, c_ubyte],
            "qzGetDefaultsDeflate": [POINTER(_ParamsDeflate)],
            "qzSetupSessionDeflate": [sess, POINTER(_ParamsDeflate)],
            "qzCompress": [sess, c_void_p, POINTER(c_uint), c_void_p, POINTER(c_uint), c_uint],
            "qzMaxCompressedLength": [c_uint, sess],
            "qzTeardownSession": [sess],
            "qzClose": [sess],
        }.items():
            getattr(lib, name).argtypes = args
        lib.qzMaxCompressedLength.restype = c_uint
        if hasattr(lib, "qzSetLogLevel"):  # QATzip >= 1.3 logs "no hardware" on every call otherwise
            lib.qzSetLogLevel.argtypes = [c_int]
            lib.qzSetLogLevel(_LOG_NONE)

    def _read_defaults(self) -> _ParamsDeflate:
        params = _ParamsDeflate()
        rc = self._cdll.qzGetDefaultsDeflate(byref(params))
        c = params.common_params
        sane = (
            rc == QZ_OK
            and c.comp_algorithm == QZ_DEFLATE
            and c.direction <= 2
            and c.sw_backup <= 1
            and MIN_HW_BUFFER_SIZE <= c.hw_buff_sz <= MAX_HW_BUFFER_SIZE
            and params.data_fmt <= 3
        )
        if not sane:
            raise UnavailableError(f"{self._cdll._name}: session parameters do not have the QATzip 1.2/1.3 layout")
        return params

    def _sessions(self) -> _ThreadSessions:
        sessions = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = self._local.sessions = _ThreadSessions(self._cdll)
        return sessions

    def open_session(self, level: int, hw_buffer_size: int) -> _Session:
        params = _ParamsDeflate.from_buffer_copy(self._defaults)
        c = params.common_params
        c.direction = QZ_DIR_COMPRESS
        c.comp_lvl = level
        c.sw_backup = 1
        c.hw_buff_sz = hw_buffer_size
        params.data_fmt = QZ_DEFLATE_GZIP_EXT  # QATzip's own default, set so a changed process default cannot alter it
        sess = _Session()
        with contextlib.nullcontext() if getattr(self, "hardware", False) else _software_call():
            rc = self._cdll.qzInit(byref(sess), 1)
            if rc >= 0:
                rc = self._cdll.qzSetupSessionDeflate(byref(sess), byref(params))
        if rc < 0:
            raise UnavailableError(f"QATzip session setup failed (qzInit or qzSetupSessionDeflate): {_status_name(rc)}")
        return sess


class _ThreadSessions:
    """One thread's sessions, one per parameter set.

    Torn down when the thread's locals are dropped, or at exit; ``in_use``
    makes an exit-time teardown wait for a daemon thread still compressing.
    """

    def __init__(self, cdll: ctypes.CDLL):
        self.by_params: dict[tuple[int, int], _Session] = {}
        self.in_use = threading.Lock()
        weakref.finalize(self, _teardown, cdll, self.by_params, self.in_use)

    def get(self, lib: Library, level: int, hw_buffer_size: int) -> _Session:
        sess = self.by_params.get((level, hw_buffer_size))
        if sess is None:
            sess = self.by_params[(level, hw_buffer_size)] = lib.open_session(level, hw_buffer_size)
        return sess


def _teardown(cdll: ctypes.CDLL, sessions: dict[tuple[int, int], _Session], in_use: threading.Lock) -> None:
    with in_use:
        for sess in sessions.values():
            cdll.qzTeardownSession(byref(sess))
            cdll.qzClose(byref(sess))
        sessions.clear()


_lock = threading.Lock()
_loaded: Library | UnavailableError | None = None


def load() -> Library:
    """The process's libqatzip, loaded once; raises ``UnavailableError`` saying why not."""
    global _loaded
    with _lock:
        if _loaded is None:
            try:
                _loaded = Library(_open())
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


_PROBE_NOISE = b"Cannot open /dev/vfio\n"
# Software-fallback calls take turns: the key a call leaks is deleted before the next call
# creates one, and at most one call at a time points file descriptor 2 elsewhere.
_software_lock = threading.Lock()


def filter_stderr() -> bool:
    """Whether a software-fallback call now may point file descriptor 2 at a temporary file."""
    setting = os.environ.get(FILTER_ENV_VAR, "")
    if setting in ("0", "1"):
        return setting == "1"
    return threading.active_count() == 1


@contextlib.contextmanager
def _software_call():
    """Run one software-fallback call alone, its probe's stderr line dropped where that is safe."""
    with _software_lock, (_probe_noise_filtered() if filter_stderr() else contextlib.nullcontext()):
        yield


@contextlib.contextmanager
def _probe_noise_filtered():
    """Drop the line libqat prints on stderr each time QATzip looks for a device that is not there.

    Without a QAT device, libqatzip 1.3 probes again on every call and libqat
    prints "Cannot open /dev/vfio" each time, flooding a terminal. While the call
    runs, file descriptor 2 points at a temporary file; afterwards everything
    written there except that line goes to the real stderr, so nothing is lost,
    but another thread's stderr is held back meanwhile (``filter_stderr``).
    """
    with tempfile.TemporaryFile() as capture:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            kept = capture.read().replace(_PROBE_NOISE, b"")
            if kept:
                os.write(2, kept)


class _KeyReclaimer:
    """Deletes the pthread key each software-fallback call of libqatzip 1.3 creates and drops.

    QATzip's hardware probe stores a new key in ``g_process.async_req_key`` on
    every call and abandons it when the probe fails; the key is only ever used
    by asynchronous hardware requests. The key is read from that exported
    global, whose layout in libqatzip 1.3.1 (48 bytes, the key at offset 40)
    is used only with that version and after its size is checked, and deleted
    while the caller still holds ``_software_lock``, so no other QATzip call
    runs in between.
    """

    _LAYOUT_SIZE, _KEY_OFFSET = 48, 40

    def __init__(self, key_address: int):
        self._key = ctypes.c_uint.from_address(key_address)
        self._libc = ctypes.CDLL(None)

    @classmethod
    def attach(cls, cdll: ctypes.CDLL, version: str | None) -> "_KeyReclaimer | None":
        """A reclaimer for libqatzip 1.3.1 whose ``g_process`` has the known size; None for any other."""
        if version != RECLAIM_VERSION:
            return None
        try:
            address = ctypes.addressof(ctypes.c_char.in_dll(cdll, "g_process"))
        except ValueError:
            return None
        if _symbol_size(cdll, "g_process") != cls._LAYOUT_SIZE:
            return None
        return cls(address + cls._KEY_OFFSET)

    def reclaim(self) -> None:
        self._libc.pthread_key_delete(self._key.value)


def _symbol_size(cdll: ctypes.CDLL, name: str) -> int | None:
    """The size of an exported data symbol, from the library's dynamic symbol table."""
    try:
        out = subprocess.run(["nm", "-D", "-S", cdll._name], capture_output=True, text=True, timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if len(fields) == 4 and fields[3] == name:
            return int(fields[1], 16)
    return None
