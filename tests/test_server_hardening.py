"""Hostile clients against every tempering server: ``serve-reward``, ``tempering view``, the agent
sampler's OpenAI-compatible endpoint and ``serve-tinker``, all on the one stack of
:mod:`tempering.runs.serving`. Raw sockets for the hostile parts; loopback only; bounded in
count and time.

Before (the stdlib servers, issue 34): a foreign ``Host`` was answered 200 by serve-tinker (DNS
rebinding could train and delete); a 150 MB body was read in full before the key was checked
(+150 MB RSS); 300 half-sent requests held 300 threads, and a real request behind 64 slow ones
waited 57-178 s on serve-reward; 263 of 500 simultaneous connects were refused (backlog 5);
JSON nested 100,000 deep was a 500 RecursionError; ``Content-Length: abc`` dropped the
connection with a traceback, and 300 disconnecting clients printed 6,304 lines of tracebacks.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

TOKEN = "hardening-secret-0123456789abcdef"
TINKER_KEY = "tml-hardening-key"


@dataclass
class Target:
    """A started server, as the hostile client sees it."""

    name: str
    port: int
    auth: dict[str, str]  # headers that pass authentication ({} where the server has none)
    ok_path: str  # a GET the server answers 200 with those headers
    post_path: str  # where a JSON body goes ("" where the server takes no bodies)
    counters: Any
    close: Any = field(repr=False)


def _reward() -> Target:
    from tempering.plugins.rewards.server import start_server

    _url, stop = start_server("tempering.plugins.rewards.testing:length", token=TOKEN)
    server = stop.server  # type: ignore[attr-defined]
    return Target(
        "serve-reward",
        server.server_address[1],
        {"Authorization": f"Bearer {TOKEN}"},
        "/health",
        "/score",
        server.counters,
        stop,
    )


def _view(tmp: Path) -> Target:
    from tempering.apps.view.server import ViewServer

    (tmp / "metrics.jsonl").write_text(json.dumps({"step": 1, "stage": "rl", "reward": 0.5}) + "\n")
    server = ViewServer(str(tmp)).start()
    return Target("view", server.httpd.server_address[1], {}, "/api/metrics", "", server.httpd.counters, server.close)


def _endpoint() -> Target:
    from tempering.plugins.samplers.openai_endpoint import EndpointLimits, PolicyEndpoint

    def no_model(key: int, prompt: list[int], max_tokens: int) -> Any:
        raise AssertionError("the hostile client never reaches the model")

    endpoint = PolicyEndpoint(no_model, None, None, EndpointLimits(max_tokens=4)).start()
    episode = endpoint.open_episode(0)
    assert endpoint._server is not None
    return Target(
        "agent-endpoint",
        endpoint._server.server_address[1],
        {"Authorization": f"Bearer {endpoint.token}"},
        f"/{episode.slug}/v1/models",
        f"/{episode.slug}/v1/chat/completions",
        endpoint._server.counters,
        endpoint.close,
    )


def _tinker() -> Target:
    from tempering.plugins.tinker_server.server import LocalTinkerServer

    server = LocalTinkerServer(api_keys={TINKER_KEY}).start()
    return Target(
        "serve-tinker",
        server._http.server_address[1],
        {"X-API-Key": TINKER_KEY},
        "/api/v1/client/config",
        "/api/v1/create_session",
        server._http.counters,
        server.stop,
    )


ALL = ["serve-reward", "view", "agent-endpoint", "serve-tinker"]
#: The servers that take a key and request bodies (the viewer has no login and only reads).
KEYED = ["serve-reward", "agent-endpoint", "serve-tinker"]
every_server = pytest.mark.parametrize("target", ALL, indirect=True)
keyed_servers = pytest.mark.parametrize("target", KEYED, indirect=True)


@pytest.fixture(scope="module")
def target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    made = {
        "serve-reward": _reward,
        "view": lambda: _view(tmp_path_factory.mktemp("run")),
        "agent-endpoint": _endpoint,
        "serve-tinker": _tinker,
    }[request.param]()
    yield made
    made.close()


@pytest.fixture(autouse=True)
def no_tracebacks(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Whatever a hostile client does, nothing is printed or logged as an error."""
    yield
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err, (out + err)[-3000:]
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text[-3000:]


def _head(method: str, path: str, headers: dict[str, str], host: str = "127.0.0.1") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read(s: socket.socket) -> tuple[int, bytes]:
    """One answer: its status and body (read until the declared length is in, or closed)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?i)content-length: *(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def _ask(t: Target, raw: bytes, timeout: float = 5.0) -> tuple[int, bytes]:
    """Send ``raw`` on a fresh connection: the answer's status and body."""
    with socket.create_connection(("127.0.0.1", t.port), timeout=timeout) as s:
        s.sendall(raw)
        return _read(s)


