"""QATzip's C interface as ctypes sees it: constants, struct layouts and function signatures of ``qatzip.h``.

Struct layouts follow ``include/qatzip.h`` of QATzip 1.2 and 1.3 as
distributions build it (without ``ERR_INJECTION``); ``read_defaults`` checks
the defaults the library fills in before they are used, so a different layout
is reported as unavailable instead of corrupting memory.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, byref, c_int, c_long, c_ubyte, c_uint, c_ulong, c_void_p

from kvtool.errors import UnavailableError

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


class Session(ctypes.Structure):  # QzSession_T
    _fields_ = [
        ("hw_session_stat", c_long),
        ("thd_sess_stat", c_int),
        ("internal", c_void_p),
        ("total_in", c_ulong),
        ("total_out", c_ulong),
    ]


class ParamsCommon(ctypes.Structure):  # QzSessionParamsCommon_T
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


class ParamsDeflate(ctypes.Structure):  # QzSessionParamsDeflate_T, plus slack against a larger build
    _fields_ = [("common_params", ParamsCommon), ("huffman_hdr", c_int), ("data_fmt", c_int), ("_slack", c_ubyte * 64)]


def status_name(rc: int) -> str:
    return _STATUS.get(rc, f"status {rc}")


def declare(lib: ctypes.CDLL) -> None:
    """Give the functions kvtool calls their signatures; raises ``UnavailableError`` before QATzip 1.2."""
    if not hasattr(lib, "qzSetupSessionDeflate"):  # QATzip 1.2 and later
        raise UnavailableError(f"{lib._name} is older than QATzip 1.2 (no qzSetupSessionDeflate)")
    sess = POINTER(Session)
    for name, args in {
        "qzInit": [sess, c_ubyte],
        "qzGetDefaultsDeflate": [POINTER(ParamsDeflate)],
        "qzSetupSessionDeflate": [sess, POINTER(ParamsDeflate)],
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


def read_defaults(lib: ctypes.CDLL) -> ParamsDeflate:
    """The library's default deflate parameters, checked to have the layout ``ParamsDeflate`` declares."""
    params = ParamsDeflate()
    rc = lib.qzGetDefaultsDeflate(byref(params))
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
        raise UnavailableError(f"{lib._name}: session parameters do not have the QATzip 1.2/1.3 layout")
    return params
