"""The HTTP API: a real uvicorn server (loopback port and unix socket) and a real HTTP client, on real KV bytes."""

from __future__ import annotations

import contextlib
import queue
import secrets
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from kvtool.cache import KVCache
from kvtool.server import ApiClient, ApiError, ApiServer, Limits
from kvtool.store import PrefixKeyer, TieredStore, open_store
from kvtool.store.entry import wrap
from kvtool.store.policy import HintedPolicy, LRUPolicy, Placement

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "prose.safetensors"
KEYER = PrefixKeyer("HuggingFaceTB/SmolLM2-135M-Instruct", "byteplane|zstd:1", salt="tenant-42", chunk_tokens=64)
PROMPT = list(range(1000, 1256))


@pytest.fixture(scope="module")
def chunks() -> list[bytes]:
    """Real KV bytes: each layer's keys and values of the prose sample, 64 tokens at a time."""
    cache = KVCache.load(SAMPLE)
    return [a[:, t:t + 64, :].tobytes() for a in cache.keys + cache.values for t in range(0, cache.num_tokens, 64)]


def record_size(key: str, value: bytes, meta: dict | None = None) -> int:
    return wrap(key, value, meta or {}).size


@pytest.fixture
def token() -> str:
    return secrets.token_urlsafe(32)


@contextlib.contextmanager
def serving(store: TieredStore, token: str, listen: str = "127.0.0.1:0", **kwargs):
    """A real server on its own thread, and a client for it."""
    server = ApiServer(store, token, listen, **kwargs).start()
    try:
        with ApiClient(server.url, token=token) as client:
            yield server, client
    finally:
        server.stop()


def tiered(tmp_path: Path, memory: str = "", file: str = "") -> TieredStore:
    store = open_store(f"memory://{memory},file://{tmp_path}/store{file}")
    assert isinstance(store, TieredStore)
    return store


@pytest.fixture(params=["tcp", "unix"])
def listen(request, tmp_path) -> str:
    return "127.0.0.1:0" if request.param == "tcp" else f"unix://{tmp_path}/api.sock"


class EventReader:
    """Reads the server's event stream on a thread into a queue."""

    def __init__(self, client: ApiClient, last_event_id: int | None = None) -> None:
        self.events: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(client, last_event_id), daemon=True)
        self._thread.start()

    def _read(self, client: ApiClient, last_event_id: int | None) -> None:
        try:
            for event in client.events(last_event_id):
                self.events.put(event)
        except ApiError as exc:
            self.events.put(exc)

    def until(self, kind: str, *keys: str, timeout_s: float = 20.0) -> list[dict]:
        """Every event up to and including the first ``kind`` event for each of ``keys``."""
        seen, waiting = [], set(keys)
        deadline = time.monotonic() + timeout_s
        while waiting:
            event = self.events.get(timeout=max(0.0, deadline - time.monotonic()))
            assert not isinstance(event, Exception), event
            seen.append(event)
            if event["event"] == kind:
                waiting.discard(event["data"]["key"])
        return seen


def wait_for_listener(server: ApiServer, count: int = 1) -> None:
    deadline = time.monotonic() + 10
    while server.api.context.hub.listeners < count:
        assert time.monotonic() < deadline, "the event stream did not open"
        time.sleep(0.01)


# --- every endpoint ------------------------------------------------------------------------------