def _post(t: Target, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    more = {"Content-Type": "application/json", "Content-Length": str(len(body)), **t.auth, **(headers or {})}
    return _ask(t, _head("POST", t.post_path, more) + body)


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


@every_server
def test_a_real_request_is_answered(target: Target) -> None:
    status, body = _ask(target, _head("GET", target.ok_path, target.auth))
    assert status == 200, body


@every_server
def test_a_foreign_host_is_refused(target: Target) -> None:
    for host in ("attacker.example", "127.0.0.1.attacker.example:80", "10.0.0.5"):
        status, body = _ask(target, _head("GET", target.ok_path, target.auth, host=host))
        assert status == 403 and b"DNS rebinding" in body, (host, status, body)


@keyed_servers
def test_a_missing_or_wrong_key_is_refused_before_the_body_is_read(target: Target) -> None:
    name = next(iter(target.auth))
    for headers in ({}, {name: "Bearer wrong" if name == "Authorization" else "tml-wrong"}):
        with socket.create_connection(("127.0.0.1", target.port), timeout=5) as s:
            # a body announced and never sent: the answer cannot wait for it
            s.sendall(_head("POST", target.post_path or target.ok_path, {**headers, "Content-Length": "10000000"}))
            t0 = time.monotonic()
            reply = s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 401"), reply
            while s.recv(65536):  # and the connection is closed (the unread body is not drained)
                pass
            assert time.monotonic() - t0 < 2


@every_server
def test_a_150_mb_body_is_refused_413_without_being_read(target: Target) -> None:
    chunk = b"x" * (1 << 20)
    rss0 = _rss_kb()
    with socket.create_connection(("127.0.0.1", target.port), timeout=10) as s:
        headers = {**target.auth, "Content-Type": "application/json", "Content-Length": str(150 * len(chunk))}
        s.sendall(_head("POST", target.post_path or target.ok_path, headers) + chunk)
        status, reply = _read(s)
        assert status == 413 and b"limit of" in reply, reply
        sent = 1
        try:  # the server closed the connection: the rest of the body has nowhere to go
            for sent in range(2, 151):  # noqa: B007
                s.sendall(chunk)
        except OSError:
            pass
    grown = (_rss_kb() - rss0) / 1024
    assert sent < 150, "the server went on reading a body it had refused"
    assert grown < 20, f"RSS grew {grown:.1f} MB"
    print(f"\n{target.name}: 150 MB body -> 413, RSS growth {grown:.1f} MB, {sent} MB sent before the close")


@every_server
def test_300_slowloris_connections_do_not_delay_a_real_request(target: Target) -> None:
    threads0 = threading.active_count()
    slow = []
    try:
        for i in range(300):
            s = socket.create_connection(("127.0.0.1", target.port), timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow-%d: " % i)  # a head never finished
            slow.append(s)
        t0 = time.monotonic()
        with httpx.Client(trust_env=False, timeout=10) as c:
            answer = c.get(f"http://127.0.0.1:{target.port}{target.ok_path}", headers=target.auth)
        latency = time.monotonic() - t0
        assert answer.status_code == 200 and latency < 2, (answer.status_code, latency)
        assert threading.active_count() - threads0 < 10, "slow clients hold threads"
        print(f"\n{target.name}: real request behind 300 slowloris connections answered in {latency * 1000:.0f} ms")
    finally:
        for s in slow:
            s.close()


@every_server
def test_500_simultaneous_connections_are_all_answered(target: Target) -> None:
    """Below the cap (1024 connections) none is refused: all connect at once, then each asks."""
    barrier = threading.Barrier(50)

    def connect(_: int) -> list[socket.socket]:
        barrier.wait()
        return [socket.create_connection(("127.0.0.1", target.port), timeout=10) for _ in range(10)]

    with ThreadPoolExecutor(50) as pool:
        socks = [s for group in pool.map(connect, range(50)) for s in group]
    try:
        request = _head("GET", target.ok_path, target.auth)
        for s in socks:
            s.sendall(request)
        statuses = []
        for s in socks:
            s.settimeout(20)
            statuses.append(s.recv(64)[:12])
    finally:
        for s in socks:
            s.close()
    assert statuses == [b"HTTP/1.1 200"] * 500, {x: statuses.count(x) for x in set(statuses)}
    print(f"\n{target.name}: 500 of 500 simultaneous connections answered 200")


@keyed_servers
@pytest.mark.parametrize(
    "body, reason",
    [
        (b"{not json", b"not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, b"nested"),
        (b'{"a": ' * 100 + b"1" + b"}" * 100, b"nested 100 levels"),
    ],
    ids=["malformed", "nested-100000", "nested-100"],
)
def test_bad_json_is_a_400_naming_the_problem(target: Target, body: bytes, reason: bytes) -> None:
    status, answer = _post(target, body)
    assert status == 400 and reason in answer, (status, answer[:300])


@every_server
def test_a_bad_content_length_is_a_400(target: Target) -> None:
    for value in ("abc", "-5", "1, 2"):
        status, body = _ask(
            target, _head("POST", target.post_path or target.ok_path, {**target.auth, "Content-Length": value})
        )
        assert status == 400 and b"Content-Length" in body, (value, status, body)
        json.loads(body)  # in the server's JSON error shape


@every_server
def test_refusals_are_counted_not_printed(target: Target) -> None:
    _ask(target, _head("GET", target.ok_path, target.auth, host="attacker.example"))
    assert target.counters.refused["host"] >= 1 and target.counters.errors == 0


def test_no_http_server_or_socketserver_import_is_left() -> None:
    """One stack for every server: the standard library's HTTP servers are gone from the code."""
    root = Path(__file__).resolve().parents[1]
    found = subprocess.run(
        [
            "grep",
            "-rlE",
            r"^\s*(from|import) +(http\.server|socketserver)\b",
            "--include=*.py",
            "core",
            "plugins",
            "algorithms",
            "examples",
            "benchmarks",
            "tests",
        ],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert found == [], found
