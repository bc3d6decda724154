"""The servers and faults of benchmarks/torture.py: a throwaway Redis, a throwaway Redis Cluster,
and the injector that damages the store, fills its file tier, or kills a server between saves
and the restores that follow them."""

import os
import random
import socket
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = ROOT / "scripts" / "redis-cluster.sh"


def _wait_for_port(port: int, what: str) -> None:
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start")


class Redis:
    """A throwaway redis-server on a loopback port, killed and restarted by the fault injector."""

    def __init__(self, work: Path) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.work = work
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, cwd=self.work)
        _wait_for_port(self.port, "redis-server")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


class Cluster:
    """A Redis Cluster of 3 masters and 3 replicas (scripts/redis-cluster.sh); ``kill_master``
    SIGKILLs one master, ``restart`` starts it again: it rejoins as a replica of the node that
    took over, with no data of its own."""

    def __init__(self, work: Path) -> None:
        self.dir = work / "cluster"
        done = subprocess.run(["bash", str(CLUSTER_SCRIPT), "start", str(self.dir), "auto"], capture_output=True,
                              text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the Redis Cluster did not start: {done.stderr[-2000:]}")
        self.url = done.stdout.split()[-1]
        nodes = self.url.partition("://")[2].partition("?")[0]
        self.ports = [int(node.rpartition(":")[2]) for node in nodes.split(",")]
        self.down: int | None = None

    def _nodes(self) -> list[tuple[int, list[str], bool]]:
        """(port, flags, serves slots) of every node, as a live node sees the cluster."""
        live = next(p for p in self.ports if p != self.down)
        listing = subprocess.run(["redis-cli", "-p", str(live), "cluster", "nodes"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout
        nodes = []
        for line in listing.splitlines():
            fields = line.split()
            port = int(fields[1].partition("@")[0].rpartition(":")[2])
            nodes.append((port, fields[2].split(","), len(fields) > 8))
        return nodes

    def masters(self) -> list[int]:
        """The ports of the masters that serve slots and are not failing."""
        return sorted(port for port, flags, slots in self._nodes()
                      if "master" in flags and slots and not {"fail", "fail?"} & set(flags))

    def _taken_over(self) -> bool:
        return all(slots is False for port, _, slots in self._nodes() if port == self.down)

    def kill_master(self, rng: random.Random) -> bool:
        masters = self.masters()
        if self.down is not None or not masters:
            return False
        port = rng.choice(masters)
        pidfile = self.dir / f"redis-{port}.pid"
        os.kill(int(pidfile.read_text()), 9)
        pidfile.unlink()
        self.down = port
        return True

    def restart(self) -> None:
        """Once a replica has taken over the killed master's slots (or 30 s passed), the killed node
        again; then until every node says the cluster is whole."""
        if self.down is None:
            return
        deadline = time.monotonic() + 30  # the replica's takeover: the node timeout (2 s) and an election
        while not self._taken_over() and time.monotonic() < deadline:
            time.sleep(0.2)
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "restart", str(self.dir), str(self.down)], capture_output=True,
                       timeout=60, check=True)
        self.down = None
        deadline = time.monotonic() + 60
        while not all(self._state(port) == "ok" for port in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the Redis Cluster did not become whole again within 60 s")
            time.sleep(0.2)

    def _state(self, port: int) -> str:
        info = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                              timeout=10, check=False).stdout
        return next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("cluster_state:")),
                    "")

    def stop(self) -> None:
        subprocess.run(["bash", str(CLUSTER_SCRIPT), "stop", str(self.dir)], timeout=60, check=False)


class Faults:
    """Injects one fault kind between a save and the restores that follow it; ``counts`` says how often each was."""

    def __init__(self, rng: random.Random, store_dir: Path, capacity: int, redis: Redis | None,
                 cluster: Cluster | None, counts: dict[str, int]) -> None:
        self.rng, self.store_dir, self.capacity = rng, store_dir, capacity
        self.redis, self.cluster, self.counts = redis, cluster, counts

    def entry_files(self) -> list[tuple[float, Path]]:
        """(mtime, path) of the file tier's entries, newest first; an entry the store moves or removes
        meanwhile (a demotion, an eviction) is left out."""
        found = []
        for path in self.store_dir.rglob("*.kve"):
            try:
                found.append((path.stat().st_mtime, path))
            except FileNotFoundError:
                continue
        return sorted(found, reverse=True)

    def damage(self, kind: str) -> bool:
        files = [path for _, path in self.entry_files()]
        if not files:
            return False
        for path in self.rng.sample(files[: max(1, len(files) // 2)], max(1, len(files) // 4)):  # what the next turns may restore
            try:
                if kind == "delete":
                    path.unlink()
                elif kind == "truncate":
                    os.truncate(path, path.stat().st_size // 2)
                else:
                    with open(path, "r+b") as f:
                        f.seek(self.rng.randrange(path.stat().st_size))
                        byte = f.read(1)
                        f.seek(-1, 1)
                        f.write(bytes([byte[0] ^ (1 << self.rng.randrange(8))]))
            except FileNotFoundError:  # the store moved it first
                continue
        return True

    def fill_tier(self) -> bool:
        """Other entries up to the file tier's capacity, so the next saves must make room."""
        from kvtool.store import open_store

        with open_store(f"file://{self.store_dir}?capacity={self.capacity}") as store:
            filler = os.urandom(256 * 1024)
            for i in range(self.capacity // len(filler)):
                store.put(f"torture-filler-{self.rng.getrandbits(64):016x}-{i}", filler)
        return True

    def recover(self) -> None:
        """Servers killed before the last round start again (Redis empty; the cluster's node as a replica)."""
        if self.redis is not None and self.redis.proc is None:
            self.redis.start()
        if self.cluster is not None:
            self.cluster.restart()

    def inject(self, kind: str, swap_engine) -> bool:
        if kind in ("delete", "truncate", "bitflip"):
            done = self.damage(kind)
        elif kind == "tier_full":
            done = self.fill_tier()
        elif kind == "redis_restart":
            done = self.redis is not None
            if self.redis is not None:
                self.redis.stop()  # down for this round; ``recover`` starts it again (empty) before the next
        elif kind == "cluster_master_kill":
            done = self.cluster is not None and self.cluster.kill_master(self.rng)
        else:
            done = swap_engine(kind)
        if done:
            self.counts[kind] += 1
        return done