def test_every_endpoint(tmp_path, token, listen, chunks):
    store = tiered(tmp_path)
    with store, serving(store, token, listen) as (server, api):
        assert api.health() == {"status": "ok", "version": __import__("kvtool").__version__}

        keys = KEYER.keys(PROMPT)
        for key, chunk in zip(keys, chunks):
            assert api.put(key, chunk, tokens=64) == {"key": key, "tier": "memory"}
        assert api.get(keys[0]) == chunks[0]
        assert api.get("absent") is None
        detail = api.entry(keys[1])
        assert detail["tier"] == "memory" and detail["tokens"] == 64 and detail["meta"] == {"tokens": 64}
        assert detail["bytes"] == record_size(keys[1], chunks[1], {"tokens": 64}) and not detail["pinned"]
        with pytest.raises(ApiError) as missing:
            api.entry("absent")
        assert missing.value.code == "not_found" and missing.value.status == 404

        listing = api.entries()
        assert listing["total"] == 4 and sorted(r["key"] for r in listing["entries"]) == sorted(keys)
        assert api.entries(offset=1, limit=2)["entries"] == listing["entries"][1:3]
        assert api.entries(tier="file")["total"] == 0

        stats = api.stats()
        assert stats["entries"] == 4 and [t["tier"] for t in stats["tiers"]] == ["memory", "file"]
        assert stats["policy"] == "lru with hints" and stats["api"]["event_streams"] == 0

        found = api.lookup(PROMPT + [7, 8, 9], model=KEYER.model_id, recipe=KEYER.recipe, salt="tenant-42",
                           chunk_tokens=64)
        assert found["stored_tokens"] == 256 and found["tokens"] == 259 and found["keys"] == keys
        assert found["tokens_by_tier"] == {"memory": 256}
        assert api.lookup(PROMPT, model=KEYER.model_id, recipe=KEYER.recipe, salt="tenant-7",
                          chunk_tokens=64)["stored_tokens"] == 0

        assert _statuses(api.pin(keys[:1] + ["absent"])) == [("pinned", "memory"), ("missing", None)]
        assert _statuses(api.offload(keys[:2])) == [("pinned", "memory"), ("moved", "file")]
        assert _statuses(api.unpin(keys[:2])) == [("unpinned", "memory"), ("not_pinned", "file")]
        assert _statuses(api.offload(keys[:1], to="file")) == [("moved", "file")]
        assert _statuses(api.prefetch(keys[:2], wait=True)) == [("in_top_tier", "memory")] * 2
        assert _statuses(api.offload(keys[:1], to=0)) == [("moved", "memory")]
        assert _statuses(api.touch(keys[:1] + ["absent"])) == [("touched", "memory"), ("missing", None)]
        assert _statuses(api.prefetch(keys[2:3])) == [("queued", "memory")]

        hinted = api.hint(keys[3:], returns_in_s=3600, offload=True)
        assert _statuses(hinted) == [("hinted", "file")]
        assert 3500 < api.entry(keys[3])["due_in_s"] <= 3600
        assert _statuses(api.hint(keys[3:], returns_in_s=None)) == [("hinted", "file")]
        assert api.entry(keys[3])["due_in_s"] is None

        prefix = {"tokens": PROMPT, "model": KEYER.model_id, "recipe": KEYER.recipe, "salt": "tenant-42",
                  "chunk_tokens": 64}
        assert [r["key"] for r in api.pin(prefix=prefix)["results"]] == keys
        assert api.unpin(prefix=prefix)["ok"] == 4
        assert _statuses(api.evict(keys[:1] + ["absent"])) == [("evicted", None), ("missing", None)]
        assert api.get(keys[0]) is None

        metrics = api.metrics()
        assert 'kvtool_store_entries{tier="memory"}' in metrics
        assert 'kvtool_store_events_total{kind="demoted"}' in metrics
        assert 'kvtool_api_requests_total{method="POST",route="/v1/pin",status="200"}' in metrics

        schema = api.openapi()
        served = {(path, method.upper()) for path, ops in schema["paths"].items() for method in ops}
        assert served == ENDPOINTS
        assert schema["paths"]["/v1/pin"]["post"]["security"] == [{"bearer": []}]
        assert "security" not in schema["paths"]["/v1/health"]["get"]
        assert schema["paths"]["/v1/pin"]["post"]["responses"]["401"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/ErrorBody"}


ENDPOINTS = {
    ("/v1/health", "GET"), ("/metrics", "GET"), ("/v1/stats", "GET"), ("/v1/entries", "GET"), ("/v1/entry", "GET"),
    ("/v1/entry/value", "GET"), ("/v1/entry/value", "PUT"), ("/v1/lookup", "POST"), ("/v1/pin", "POST"),
    ("/v1/unpin", "POST"), ("/v1/evict", "POST"), ("/v1/touch", "POST"), ("/v1/offload", "POST"),
    ("/v1/prefetch", "POST"), ("/v1/hint", "POST"), ("/v1/events", "GET"),
}


def _statuses(answer: dict) -> list[tuple[str, str | None]]:
    assert answer["ok"] == sum(r["ok"] for r in answer["results"])
    return [(r["status"], r["tier"]) for r in answer["results"]]


# --- authentication ----------------------------------------------------------------------------------

REQUESTS = {
    ("/v1/stats", "GET"): {}, ("/v1/entries", "GET"): {}, ("/v1/entry", "GET"): {"params": {"key": "k0"}},
    ("/v1/entry/value", "GET"): {"params": {"key": "k0"}},
    ("/v1/entry/value", "PUT"): {"params": {"key": "k0"}, "content": b"overwritten"},
    ("/v1/lookup", "POST"): {"json": {"tokens": [1, 2], "model": "m"}},
    ("/v1/events", "GET"): {},
    **{(f"/v1/{verb}", "POST"): {"json": {"keys": ["k0", "k1"]}} for verb in ("pin", "unpin", "evict", "touch", "prefetch")},
    ("/v1/offload", "POST"): {"json": {"keys": ["k0", "k1"], "to": -1}},
    ("/v1/hint", "POST"): {"json": {"keys": ["k0", "k1"], "returns_in_s": 60, "offload": True, "prefetch_ahead_s": 1}},
}


def test_missing_or_wrong_token_is_401_and_changes_nothing(tmp_path, token, listen, chunks):
    store = tiered(tmp_path)
    with store, serving(store, token, listen) as (server, api):
        assert {key for key in REQUESTS} | {("/v1/health", "GET"), ("/metrics", "GET")} == ENDPOINTS
        api.put("k0", chunks[0], tokens=64)
        api.put("k1", chunks[1])
        api.pin(["k1"])
        before = _state(store)
        raw = _raw_client(server.url)
        wrong = ({}, {"authorization": f"Bearer {token}x"}, {"authorization": f"Bearer {token[:-1]}"},
                 {"authorization": f"Basic {token}"}, {"authorization": token})
        for headers in wrong:
            for (path, method), request in REQUESTS.items():
                response = raw.request(method, path, headers=headers, **request)
                assert response.status_code == 401, (path, method, headers)
                assert response.json() == {"error": {"code": "unauthorized", "message": "missing or wrong bearer token"}}
                assert response.headers["www-authenticate"] == 'Bearer realm="kvtool"'
        time.sleep(0.2)  # a hint's prefetch, had one been scheduled, would have run
        assert _state(store) == before
        assert server.api.context.later.pending() == 0
        assert f'kvtool_api_refused_total{{reason="unauthorized"}} {len(wrong) * len(REQUESTS)}.0' in api.metrics()
        with pytest.raises(ApiError) as refused:
            ApiClient(server.url, token=token + "x").stats()
        assert refused.value.code == "unauthorized" and refused.value.exit_code == 5


def _state(store: TieredStore) -> dict:
    return {key: (store.tier_of(key), store.is_pinned(key), store.peek(key).record) for key in store.keys()}


def _raw_client(url: str) -> httpx.Client:
    if url.startswith("unix://"):
        return httpx.Client(transport=httpx.HTTPTransport(uds=url[len("unix://"):]), base_url="http://kvtool")
    return httpx.Client(base_url=url)


# --- many clients at once --------------------------------------------------------------------------------

def test_16_clients_200_calls_each_stay_consistent(tmp_path, token, chunks):
    clients, calls = 16, 200
    store = tiered(tmp_path)
    shared = [f"shared/{i}" for i in range(4)]
    with store, serving(store, token) as (server, api):
        for i, key in enumerate(shared):
            api.put(key, chunks[i])
        errors: list[BaseException] = []
        expected_pins: dict[str, bool] = {}
        lock = threading.Lock()

        def work(n: int) -> None:
            own = [f"client{n}/{i}" for i in range(4)]
            pinned = dict.fromkeys(own, False)
            try:
                with ApiClient(server.url, token=token) as client:
                    for i, key in enumerate(own):
                        assert client.put(key, chunks[(n * 4 + i) % len(chunks)], tokens=64)["key"] == key
                    for call in range(calls - len(own)):
                        key = own[call % 4]
                        step = call % 10
                        if step == 0:
                            assert client.pin([key])["ok"] == 1
                            pinned[key] = True
                        elif step == 1:
                            assert client.unpin([own[(call + 2) % 4]])["ok"] == int(pinned[own[(call + 2) % 4]])
                            pinned[own[(call + 2) % 4]] = False
                        elif step == 2:
                            result = client.offload([key])["results"][0]
                            assert result["status"] == ("pinned" if pinned[key] else "moved")
                        elif step == 3:
                            assert client.prefetch([key], wait=True)["ok"] == 1
                        elif step == 4:
                            assert client.touch(shared)["ok"] == len(shared)
                        elif step == 5:
                            assert client.get(shared[call % 4]) == chunks[call % 4]
                        elif step == 6:
                            assert client.hint([key], returns_in_s=60)["ok"] == 1
                        elif step == 7:
                            assert client.entry(key)["pinned"] == pinned[key]
                        elif step == 8:
                            assert client.prefetch(shared)["ok"] == len(shared)
                        else:
                            assert client.get(key) == chunks[(n * 4 + own.index(key)) % len(chunks)]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            with lock:
                expected_pins.update(pinned)

        threads = [threading.Thread(target=work, args=(n,)) for n in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert sorted(store.keys()) == sorted(shared + list(expected_pins))
        assert {key for key, pinned in expected_pins.items() if pinned} == {key for key in store.keys() if store.is_pinned(key)}
        for key in store.keys():
            assert store.tier_of(key) in ("memory", "file")
        requests = [line for line in api.metrics().splitlines() if line.startswith("kvtool_api_requests_total")]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in requests if 'status="200"' in line) >= clients * calls
        assert not any('status="5' in line or 'status="4' in line for line in requests)


# --- scheduling under pressure ------------------------------------------------------------------------------

def test_pinned_entry_survives_pressure_that_evicts_its_neighbours(tmp_path, token, chunks):
    size = record_size("entry-00", chunks[0], {"tokens": 64})
    store = tiered(tmp_path, memory=f"?capacity={3 * size}", file=f"?capacity={4 * size}")
    with store, serving(store, token) as (server, api):
        events = EventReader(api)
        wait_for_listener(server)
        api.put("entry-00", chunks[0], tokens=64)
        assert _statuses(api.pin(["entry-00"])) == [("pinned", "memory")]
        for i in range(1, 20):
            api.put(f"entry-{i:02d}", chunks[i], tokens=64)
        seen = events.until("stored", "entry-19")
        evicted = {e["data"]["key"] for e in seen if e["event"] == "evicted"}
        demoted = {e["data"]["key"] for e in seen if e["event"] == "demoted"}
        assert len(evicted) == 20 - 3 - 4 and "entry-00" not in evicted | demoted
        assert api.entry("entry-00")["tier"] == "memory" and api.get("entry-00") == chunks[0]
        assert api.entries(tier="memory")["total"] == 3 and api.entries(tier="file")["total"] == 4
        assert _statuses(api.evict(["entry-00"])) == [("pinned", "memory")]


def test_prefetch_moves_an_entry_from_file_to_memory_before_the_request(tmp_path, token, chunks):
    store = tiered(tmp_path)
    with store, serving(store, token) as (server, api):
        keys = KEYER.keys(PROMPT)
        assert store.put_prefix(KEYER, PROMPT, chunks[:4]) == 4
        assert api.offload(keys)["ok"] == 4
        assert {store.tier_of(key) for key in keys} == {"file"}
        events = EventReader(api)
        wait_for_listener(server)
        # The tool call returns in 0.5 s; bring the cache back 0.4 s ahead.
        assert api.hint(prefix={"tokens": PROMPT, "model": KEYER.model_id, "recipe": KEYER.recipe,
                                "salt": "tenant-42", "chunk_tokens": 64},
                        returns_in_s=0.5, prefetch_ahead_s=0.4)["ok"] == 4
        events.until("promoted", *keys)
        assert {store.tier_of(key) for key in keys} == {"memory"}
        file_hits = store.tiers[1].stats()["hits"]
        hit = store.get_prefix(KEYER, PROMPT + [5, 6])  # the request arrives
        assert hit.tokens == 256 and hit.values == chunks[:4]
        assert store.tiers[1].stats()["hits"] == file_hits  # nothing was read from the file tier on the request's path


def test_a_hint_sends_the_entry_needed_last_out_first(tmp_path, token, chunks):
    size = record_size("a", chunks[0])
    store = tiered(tmp_path, memory=f"?capacity={3 * size}")
    with store, serving(store, token) as (server, api):
        for key, chunk in zip("abc", chunks):
            api.put(key, chunk)
        api.touch(["a"])  # by recency alone, b would leave first
        api.hint(["c"], returns_in_s=600)  # but c is not needed for ten minutes
        api.put("d", chunks[3])
        assert [store.tier_of(k) for k in "abcd"] == ["memory", "memory", "file", "memory"]
        api.hint(["b"], returns_in_s=0)  # b is due now: it stays while a leaves
        api.put("e", chunks[4])
        assert [store.tier_of(k) for k in "abde"] == ["file", "memory", "memory", "memory"]


def test_hinted_policy_order_and_lapse():
    policy = HintedPolicy(LRUPolicy(), soon_s=5)
    now = 1000.0
    placements = [Placement(key, 0, 10, None, last_access=now - age) for key, age in
                  (("old", 50), ("middle", 40), ("later", 30), ("latest", 20), ("soon", 10))]
    policy.hint("later", 100, now=now - 1)
    policy.hint("latest", 300, now=now - 1)
    policy.hint("soon", 3, now=now - 1)
    order = [p.key for p in policy.coldest_first(placements, None, now)]
    assert order == ["latest", "later", "old", "middle", "soon"]
    placements[2].last_access = now  # "later" was used: its hint has lapsed
    order = [p.key for p in policy.coldest_first(placements, None, now + 1)]
    assert order == ["latest", "old", "middle", "later", "soon"]
    assert policy.due_in("soon", now=now) == pytest.approx(2) and policy.due_in("later") is None
    order = [p.key for p in policy.coldest_first(placements, None, now + 20)]
    assert order == ["latest", "old", "middle", "soon", "later"]  # "soon" is long overdue: its hint lapsed too
    assert policy.due_in("soon", now=now + 20) is None


# --- the event stream ---------------------------------------------------------------------------------------

def test_event_stream_sees_each_change(tmp_path, token, listen, chunks):
    store = tiered(tmp_path)
    with store, serving(store, token, listen) as (server, api):
        events = EventReader(api)
        wait_for_listener(server)
        api.put("k", chunks[0], tokens=64)
        api.pin(["k"])
        api.unpin(["k"])
        api.offload(["k"])
        api.prefetch(["k"], wait=True)
        api.hint(["k"], returns_in_s=30)
        api.evict(["k"])
        seen = events.until("evicted", "k")
        assert [(e["event"], e["data"]["tier"], e["data"].get("from_tier")) for e in seen] == [
            ("stored", "memory", None), ("pinned", "memory", None), ("unpinned", "memory", None),
            ("demoted", "file", "memory"), ("promoted", "memory", "file"), ("hinted", "memory", None),
            ("evicted", "memory", None),
        ]
        assert seen[5]["data"]["returns_in_s"] == 30
        ids = [e["id"] for e in seen]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)

        replayed = EventReader(api, last_event_id=ids[3])  # a client that reconnects misses nothing
        assert [e["id"] for e in replayed.until("evicted", "k")] == ids[4:]


