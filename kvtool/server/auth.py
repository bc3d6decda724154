"""Who may talk to the API: the bearer token, and where the server may listen.

The token is a random 256-bit secret. ``KVTOOL_API_TOKEN`` gives it; otherwise
it lives in a file readable only by its owner (default
``$XDG_CONFIG_HOME/kvtool/api-token``, ``~/.config/kvtool/api-token``), which
the server creates at its first start. A token file that other users can read
is refused, as ssh refuses such a key. Tokens are compared in constant time.

Listen addresses: ``unix:///path/to/api.sock`` (the socket is made readable
and writable by its owner only) or ``HOST:PORT``; a host that is not loopback
needs ``allow_remote``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import UsageError

TOKEN_ENV = "KVTOOL_API_TOKEN"
DEFAULT_LISTEN = "127.0.0.1:8470"
_MIN_TOKEN_CHARS = 16


def default_token_file() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "kvtool" / "api-token"


def load_token(token_file: Path | None = None, create: bool = False) -> str:
    """The API token: ``KVTOOL_API_TOKEN``, else the token file (created if ``create`` and missing)."""
    token = os.environ.get(TOKEN_ENV)
    if token is not None:
        return _checked(token.strip(), f"${TOKEN_ENV}")
    path = token_file or default_token_file()
    if create and not path.exists():
        _create_token_file(path)
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise UsageError(f"API token file {path} is accessible by other users; chmod 600 it")
            token = f.read(4096).decode("utf-8", "replace").strip()
    except FileNotFoundError:
        raise UsageError(f"no API token: set {TOKEN_ENV} or create {path} (kvtool serve creates it)") from None
    return _checked(token, str(path))


def _create_token_file(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another server made it first: use theirs
        return
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")


def _checked(token: str, origin: str) -> str:
    if len(token) < _MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable() or " " in token:
        raise UsageError(f"API token from {origin} must be at least {_MIN_TOKEN_CHARS} printable ASCII characters")
    return token


def token_matches(header: str | None, token: str) -> bool:
    """Does an ``Authorization`` header carry ``Bearer <token>``? Constant time in the token."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


@dataclass(frozen=True)
class ListenAddress:
    """A unix socket path, or a host and port."""

    path: Path | None = None
    host: str = ""
    port: int = 0

    @classmethod
    def parse(cls, text: str) -> "ListenAddress":
        text = text.strip()
        if text.startswith("unix:"):
            path = text[len("unix:"):].removeprefix("//")
            if not path:
                raise UsageError(f"a unix socket address needs a path: unix:///run/user/1000/kvtool.sock, not {text!r}")
            return cls(path=Path(path).expanduser().absolute())
        host, sep, port = text.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise UsageError(f"listen address {text!r}: write HOST:PORT (127.0.0.1:8470, [::1]:8470) or unix:///PATH")
        return cls(host=host, port=int(port))

    @property
    def is_loopback(self) -> bool:
        """A unix socket, or a host whose every address is a loopback address."""
        if self.path is not None:
            return True
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise UsageError(f"cannot resolve listen host {self.host!r}: {exc.strerror}") from None
        return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)

    def url(self) -> str:
        """The URL a client uses to reach this address."""
        if self.path is not None:
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def bind(self) -> socket.socket:
        """A listening socket; a unix socket file is private to its owner from the start."""
        if self.path is not None:
            return _bind_unix(self.path)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise UsageError(f"cannot listen on {self.host}:{self.port}: {exc.strerror}") from None
        return sock


def _bind_unix(path: Path) -> socket.socket:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise UsageError(f"{path} exists and is not a socket; not replacing it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # left by a server that is gone
        else:
            raise UsageError(f"another server is listening on {path}")
        finally:
            probe.close()
    # Bound in a private directory and renamed into place, so the socket is never reachable with looser modes.
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    private = Path(tempfile.mkdtemp(prefix=".kvtool-", dir=path.parent))
    try:
        sock.bind(str(private / "sock"))
        os.chmod(private / "sock", 0o600)
        os.rename(private / "sock", path)
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {path}: {exc.strerror}") from None
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return sock
