"""How failures become answers: every error is ``{"error": {"code", "message"}}`` with a stable code.

Validation errors, unknown paths and methods, ``KvtoolError``s raised by the
endpoints (``NotFound``, ``NotStored``, a closed or unavailable store, a usage
error) and anything unexpected each map to one code of ``ERROR_CODES``.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvtool.errors import KvtoolError, UnavailableError, UsageError
from kvtool.server.guards import ERROR_CODES, error_body
from kvtool.store import StoreClosedError

log = logging.getLogger("kvtool.server")


class NotFound(KvtoolError):
    def __init__(self, key: str) -> None:
        super().__init__(f"no entry {key[:80]!r}")


class NotStored(KvtoolError):
    def __init__(self, key: str) -> None:
        super().__init__(f"{key[:80]!r} was not stored: no tier admits it and has room")


def _error(code: str, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(code, message), status_code=ERROR_CODES[code], media_type="application/json",
                    headers=headers)


def add_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body') or 'body'}: {e.get('msg', 'invalid')}"
            for e in exc.errors()[:5]
        )
        return _error("invalid_request", problems or "invalid request")

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        return _error(code, str(exc.detail), getattr(exc, "headers", None))

    @api.exception_handler(KvtoolError)
    async def kvtool_error(request: Request, exc: KvtoolError) -> Response:
        if isinstance(exc, NotFound):
            return _error("not_found", str(exc))
        if isinstance(exc, NotStored):
            return _error("not_stored", str(exc))
        if isinstance(exc, (StoreClosedError, UnavailableError)):
            return _error("unavailable", str(exc))
        if isinstance(exc, UsageError):
            return _error("invalid_request", str(exc))
        log.error("%s %s: %s", request.method, request.url.path, exc)
        return _error("internal", str(exc))

    @api.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("%s %s failed", request.method, request.url.path)
        return _error("internal", "internal error; the server log has the details")
