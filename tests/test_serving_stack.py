"""The shared server stack itself (``tempering.runs.serving``): the limits uvicorn lacks -- a
head timeout, a body timeout, a connection cap -- answered in the server's error shape, a stop
that does not wait for a request blocked forever, and a server bug counted with its first
traceback. The hostile-client suite against the four real servers is test_server_hardening.py.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tempering.runs.serving import BackgroundServer, Call, Limits, Policy, Reply, guarded_app
from tempering.runs.serving.guard import decode_json, json_depth


@pytest.fixture
def serve() -> Iterator[Callable[..., BackgroundServer]]:
    made: list[BackgroundServer] = []

    def start(answer: Callable[[Call], Reply] | None = None, **limits: Any) -> BackgroundServer:
        rules = Policy(
            error_body=lambda status, message: {"problem": message, "status": status},
            is_json=lambda *_: True,
            limits=Limits(**limits),
        )
        server = BackgroundServer(guarded_app(rules, answer or (lambda call: Reply(200, {"ok": True}))), rules)
        made.append(server.start())
        return server

    yield start
    for server in made:
        server.close()


def _connect(server: BackgroundServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5)


def _answer(s: socket.socket) -> tuple[int, dict[str, Any]]:
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def test_a_request_head_that_never_ends_is_a_408_within_the_head_timeout(serve) -> None:
    server = serve(header_timeout=0.3)
    with _connect(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        t0 = time.monotonic()
        for _ in range(5):  # dribbling keeps nothing alive
            time.sleep(0.05)
            s.sendall(b"x")
        status, body = _answer(s)
    assert status == 408 and body == {"problem": "the request head did not arrive within 0.3 s", "status": 408}
    assert 0.25 < time.monotonic() - t0 < 1.5
    assert server.counters.refused["timeout"] == 1


def test_an_idle_connection_is_closed_silently_and_a_body_that_never_ends_is_a_408(serve) -> None:
    server = serve(header_timeout=0.3, body_timeout=0.3)
    with _connect(server) as s:
        assert s.recv(10) == b""  # nothing sent: closed without an answer after the head timeout
    with _connect(server) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
        status, body = _answer(s)
    assert status == 408 and "body did not arrive within 0.3 s" in body["problem"]


def test_connections_beyond_the_cap_are_a_503_and_the_server_recovers(serve) -> None:
    server = serve(max_connections=3)
    held = [_connect(server) for _ in range(3)]
    try:
        time.sleep(0.1)
        with _connect(server) as extra:
            status, body = _answer(extra)
        assert status == 503 and "3 connections open" in body["problem"]
    finally:
        for s in held:
            s.close()
    time.sleep(0.1)
    with _connect(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        assert _answer(s) == (200, {"ok": True})


def test_close_does_not_wait_for_a_request_blocked_forever(serve, capfd) -> None:
    entered = threading.Event()

    def blocked(call: Call) -> Reply:
        entered.set()
        threading.Event().wait()  # a model that never answers
        raise AssertionError

    server = serve(blocked)
    with _connect(server) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert entered.wait(5)
        t0 = time.monotonic()
        server.close()
        assert time.monotonic() - t0 < 2
        assert s.recv(10) == b""  # the connection is dropped
    out, err = capfd.readouterr()
    assert out + err == ""


def test_a_server_bug_is_a_500_counted_with_its_first_traceback_logged_once(serve, caplog) -> None:
    def buggy(call: Call) -> Reply:
        raise KeyError("oops")

    server = serve(buggy)
    for _ in range(3):
        with _connect(server) as s:
            s.sendall(b"GET /x HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert _answer(s) == (500, {"problem": "KeyError: 'oops'", "status": 500})
    assert server.counters.errors == 3 and server.counters.first_error == "KeyError: 'oops'"
    logged = [r for r in caplog.records if r.name == "tempering.serving"]
    assert len(logged) == 1 and logged[0].levelno == logging.ERROR and logged[0].exc_info is not None


def test_json_depth_is_measured_without_recursion() -> None:
    assert json_depth(1) == 0 and json_depth([]) == 1 and json_depth({"a": [1, {"b": []}]}) == 4
    deep: Any = []
    for _ in range(50_000):
        deep = [deep]
    assert json_depth(deep) == 50_001
    assert decode_json(b'{"a": [1]}', 2) == {"a": [1]}
    with pytest.raises(Exception, match="nested 3 levels deep; the limit is 2"):
        decode_json(b'{"a": [[1]]}', 2)


def test_a_client_that_stops_reading_is_dropped_after_the_body_timeout(serve, capfd) -> None:
    server = serve(lambda call: Reply(200, b"x" * (64 << 20), "application/octet-stream"), body_timeout=0.5)
    with _connect(server) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        deadline = time.monotonic() + 10
        while server.counters.refused["slow_reader"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # never reading the 64 MB answer
    assert server.counters.refused["slow_reader"] == 1
    out, err = capfd.readouterr()
    assert out + err == ""


def test_a_client_that_disconnects_mid_request_is_no_error(serve, capfd) -> None:
    done = threading.Event()

    def slow(call: Call) -> Reply:
        time.sleep(0.3)
        done.set()
        return Reply(200, {"late": True})

    server = serve(slow)
    with _connect(server) as s:
        s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 2\r\n\r\n{}")
    assert done.wait(5)
    time.sleep(0.1)
    assert server.counters.errors == 0
    out, err = capfd.readouterr()
    assert out + err == ""