def test_event_streams_are_bounded_and_end_with_the_server(tmp_path, token):
    store = tiered(tmp_path)
    with store, serving(store, token, limits=Limits(max_event_streams=1)) as (server, api):
        first = EventReader(api)
        wait_for_listener(server)
        with pytest.raises(ApiError) as refused:
            next(iter(api.events()))
        assert refused.value.code == "unavailable" and refused.value.status == 503
    first._thread.join(timeout=10)
    assert not first._thread.is_alive()


# --- limits and errors ------------------------------------------------------------------------------------

def test_request_size_and_shape_limits(tmp_path, token, chunks):
    store = tiered(tmp_path)
    limits = Limits(max_json_bytes=64 << 10, max_value_bytes=len(chunks[0]))
    with store, serving(store, token, limits=limits) as (server, api):
        raw = _raw_client(server.url)
        auth = {"authorization": f"Bearer {token}"}
        too_big = raw.put("/v1/entry/value", params={"key": "big"}, content=chunks[0] + b"x", headers=auth)
        assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "payload_too_large"

        def chunked():
            yield chunks[0]
            yield b"more"

        streamed = raw.put("/v1/entry/value", params={"key": "big"}, content=chunked(), headers=auth)
        assert streamed.status_code == 413
        big_json = raw.post("/v1/pin", json={"keys": ["k" * 1000] * 100}, headers=auth)
        assert big_json.status_code == 413
        assert store.keys() == []

        for response, code in (
            (raw.post("/v1/pin", content=b"{not json", headers={**auth, "content-type": "application/json"}), "invalid_request"),
            (raw.post("/v1/pin", json={"keys": ["a"], "prefix": {"tokens": [1], "model": "m"}}, headers=auth), "invalid_request"),
            (raw.post("/v1/pin", json={"keys": ["k"] * 5000}, headers=auth), "invalid_request"),
            (raw.post("/v1/offload", json={"keys": ["a"], "to": "tape"}, headers=auth), "invalid_request"),
            (raw.post("/v1/lookup", json={"tokens": [-1], "model": "m"}, headers=auth), "invalid_request"),
            (raw.post("/v1/lookup", json={"tokens": [1], "model": "m", "scheme": "other"}, headers=auth), "invalid_request"),
            (raw.post("/v1/hint", json={"keys": ["a"], "returns_in_s": -1}, headers=auth), "invalid_request"),
            (raw.get("/v1/entry", params={"key": "a\nb"}, headers=auth), "invalid_request"),
            (raw.get("/v1/nowhere", headers=auth), "not_found"),
            (raw.delete("/v1/pin", headers=auth), "method_not_allowed"),
        ):
            assert response.json()["error"]["code"] == code, response.text


