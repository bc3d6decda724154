"""Writers of ``kvtool.testing.shared`` that reach a store through kvtool's own front ends.

``serving(url)`` runs ``kvtool serve`` over the store at ``url`` for as long as it is open;
``api_ops`` drives that server through ``ApiClient``, ``cli_ops`` the store itself through
``kvtool store`` commands, one process each. Both give the calls the shared workload makes of a
store (put, get, contains, info, delete, keys, used_bytes); a refusal a store would answer with
False or None (not stored, no such entry) is answered so, anything else raises, and the
workload counts it as a failed operation.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

BANNER = re.compile(r"kvtool API on (\S+) over")


@contextlib.contextmanager
def serving(url: str, timeout: float = 60) -> Iterator[tuple[str, str]]:
    """``(API URL, token file)`` of a ``kvtool serve --store url`` on a free loopback port."""
    with tempfile.TemporaryDirectory(prefix="kvtool-serve-") as tmp:
        token_file, log_path = Path(tmp) / "token", Path(tmp) / "serve.log"
        env = {**os.environ, "XDG_CONFIG_HOME": tmp}
        env.pop("KVTOOL_API_TOKEN", None)
        with open(log_path, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvtool", "serve", "--store", url, "--listen", "127.0.0.1:0",
                                     "--token-file", str(token_file), "--rate", "0"], env=env, stderr=log,
                                    stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while not (found := BANNER.search(log_path.read_text())):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"kvtool serve did not start: {log_path.read_text()[-2000:]}")
                time.sleep(0.05)
            yield found[1], str(token_file)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _ApiOps:
    used_bytes = None  # the server's store counts its bytes; the final check reads them

    def __init__(self, client: Any) -> None:
        self.client = client

    def put(self, key: str, value: bytes) -> bool:
        from kvtool.server.client import ApiError

        try:
            self.client.put(key, value)
            return True
        except ApiError as exc:
            if exc.code == "not_stored":
                return False
            raise

    def get(self, key: str) -> bytes | None:
        return self.client.get(key)

    def info(self, key: str) -> SimpleNamespace | None:
        from kvtool.server.client import ApiError

        try:
            return SimpleNamespace(key=self.client.entry(key)["key"])
        except ApiError as exc:
            if exc.code == "not_found":
                return None
            raise

    def contains(self, key: str) -> bool:
        return self.info(key) is not None

    def delete(self, key: str) -> None:
        self.client.evict([key])

    def keys(self) -> list[str]:
        return [entry["key"] for entry in self.client.entries()["entries"]]


@contextlib.contextmanager
def api_ops(api_url: str, token_file: str) -> Iterator[_ApiOps]:
    from kvtool.server import ApiClient

    with ApiClient(api_url, token_file=Path(token_file)) as client:
        yield _ApiOps(client)


class _CliOps:
    used_bytes = None

    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url, tmp

    def _kvtool(self, *args: str, allowed: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", "kvtool", "store", *args, "--store", self.url],
                              capture_output=True, timeout=120, check=False)
        if done.returncode not in allowed:
            raise RuntimeError(f"kvtool store {args[0]} exited {done.returncode}: {done.stderr.decode()[-500:]}")
        return done

    def put(self, key: str, value: bytes) -> bool:
        source = self.tmp / "value"
        source.write_bytes(value)
        return self._kvtool("put", key, str(source), allowed=(0, 1)).returncode == 0

    def get(self, key: str) -> bytes | None:
        target = self.tmp / "got"
        target.unlink(missing_ok=True)
        if self._kvtool("get", key, "--output", str(target), allowed=(0, 1)).returncode:
            return None
        return target.read_bytes()

    def info(self, key: str) -> SimpleNamespace | None:
        rows = json.loads(self._kvtool("ls", "--json").stdout)
        return next((SimpleNamespace(key=row["key"]) for row in rows if row["key"] == key), None)

    def contains(self, key: str) -> bool:
        return self.info(key) is not None

    def delete(self, key: str) -> None:
        self._kvtool("evict", key, allowed=(0, 1))

    def keys(self) -> list[str]:
        return [row["key"] for row in json.loads(self._kvtool("ls", "--json").stdout)]


@contextlib.contextmanager
def cli_ops(url: str) -> Iterator[_CliOps]:
    with tempfile.TemporaryDirectory(prefix="kvtool-cli-") as tmp:
        yield _CliOps(url, Path(tmp))
