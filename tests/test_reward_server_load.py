"""The reward server under load and under a slow-client (slowloris) attack, on loopback only,
bounded in count and time.

Before: 200 half-sent headers held 201 threads and 206 file descriptors for over a minute (no
socket timeout, one thread per connection, no cap); a listen backlog of 5 reset connections at
20 concurrent clients; JSON nested 100,000 deep answered 500 instead of 400.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import httpx
import pytest

TARGET = "tempering.plugins.rewards.testing:length"
BODY = {"samples": [{"completion": "abc", "example": {}}]}


@pytest.fixture
def served(reward_server):
    def start(**kw):
        url, stop = reward_server(TARGET, **kw)
        return url, stop.server  # type: ignore[attr-defined]

    return start


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts file descriptors through /proc")
def test_half_sent_requests_are_dropped_within_the_read_timeout_without_leaking(served):
    url, _server = served(read_timeout=0.5, workers=8)
    port = int(url.rsplit(":", 1)[1])
    threads0, fds0 = threading.active_count(), open_fds()
    slow: list[socket.socket] = []
    try:
        for _i in range(50):  # headers started, never finished; half of them dribbling a byte now and then
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            slow.append(s)
        peak_threads = threading.active_count()
        t0 = time.monotonic()
        dropped = [False] * len(slow)
        while not all(dropped) and time.monotonic() - t0 < 8:
            for i, s in enumerate(slow):
                if dropped[i]:
                    continue
                s.settimeout(0.01)
                try:
                    if i % 2:
                        s.sendall(b"x")  # a dribbling client: each byte comes well within the timeout
                    data = s.recv(4096)
                except TimeoutError:
                    continue
                except OSError:  # reset: dropped too
                    data = b""
                dropped[i] = not data or data.startswith(b"HTTP/1.1 408")
            peak_threads = max(peak_threads, threading.active_count())
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        # 8 workers and a queue of waiting connections, each given 0.5 s: all 50 gone well within 8 s
        assert all(dropped), f"{dropped.count(False)} of 50 slow connections still open after {elapsed:.1f}s"
        assert peak_threads <= threads0 + 8, f"{peak_threads - threads0} threads for 50 slow clients (pool of 8)"
        # a real request is served at once afterwards
        with httpx.Client(trust_env=False, timeout=5) as c:
            assert c.post(f"{url}/score", json=BODY).json()["rewards"] == [3.0]
    finally:
        for s in slow:
            s.close()
    assert wait_until(lambda: open_fds() <= fds0 + 2, 5), f"{open_fds() - fds0} file descriptors left open"
    assert threading.active_count() <= threads0 + 8


def test_a_full_server_refuses_more_connections_with_503_and_recovers(served):
    url, _ = served(read_timeout=10, workers=2, max_connections=4)
    port = int(url.rsplit(":", 1)[1])
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
    try:
        for s in held:
            s.sendall(b"GET /health HTTP/1.1\r\n")  # unfinished: each holds a place
        time.sleep(0.1)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"Connection: close" in reply, reply
    finally:
        for s in held:
            s.close()
    with httpx.Client(trust_env=False, timeout=5) as c:
        assert c.get(f"{url}/health").json()["status"] == "ok"


@pytest.mark.parametrize("clients", [20, 50])
def test_concurrent_clients_get_no_connection_reset(served, clients):
    url, _ = served()
    rounds = 10  # a new connection per request: clients x rounds connections in a few seconds
    errors: list[str] = []
    results: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def client() -> None:
        with httpx.Client(trust_env=False, timeout=30) as c:
            barrier.wait()
            for _ in range(rounds):
                try:  # "Connection: close": each request opens a connection of its own
                    r = c.post(f"{url}/score", json=BODY, headers={"Connection": "close"})
                    with lock:
                        results.extend(r.json()["rewards"]) if r.status_code == 200 else errors.append(r.text)
                except httpx.HTTPError as exc:
                    with lock:
                        errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "clients still running after 60 s"
    assert not errors, f"{len(errors)} of {clients * rounds} requests failed, e.g. {errors[:3]}"
    assert results == [3.0] * (clients * rounds), f"took {time.monotonic() - t0:.1f}s"


def test_keep_alive_clients_beyond_the_pool_are_still_served(served):
    """More keep-alive clients than workers: an idle kept-alive connection must not hold a worker
    while others wait (the server closes it after its answer when connections are queued)."""
    url, _ = served(workers=4, read_timeout=30)
    errors: list[str] = []
    barrier = threading.Barrier(12)

    def client() -> None:
        barrier.wait()
        with httpx.Client(trust_env=False, timeout=10) as c:
            for _ in range(5):
                try:
                    r = c.post(f"{url}/score", json=BODY)
                    assert r.json()["rewards"] == [3.0]
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"{type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client) for _ in range(12)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    elapsed = time.monotonic() - t0
    assert not errors, errors[:3]
    assert elapsed < 10, f"12 keep-alive clients on 4 workers took {elapsed:.1f}s: idle connections held workers"


def test_json_nested_too_deep_is_a_400(served):
    url, _ = served()
    with httpx.Client(trust_env=False, timeout=10) as c:
        deep = c.post(f"{url}/score", content=b"[" * 100_000 + b"]" * 100_000)
        assert deep.status_code == 400 and "nested" in deep.json()["error"], deep.text
        assert c.post(f"{url}/score", json=BODY).json()["rewards"] == [3.0]  # and it still serves


def test_the_token_is_checked_before_the_body_is_read(served):
    """A client without the token that announces a body and never sends it is answered 401 at
    once and disconnected, not left holding a worker until the read timeout."""
    url, _ = served(token="s3cret-token-for-tests-0123456789", read_timeout=30)
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST /score HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n\r\n")
        t0 = time.monotonic()
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 401"), reply
        s.settimeout(5)
        while s.recv(4096):  # the server closes the connection
            pass
        assert time.monotonic() - t0 < 3