def test_rate_limit_per_client(tmp_path, token):
    store = tiered(tmp_path)
    with store, serving(store, token, limits=Limits(rate=0.01, burst=3)) as (server, api):
        raw = _raw_client(server.url)
        statuses = [raw.get("/v1/stats", headers={"authorization": f"Bearer {token}"}).status_code for _ in range(3)]
        assert statuses == [200, 200, 200]
        limited = raw.post("/v1/pin", json={"keys": ["a"]})  # refused before its token is even checked
        assert limited.status_code == 429 and limited.json()["error"]["code"] == "rate_limited"
        assert int(limited.headers["retry-after"]) == 100


def test_keys_never_become_paths(tmp_path, token, chunks):
    root = tmp_path / "inside"
    store = open_store(f"memory://?capacity=1KiB,file://{root}")
    keys = ["../../outside", "/etc/kvtool-test", "..%2F..%2Foutside", "a/../../b", "C:\\x", "~/home"]
    with store, serving(store, token) as (server, api):
        for key, chunk in zip(keys, chunks):
            api.put(key, chunk)
        for key, chunk in zip(keys, chunks):
            assert api.get(key) == chunk and api.entry(key)["tier"] == "file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inside"]
    assert not Path("/etc/kvtool-test").exists()
    assert len(list((root / "entries").rglob("*.kve"))) == len(keys)


