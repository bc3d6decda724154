"""The two flaws of QATzip's software fallback (no QAT device) and how kvtool works around them.

Sessions are opened with software backup, so without a QAT device QATzip
compresses in software (zlib) and still writes its own gzip format. That
fallback has two flaws kvtool works around, each only where it is safe:

- It leaks a pthread key per call. With libqatzip 1.3.1 exactly, whose private
  ``g_process`` layout is known (and its size is confirmed by ``nm -D``), the
  key is deleted after each call (``KeyReclaimer``); with any other version a
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
import os
import subprocess
import sys
import tempfile
import threading

FILTER_ENV_VAR = "KVTOOL_QATZIP_FILTER_STDERR"  # "1": always, "0": never, unset: single-threaded callers only
RECLAIM_VERSION = "1.3.1"  # the only libqatzip whose g_process layout KeyReclaimer knows

#: Without a device, each qzCompress of libqatzip 1.3 re-runs its hardware probe, which
#: creates a pthread key and never deletes it. A process has 1024 such keys; once they are
#: gone, any library that creates one fails (Rust's thread locals abort the process).
#: Where kvtool knows the library's layout it deletes that key after each call (see
#: ``KeyReclaimer``); elsewhere, after this many software-fallback calls a process stops
#: calling QATzip (see QatCodec.encode).
SOFTWARE_CALL_BUDGET = 512

PROBE_NOISE = b"Cannot open /dev/vfio\n"
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
def software_call():
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
            kept = capture.read().replace(PROBE_NOISE, b"")
            if kept:
                os.write(2, kept)


class KeyReclaimer:
    """Deletes the pthread key each software-fallback call of libqatzip 1.3 creates and drops.

    QATzip's hardware probe stores a new key in ``g_process.async_req_key`` on
    every call and abandons it when the probe fails; the key is only ever used
    by asynchronous hardware requests. The key is read from that exported
    global, whose layout in libqatzip 1.3.1 (48 bytes, the key at offset 40)
    is used only with that version and after its size is checked, and deleted
    while the caller still holds the lock ``software_call`` takes, so no other
    QATzip call runs in between.
    """

    _LAYOUT_SIZE, _KEY_OFFSET = 48, 40

    def __init__(self, key_address: int):
        self._key = ctypes.c_uint.from_address(key_address)
        self._libc = ctypes.CDLL(None)

    @classmethod
    def attach(cls, cdll: ctypes.CDLL, version: str | None) -> "KeyReclaimer | None":
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
