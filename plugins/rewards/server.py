"""Serve a reward function over HTTP: ``tempering serve-reward MODULE:FUNC [--host --port]``.

One endpoint does the work, ``POST /score``::

    request:  {"samples": [{"completion": "...", "example": {...}}, ...]}
    response: {"rewards": [0.5, null, ...], "errors": [null, "ValueError: ...", ...],
               "infos": [{...}, {}, ...]}

with one entry per sample: a sample whose reward raised, timed out or returned NaN gets
``reward: null`` and its error, and the others are still scored (the request succeeds with
200). A malformed request is a 400, a body over ``max_body`` bytes a 413.
``GET /health`` answers ``{"status": "ok", ...}``.

Access: with a shared-secret ``token`` (``--token`` or ``$TEMPERING_REWARD_TOKEN``) every request
must carry ``Authorization: Bearer <token>`` (compared in constant time; 401 otherwise, checked
before the body is read). A server without a token binds loopback addresses only: a heavy
reward hosted on another machine is otherwise open to anyone who can reach the port. The
token is never printed or logged.

Rewards run with the same semantics as in training (:class:`~tempering.scoring.RewardRunner`):
sync or ``async def``, float or :class:`~tempering.interfaces.RewardResult`. The server is the
stdlib ``ThreadingHTTPServer`` (one thread per connection, HTTP/1.1 keep-alive); an async
reward's samples of one request are scored concurrently on an event loop.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tempering.errors import ConfigError
from tempering.plugins.rewards._common import json_safe, reward_name
from tempering.plugins.rewards.remote import TOKEN_ENV
from tempering.scoring import RewardRunner
from tempering.types import Completion, Sample

MAX_BODY = 64 * 1024 * 1024


def load_reward(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """``"module:func"`` (a class there is instantiated without arguments; the working folder is
    on ``sys.path``, as for ``python -m``), a registered reward name, or a callable."""
    from tempering.plugins.rewards._common import resolve_reward
    from tempering.plugins.rewards.python import working_folder_on_path

    if isinstance(target, str) and ":" in target:
        working_folder_on_path()
    return resolve_reward(target, path="serve-reward")


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches this machine only (``127.0.0.1``, ``::1``, ``localhost``); a
    name counts only if every address it resolves to is loopback."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not host:
        return False  # "" binds every interface
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_access(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token (a ConfigError saying how)."""
    if token is not None and not token.strip():
        raise ConfigError(f"the token is empty; set {TOKEN_ENV} (or --token) to a secret, or unset it", "serve-reward --token")
    if not token and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve on '{host}' without a token: anyone who reaches the port could use the reward. "
            f"Set {TOKEN_ENV} to a shared secret on both machines (or pass --token; the remote reward sends "
            "it from that variable), or bind 127.0.0.1", "serve-reward --host")  # fmt: skip


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

    def __init__(self, address: tuple[str, int], runner: RewardRunner, name: str, quiet: bool = True,
                 token: str | None = None, max_body: int = MAX_BODY) -> None:
        self.runner, self.reward_name, self.quiet = runner, name, quiet
        self._token = token.encode() if token else None  # kept out of repr and logs
        self.max_body = int(max_body)
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

    def authorized(self, header: str | None) -> bool:
        """``Authorization: Bearer <token>`` matches (constant time), or no token is set."""
        if self._token is None:
            return True
        scheme, _, value = (header or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self._token)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: RewardHTTPServer

    def _reply(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        self.send_response(status)
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:  # tell the client, so it does not send its next request here
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refused(self) -> bool:
        """Answer 401 unless the request carries the token. A body within the size cap is read
        and dropped first (closing a socket with unread data resets it, and the client may then
        never see the 401); a larger or unknown one ends the connection."""
        if self.server.authorized(self.headers.get("Authorization")):
            return False
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if 0 <= length <= self.server.max_body:
            self.rfile.read(length)
        else:
            self.close_connection = True
        self._reply(401, {"error": f"this reward server needs a token: send 'Authorization: Bearer <token>' "
                                   f"(the remote reward reads it from {TOKEN_ENV})"})
        return True

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self._refused():
            return
        if self.path.rstrip("/") == "/health":
            self._reply(200, {"status": "ok", "reward": self.server.reward_name,
                              "uptime_s": round(time.time() - self.server.started, 3)})
        else:
            self._reply(404, {"error": f"no route GET {self.path}; use POST /score or GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        if self._refused():
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > self.server.max_body:
            self.close_connection = True  # the body cannot be skipped: drop the connection
            status, what = (413, "is over") if length > 0 else (400, "is required, up to")
            self._reply(status, {"error": f"a Content-Length {what} this server's limit of {self.server.max_body} bytes"})
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
    token: str | None = None, max_body: int = MAX_BODY,
) -> RewardHTTPServer:
    """A bound (not yet serving) server for ``target``. ``timeout`` bounds each async reward
    call; ``concurrency`` the async calls in flight per request; ``token`` is the shared secret
    requests must carry (required unless ``host`` is loopback); ``max_body`` caps a request."""
    check_access(host, token)
    if max_body < 1:
        raise ConfigError(f"must be >= 1 byte, got {max_body}", "serve-reward --max-request-mb")
    reward = load_reward(target)
    runner = RewardRunner(reward, timeout=timeout, concurrency=concurrency)
    name = target if isinstance(target, str) else reward_name(reward)
    return RewardHTTPServer((host, port), runner, name, quiet=quiet, token=token, max_body=max_body)


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
          quiet: bool = False, token: str | None = None, max_body: int = MAX_BODY) -> None:
    """Serve ``target`` until interrupted (the ``tempering serve-reward`` command). ``token``
    defaults to ``$TEMPERING_REWARD_TOKEN``."""
    token = os.environ.get(TOKEN_ENV) if token is None else token
    server = make_server(target, host, port, timeout=timeout, quiet=quiet, token=token, max_body=max_body)
    real_port = server.server_address[1]
    kind = "async" if inspect.iscoroutinefunction(getattr(server.runner.reward, "__call__", None)) or \
        inspect.iscoroutinefunction(server.runner.reward) else "sync"
    access = "requests need the token" if token else "no token: loopback only"
    print(f"tempering: serving {kind} reward '{server.reward_name}' on http://{host}:{real_port} "
          f"(POST /score, GET /health; {access}); Ctrl-C to stop", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.close_connections()
        server.server_close()