def test_non_loopback_needs_an_explicit_flag(tmp_path, token, caplog):
    store = tiered(tmp_path)
    with store:
        with pytest.raises(Exception, match="not a loopback address"):
            ApiServer(store, token, "0.0.0.0:0")
        server = ApiServer(store, token, "0.0.0.0:0", allow_remote=True)
        server.start()
        try:
            assert "without TLS" in caplog.text
            port = int(server.url.rsplit(":", 1)[1])
            with ApiClient(f"http://127.0.0.1:{port}", token=token) as api:
                assert api.health()["status"] == "ok"
        finally:
            server.stop()


def test_unix_socket_is_private(tmp_path, token):
    store = tiered(tmp_path)
    socket_path = tmp_path / "run" / "api.sock"
    with store, serving(store, token, f"unix://{socket_path}"):
        assert socket_path.is_socket() and socket_path.stat().st_mode & 0o777 == 0o600
    assert not socket_path.exists()


def test_unreachable_server_is_one_clear_error(tmp_path, token):
    with ApiClient(f"unix://{tmp_path}/nobody.sock", token=token) as api:
        with pytest.raises(ApiError) as error:
            api.stats()
    assert error.value.code == "unreachable" and "nobody.sock" in str(error.value)


# --- the schema matches what is served --------------------------------------------------------------------

