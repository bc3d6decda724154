"""A loaded libqatzip: one deflate session per thread and parameter set, and compress in one call.

``kvtool.codecs._qatzip.load`` finds the library and builds the process's one
``Library``; the software-fallback workarounds it applies are in
``_qatzip_fallback``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import weakref
from ctypes import byref, c_uint

import numpy as np

from kvtool.codecs._qatzip_abi import (
    QZ_DEFLATE_GZIP_EXT,
    QZ_DIR_COMPRESS,
    QZ_OK,
    ParamsDeflate,
    Session,
    read_defaults,
    status_name,
)
from kvtool.codecs._qatzip_fallback import (
    FILTER_ENV_VAR,
    RECLAIM_VERSION,
    SOFTWARE_CALL_BUDGET,
    KeyReclaimer,
    software_call,
)
from kvtool.errors import KvtoolError, UnavailableError

# One qzCompress call per gigabyte at most: lengths are 32-bit, and each call
# writes a complete gzip member, so larger input becomes several members.
_MAX_CALL = 1 << 30


class Library:
    """A loaded libqatzip: where it is, which version, hardware or not, and ``compress``.

    ``cdll`` has its signatures declared (``_qatzip_abi.declare``); ``path`` is
    the file the loader picked and ``version`` QATzip's release, when known.
    """

    def __init__(self, cdll: ctypes.CDLL, path: str, version: str | None):
        self._cdll = cdll
        self._defaults = read_defaults(cdll)
        self._local = threading.local()
        self.path = path
        self.version = version
        # The first session tells whether QATzip attached to a device or fell back to software.
        probe = self._sessions().get(self, 1, self._defaults.common_params.hw_buff_sz)
        self.hardware = probe.hw_session_stat == QZ_OK
        self.session_status = status_name(probe.hw_session_stat)
        self.software_calls = 0  # see SOFTWARE_CALL_BUDGET
        self._reclaimer = None if self.hardware else KeyReclaimer.attach(cdll, self.version)

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
                with contextlib.nullcontext() if self.hardware else software_call():
                    self.software_calls += not self.hardware
                    rc = self._cdll.qzCompress(byref(sess), base + start, byref(src_len), dest, byref(dest_len), 1)
                    if self._reclaimer is not None:
                        self._reclaimer.reclaim()
                del dest  # releases the export so that ``out`` can shrink
                if rc != QZ_OK or src_len.value != size:
                    raise KvtoolError(
                        f"QATzip compression failed: {status_name(rc)} ({src_len.value} of {size} bytes taken)"
                    )
                del out[dest_len.value :]
                members.append(out)
        return bytes(members[0]) if len(members) == 1 else b"".join(members)

    def _sessions(self) -> _ThreadSessions:
        sessions = getattr(self._local, "sessions", None)
        if sessions is None:
            sessions = self._local.sessions = _ThreadSessions(self._cdll)
        return sessions

    def open_session(self, level: int, hw_buffer_size: int) -> Session:
        params = ParamsDeflate.from_buffer_copy(self._defaults)
        c = params.common_params
        c.direction = QZ_DIR_COMPRESS
        c.comp_lvl = level
        c.sw_backup = 1
        c.hw_buff_sz = hw_buffer_size
        params.data_fmt = QZ_DEFLATE_GZIP_EXT  # QATzip's own default, set so a changed process default cannot alter it
        sess = Session()
        with contextlib.nullcontext() if getattr(self, "hardware", False) else software_call():
            rc = self._cdll.qzInit(byref(sess), 1)
            if rc >= 0:
                rc = self._cdll.qzSetupSessionDeflate(byref(sess), byref(params))
        if rc < 0:
            raise UnavailableError(f"QATzip session setup failed (qzInit or qzSetupSessionDeflate): {status_name(rc)}")
        return sess


class _ThreadSessions:
    """One thread's sessions, one per parameter set.

    Torn down when the thread's locals are dropped, or at exit; ``in_use``
    makes an exit-time teardown wait for a daemon thread still compressing.
    """

    def __init__(self, cdll: ctypes.CDLL):
        self.by_params: dict[tuple[int, int], Session] = {}
        self.in_use = threading.Lock()
        weakref.finalize(self, _teardown, cdll, self.by_params, self.in_use)

    def get(self, lib: Library, level: int, hw_buffer_size: int) -> Session:
        sess = self.by_params.get((level, hw_buffer_size))
        if sess is None:
            sess = self.by_params[(level, hw_buffer_size)] = lib.open_session(level, hw_buffer_size)
        return sess


def _teardown(cdll: ctypes.CDLL, sessions: dict[tuple[int, int], Session], in_use: threading.Lock) -> None:
    with in_use:
        for sess in sessions.values():
            cdll.qzTeardownSession(byref(sess))
            cdll.qzClose(byref(sess))
        sessions.clear()
