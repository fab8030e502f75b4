"""Serve a reward function over HTTP: ``tempering serve-reward MODULE:FUNC [--host --port]``.

One endpoint does the work, ``POST /score``::

    request:  {"samples": [{"completion": "...", "example": {...}}, ...]}
    response: {"rewards": [0.5, null, ...], "errors": [null, "ValueError: ...", ...],
               "infos": [{...}, {}, ...]}

with one entry per sample: a sample whose reward raised, timed out or returned NaN gets
``reward: null`` and its error, and the others are still scored (the request succeeds with
200). A malformed request is a 400. ``GET /health`` answers ``{"status": "ok", ...}``.

Rewards run with the same semantics as in training (:class:`~tempering.scoring.RewardRunner`):
sync or ``async def``, float or :class:`~tempering.interfaces.RewardResult`. The server is the
stdlib ``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1 keep-alive); an async
reward's samples of one request are scored concurrently on an event loop.
"""

from __future__ import annotations

import inspect
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tempering.plugins.rewards._common import json_safe, reward_name
from tempering.scoring import RewardRunner
from tempering.types import Completion, Sample

MAX_BODY = 64 * 1024 * 1024


def load_reward(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """``"module:func"`` (a class there is instantiated without arguments), a registered reward
    name, or a callable."""
    from tempering.plugins.rewards._common import resolve_reward

    return resolve_reward(target, path="serve-reward")


def score_payload(runner: RewardRunner, payload: Any) -> dict[str, Any]:
    """The ``/score`` response for a decoded request body (raises ``ValueError`` if malformed)."""
    if not isinstance(payload, Mapping) or not isinstance(payload.get("samples"), list):
        raise ValueError('expected a JSON object {"samples": [{"completion": str, "example": {...}}, ...]}')
    samples = []
    for i, item in enumerate(payload["samples"]):
        if not isinstance(item, Mapping) or not isinstance(item.get("completion"), str):
            raise ValueError(f"samples[{i}]: expected {{'completion': str, 'example': {{...}}}}")
        example = item.get("example") or {}
        if not isinstance(example, Mapping):
            raise ValueError(f"samples[{i}].example: expected an object")
        samples.append(Sample(example=dict(example), completion=Completion([], [], [], text=item["completion"])))
    runner.score(samples)
    return {
        "rewards": [None if s.failed else s.reward for s in samples],
        "errors": [s.error if s.failed else None for s in samples],
        "infos": [json_safe(s.reward_info) if not s.failed else {} for s in samples],
    }


class RewardHTTPServer(ThreadingHTTPServer):
    """A threading HTTP server that can also drop its open keep-alive connections, so that
    stopping it really stops answering (a plain ``shutdown()`` leaves connection threads
    serving their clients)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], runner: RewardRunner, name: str, quiet: bool = True) -> None:
        self.runner, self.reward_name, self.quiet = runner, name, quiet
        self.started = time.time()
        self.requests_served = 0
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            self._conns.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RewardHTTPServer

    def _reply(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "reward": self.server.reward_name,
                              "uptime_s": round(time.time() - self.server.started, 3)})
        else:
            self._reply(404, {"error": f"no route GET {self.path}; use POST /score or GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > MAX_BODY:
            self.close_connection = True  # the body cannot be skipped: drop the connection
            self._reply(400, {"error": "a Content-Length up to 64 MiB is required"})
            return
        raw = self.rfile.read(length)  # read it even for a wrong path, to keep the stream in sync
        if self.path.rstrip("/") != "/score":
            self._reply(404, {"error": f"no route POST {self.path}; use POST /score"})
            return
        try:
            payload = json.loads(raw or b"null")
            body = score_payload(self.server.runner, payload)
        except ValueError as exc:  # bad JSON or a malformed request: the client's fault
            self._reply(400, {"error": str(exc)})
            return
        except Exception as exc:  # noqa: BLE001 - the runner records reward errors; this is a bug
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self.server.requests_served += 1
        self._reply(200, body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        if not self.server.quiet:
            sys.stderr.write(f"[serve-reward] {self.address_string()} {format % args}\n")


def make_server(
    target: str | Callable[..., Any], host: str = "127.0.0.1", port: int = 0,
    timeout: float | None = 60.0, concurrency: int = 64, quiet: bool = True,
) -> RewardHTTPServer:
    """A bound (not yet serving) server for ``target``. ``timeout`` bounds each async reward
    call; ``concurrency`` the async calls in flight per request."""
    reward = load_reward(target)
    runner = RewardRunner(reward, timeout=timeout, concurrency=concurrency)
    name = target if isinstance(target, str) else reward_name(reward)
    return RewardHTTPServer((host, port), runner, name, quiet=quiet)


def start_server(
    target: str | Callable[..., Any], host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> tuple[str, Callable[[], None]]:
    """Serve ``target`` from a background thread. Returns ``(url, stop)``; ``stop()`` closes the
    listening socket and every open connection (clients see connection errors at once) and is
    idempotent. ``port=0`` picks a free port."""
    server = make_server(target, host, port, **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              name=f"reward-server-{server.server_address[1]}", daemon=True)
    thread.start()
    url = f"http://{host}:{server.server_address[1]}"
    stopped = threading.Event()

    def stop() -> None:
        if stopped.is_set():
            return
        stopped.set()
        server.shutdown()
        server.close_connections()
        server.server_close()
        thread.join(timeout=5)

    stop.server = server  # type: ignore[attr-defined]
    return url, stop


def serve(target: str, host: str = "127.0.0.1", port: int = 8765, timeout: float | None = 60.0,
          quiet: bool = False) -> None:
    """Serve ``target`` until interrupted (the ``tempering serve-reward`` command)."""
    server = make_server(target, host, port, timeout=timeout, quiet=quiet)
    real_port = server.server_address[1]
    kind = "async" if inspect.iscoroutinefunction(getattr(server.runner.reward, "__call__", None)) or \
        inspect.iscoroutinefunction(server.runner.reward) else "sync"
    print(f"tempering: serving {kind} reward '{server.reward_name}' on http://{host}:{real_port} "
          "(POST /score, GET /health); Ctrl-C to stop", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.close_connections()
        server.server_close()
