"""Serving the API with uvicorn: in the foreground (``kvtool serve``) or on a thread (inside vLLM, tests).

``ApiServer`` binds its socket itself (``ListenAddress.bind``: a unix socket
private to its owner, or a TCP port), so a port of 0 picks a free one and the
address is known before the first request. Before uvicorn shuts down it ends
the open event streams, which would otherwise hold the shutdown open.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import uvicorn

from kvtool.errors import UsageError
from kvtool.server.app import ApiApp, create_app
from kvtool.server.context import Limits
from kvtool.server.auth import ListenAddress
from kvtool.server.lookup import BlockHasher
from kvtool.store import TieredStore

if TYPE_CHECKING:
    import socket

    from typing_extensions import Self

log = logging.getLogger("kvtool.server")


class _Uvicorn(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, api: ApiApp) -> None:
        super().__init__(config)
        self._api = api

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._api.close()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the server; unlike uvicorn's own, the signal is not raised again
        afterwards, so the caller still closes its store (and saves the memory tier)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


class ApiServer:
    """The API over ``store`` on ``listen``; the store stays the caller's to close.

    ``allow_remote`` is required to listen on an address that is not
    loopback; without ``tls_cert``/``tls_key`` that logs a warning, since the
    token then crosses the network in clear. ``log_level`` sets uvicorn's
    loggers' level (None: leave them as the process has them).
    """

    def __init__(
        self,
        store: TieredStore,
        token: str,
        listen: str | ListenAddress,
        *,
        allow_remote: bool = False,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
        limits: Limits = Limits(),
        lookup_defaults: dict[str, Any] | None = None,
        block_hasher: BlockHasher | None = None,
        log_level: str | None = "warning",
    ) -> None:
        self.address = listen if isinstance(listen, ListenAddress) else ListenAddress.parse(listen)
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("TLS needs both a certificate and its key (--tls-cert and --tls-key)")
        self.tls = tls_cert is not None
        if not self.address.is_loopback:
            if not allow_remote:
                raise UsageError(
                    f"{self.address.host} is not a loopback address: anyone who can reach it could try the API; "
                    "pass --allow-remote to listen there (the bearer token is still required)"
                )
            if not self.tls:
                log.warning("listening on %s without TLS: the bearer token and the traffic cross the network in "
                            "clear; use --tls-cert/--tls-key or a TLS proxy", self.address.url())
        self.api = create_app(store, token, limits, lookup_defaults, block_hasher)
        self._socket = self.address.bind()
        # log_config=None: uvicorn leaves the process's logging alone (inside vLLM, vLLM's own uvicorn
        # logs); a log_level of None leaves its loggers' levels alone too.
        config = uvicorn.Config(
            self.api, log_config=None, log_level=log_level, access_log=False, lifespan="off", server_header=False,
            timeout_graceful_shutdown=5, ssl_certfile=tls_cert, ssl_keyfile=tls_key,
        )
        self._server = _Uvicorn(config, self.api)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Where clients reach the server (a chosen port 0 resolved)."""
        if self.address.path is not None:
            return self.address.url()
        host, port = self._socket.getsockname()[:2]
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"

    def run(self) -> None:
        """Serve in this thread until SIGINT/SIGTERM (or ``stop`` from another thread)."""
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._cleanup()

    def start(self, timeout_s: float = 30.0) -> Self:
        """Serve on a daemon thread; returns once the server accepts connections."""
        self._thread = threading.Thread(target=self.run, name="kvtool-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            self.stop()
            raise UsageError(f"the API server on {self.url} did not start")
        return self

    def stop(self) -> None:
        """Stop serving (from another thread) and wait for it."""
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _cleanup(self) -> None:
        self.api.close()
        with contextlib.suppress(OSError):
            self._socket.close()
        if self.address.path is not None:
            with contextlib.suppress(OSError):
                self.address.path.unlink()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
