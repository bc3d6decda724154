from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

# The vLLM and LMCache end-to-end tests run inside those stacks' own environments
# (`.venv-vllm/bin/python -m pytest tests/vllm_e2e`, `.venv-lmcache/bin/python -m pytest
# tests/lmcache_e2e`), which .ci/run runs separately; elsewhere they are not collected.
collect_ignore = [folder for folder, stack in (("vllm_e2e", "vllm"), ("lmcache_e2e", "lmcache"))
                  if not importlib.util.find_spec(stack)]

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = ROOT / "samples"


def sample_paths() -> list[Path]:
    return sorted(SAMPLES.glob("*.safetensors"))


@pytest.fixture(scope="session")
def samples() -> list[Path]:
    paths = sample_paths()
    assert paths, f"no KV cache samples in {SAMPLES}"
    return paths


@pytest.fixture(scope="session")
def pca_basis(samples):
    """A transform dictionary learnt from the prose sample (keys de-rotated with SmolLM2's rope theta), registered;
    the pca tests code the code sample with it."""
    from kvtool.cache import KVCache
    from kvtool.modeldict import registry
    from kvtool.modeldict.basis_train import train_basis

    dictionary = train_basis([KVCache.load(samples[1])], rope_theta=1e5)
    registry.register(dictionary)
    return dictionary


@pytest.fixture(scope="module")
def real_arrays() -> list:
    """Every fifth K and V tensor of the real samples."""
    from kvtool.cache import KVCache

    arrays = [a for path in sample_paths() for _, _, a in KVCache.load(path).tensors()]
    assert arrays, "no real samples"
    return arrays[::5]


class RedisServer:
    """A throwaway redis-server on a free loopback port, with no persistence."""

    def __init__(self, workdir: Path):
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; the Redis tests need it (Debian: apt-get install redis-server)")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = workdir / f"redis-{self.port}.log"
        self._command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                         "--appendonly", "no", "--dir", str(workdir)]
        self._proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        import redis

        with self.log.open("ab") as log:
            self._proc = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=0.2) as client:
                    client.ping()
                return self
            except (OSError, redis.RedisError):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"redis-server did not start: {self.log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.05)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            self._proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """A Redis server for the tests: KVTOOL_TEST_REDIS_URL if set, else one started here."""
    url = os.environ.get("KVTOOL_TEST_REDIS_URL")
    if url:
        yield url
        return
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server.url
    server.stop()


@pytest.fixture
def redis_server(tmp_path) -> RedisServer:
    """A Redis server of this test's own, which the test may stop and start."""
    server = RedisServer(tmp_path).start()
    yield server
    server.stop()


class RedisClusterProcesses:
    """A throwaway Redis Cluster (3 masters, 3 replicas) started by scripts/redis-cluster.sh."""

    SCRIPT = ROOT / "scripts" / "redis-cluster.sh"

    def __init__(self, workdir: Path, tls: bool = False):
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not installed; the Redis Cluster tests need it (Debian: apt-get install redis-server)")
        self.dir = workdir
        self.tls = tls
        self.url = ""
        self.ports: list[int] = []

    def start(self) -> "RedisClusterProcesses":
        done = subprocess.run(["bash", str(self.SCRIPT), "start", str(self.dir), "auto"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "KVTOOL_CLUSTER_TLS": str(int(self.tls))})
        if done.returncode != 0:
            pytest.fail(f"the Redis Cluster did not start: {done.stderr[-2000:]}")
        self.url = done.stdout.split()[-1]
        nodes = self.url.partition("://")[2].partition("?")[0]
        self.ports = [int(node.rpartition(":")[2]) for node in nodes.split(",")]
        return self

    def stop(self) -> None:
        subprocess.run(["bash", str(self.SCRIPT), "stop", str(self.dir)], check=True, timeout=60)

    def kill(self, port: int) -> None:
        """End one node at once, as a crash would."""
        pidfile = self.dir / f"redis-{port}.pid"
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
        pidfile.unlink()

    def info(self, port: int) -> dict[str, str]:
        """``CLUSTER INFO`` of one node."""
        import redis

        with redis.Redis(port=port, socket_timeout=2, decode_responses=True) as client:
            return {key: str(value) for key, value in client.cluster("INFO").items()}


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory) -> str:
    """A Redis Cluster for the tests: KVTOOL_TEST_REDIS_CLUSTER if set, else one started here."""
    url = os.environ.get("KVTOOL_TEST_REDIS_CLUSTER")
    if url:
        yield url
        return
    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster")).start()
    yield cluster.url
    cluster.stop()


@pytest.fixture
def redis_cluster(tmp_path) -> RedisClusterProcesses:
    """A Redis Cluster of this test's own, whose nodes the test may kill."""
    cluster = RedisClusterProcesses(tmp_path).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster_tls(tmp_path) -> RedisClusterProcesses:
    """A Redis Cluster that speaks only TLS, with a throwaway CA (its URL names the CA file)."""
    cluster = RedisClusterProcesses(tmp_path, tls=True).start()
    yield cluster
    cluster.stop()
