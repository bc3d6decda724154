"""A network link on this machine: a Redis server in its own network namespace, behind a veth pair shaped by tc.

The remote cell puts kvtool's Redis tier across it::

    with Link() as link:
        link.set_mtu(65000)               # so that the veth's per-packet CPU does not bind first
        link.shape(10)                    # Gbit/s, each way (tc's token bucket filter)
        redis = link.start_redis(6390, log)
        ... store URL f"redis://{link.remote_ip}:6390/0" ...

Needs root (``ip netns``, ``ip link``, ``tc``). Each direction's egress is shaped, so
stores (here to there) and loads (there to here) both see the rate. ``measure`` sends
bytes from the namespace to this side through a plain TCP socket and reports the rate
reached, the check that the shaping (and the machine's CPUs) give the rate asked for.
Everything is torn down on exit, also after an error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

#: Token bucket depth: small enough that one chunk's transfer (4-6 MB) is paced by the rate, not sent as a burst.
BURST = "1mb"
SENDER = """
import socket, sys
size = int(sys.argv[2]); block = b"x" * (1 << 20)
with socket.create_server((sys.argv[1], 0)) as server:
    print(server.getsockname()[1], flush=True)
    conn, _ = server.accept()
    with conn:
        sent = 0
        while sent < size:
            conn.sendall(block); sent += len(block)
"""


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


class Link:
    """See the module docstring."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        self.namespace = f"kvtool-l2-{tag}"
        self.here, self.there = f"kvl2a{tag}", f"kvl2b{tag}"
        subnet = 10 + tag % 200
        self.local_ip, self.remote_ip = f"10.213.{subnet}.1", f"10.213.{subnet}.2"
        self._processes: list[subprocess.Popen] = []
        self.gbit: float | None = None

    def __enter__(self) -> "Link":
        try:
            _run("ip", "netns", "add", self.namespace)
            _run("ip", "link", "add", self.here, "type", "veth", "peer", "name", self.there)
            _run("ip", "link", "set", self.there, "netns", self.namespace)
            _run("ip", "addr", "add", f"{self.local_ip}/30", "dev", self.here)
            _run("ip", "link", "set", self.here, "up")
            self._in_namespace("ip", "addr", "add", f"{self.remote_ip}/30", "dev", self.there)
            self._in_namespace("ip", "link", "set", self.there, "up")
            self._in_namespace("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _in_namespace(self, *cmd: str) -> None:
        _run("ip", "netns", "exec", self.namespace, *cmd)

    def shape(self, gbit: float) -> None:
        """Both directions limited to ``gbit`` Gbit/s."""
        rate = f"{gbit * 1000:g}mbit"
        _run("tc", "qdisc", "replace", "dev", self.here, "root", "tbf", "rate", rate, "burst", BURST, "latency", "50ms")
        self._in_namespace("tc", "qdisc", "replace", "dev", self.there, "root", "tbf", "rate", rate, "burst", BURST,
                           "latency", "50ms")
        self.gbit = gbit

    def start_redis(self, port: int, log: Path) -> subprocess.Popen:
        """A Redis server on the far side: no persistence, no memory limit, no protected mode."""
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.namespace, "redis-server", "--bind", self.remote_ip, "--port", str(port),
             "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self._processes.append(proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.remote_ip, port), timeout=1) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return proc
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"redis-server in {self.namespace} did not answer; see {log}")

    def set_mtu(self, mtu: int) -> None:
        _run("ip", "link", "set", self.here, "mtu", str(mtu))
        self._in_namespace("ip", "link", "set", self.there, "mtu", str(mtu))

    def flush_redis(self, port: int) -> None:
        """Empty the far Redis (between configurations, so each starts with an empty L2)."""
        with socket.create_connection((self.remote_ip, port), timeout=30) as s:
            s.sendall(b"FLUSHALL\r\n")
            if not s.recv(16).startswith(b"+OK"):
                raise RuntimeError("redis FLUSHALL failed")

    def measure(self, size: int = 256 << 20) -> float:
        """Gbit/s reached sending ``size`` bytes from the far side to this one."""
        sender = subprocess.Popen(["ip", "netns", "exec", self.namespace, sys.executable, "-c", SENDER,
                                   self.remote_ip, str(size)], stdout=subprocess.PIPE, text=True)
        try:
            port = int(sender.stdout.readline())  # type: ignore[union-attr]
            with socket.create_connection((self.remote_ip, port)) as s:
                start, got = time.perf_counter(), 0
                buffer = bytearray(1 << 20)
                while (n := s.recv_into(buffer)) > 0:
                    got += n
                seconds = time.perf_counter() - start
        finally:
            sender.wait(30)
        return got * 8 / seconds / 1e9

    def close(self) -> None:
        for proc in self._processes:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        subprocess.run(["ip", "link", "del", self.here], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.namespace], capture_output=True, check=False)