def test_responses_match_the_openapi_schema(tmp_path, token, chunks):
    store = tiered(tmp_path)
    with store, serving(store, token) as (server, api):
        schema = api.openapi()
        raw = _raw_client(server.url)
        auth = {"authorization": f"Bearer {token}"}
        api.put("k0", chunks[0], tokens=64)
        calls = [
            ("GET", "/v1/health", {}), ("GET", "/v1/stats", {}), ("GET", "/v1/entries", {}),
            ("GET", "/v1/entry", {"params": {"key": "k0"}}), ("GET", "/v1/entry", {"params": {"key": "nope"}}),
            ("GET", "/v1/entry/value", {"params": {"key": "nope"}}),
            ("PUT", "/v1/entry/value", {"params": {"key": "k1", "tokens": 3}, "content": chunks[1]}),
            ("POST", "/v1/lookup", {"json": {"tokens": list(range(100)), "model": "m", "chunk_tokens": 16}}),
            ("POST", "/v1/lookup", {"json": {"tokens": "not a list"}}),
            ("POST", "/v1/pin", {"json": {"keys": ["k0", "nope"]}}), ("POST", "/v1/unpin", {"json": {"keys": ["k0"]}}),
            ("POST", "/v1/touch", {"json": {"keys": ["k0"]}}), ("POST", "/v1/offload", {"json": {"keys": ["k0"], "to": "file"}}),
            ("POST", "/v1/prefetch", {"json": {"keys": ["k0"], "wait": True}}),
            ("POST", "/v1/hint", {"json": {"keys": ["k0"], "returns_in_s": 5}}),
            ("POST", "/v1/evict", {"json": {"keys": ["k1"]}}), ("POST", "/v1/evict", {"json": {}}),
        ]
        checked = set()
        for method, path, request in calls:
            response = raw.request(method, path, headers=auth, **request)
            operation = schema["paths"][path][method.lower()]
            declared = operation["responses"][str(response.status_code)]["content"]["application/json"]["schema"]
            jsonschema.validate(response.json(), {**declared, "components": schema["components"]})
            checked.add((response.status_code >= 400, path, method))
        assert {(path, method) for error, path, method in checked if not error} == ENDPOINTS - {
            ("/metrics", "GET"), ("/v1/entry/value", "GET"), ("/v1/events", "GET")}  # not JSON: checked above
        assert {error for error, _, _ in checked} == {True, False}
