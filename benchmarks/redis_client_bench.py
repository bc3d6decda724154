"""redis-py's reply parsers and command packers on one large value, side by side.

    python benchmarks/redis_client_bench.py [--mb 94] [--repeat 5]

Starts a throwaway redis-server on loopback, stores one random value (94 MB by
default: a 4096-token SmolLM2-135M cache) and times GET with the hiredis
parser and with redis-py's pure-Python parser, and SET with hiredis' packer
(which copies the value into one command string) and with the packer the
redis tier uses (``UnbufferedConnection``: the value goes to the socket as is).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import time

import redis
from redis._parsers import _RESP2Parser

from kvtool.store.redis import UnbufferedConnection


def timed(call, repeat: int) -> list[float]:
    call()  # warm up: connect, grow buffers
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=94, help="value size in MB (default: 94)")
    parser.add_argument("--repeat", type=int, default=5, help="timed calls per case (default: 5)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        value = os.urandom(args.mb * 1_000_000)
        for _ in range(100):
            try:
                redis.Redis(port=port).set("value", value)
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        cases = {
            "GET, hiredis parser": (redis.ConnectionPool(port=port), lambda c: c.get("value")),
            "GET, Python parser": (redis.ConnectionPool(port=port, parser_class=_RESP2Parser), lambda c: c.get("value")),
            "SET, hiredis packer (copies)": (redis.ConnectionPool(port=port), lambda c: c.set("copy", value)),
            "SET, unbuffered packer (kvtool)": (redis.ConnectionPool(port=port, connection_class=UnbufferedConnection),
                                                lambda c: c.set("copy", value)),
        }
        print(f"{args.mb} MB value, {args.repeat} calls each, loopback")
        for name, (pool, op) in cases.items():
            client = redis.Redis(connection_pool=pool)
            times = timed(lambda: op(client), args.repeat)
            print(f"{name:34s} median {statistics.median(times):.3f} s  best {min(times):.3f} s  "
                  f"({args.mb / 1000 / statistics.median(times):.2f} GB/s)")
            client.close()
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
