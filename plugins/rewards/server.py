"""Serve a reward function over HTTP: ``tempering serve-reward MODULE:FUNC [--host --port]``.

One endpoint does the work, ``POST /score``::

    request:  {"samples": [{"completion": "...", "example": {...}}, ...]}
    response: {"rewards": [0.5, null, ...], "errors": [null, "ValueError: ...", ...],
               "infos": [{...}, {}, ...], "feedbacks": ["expected '42', got '41'", null, ...]}

with one entry per sample: a sample whose reward raised, timed out or returned NaN gets
``reward: null`` and its error, and the others are still scored (the request succeeds with
200). ``feedbacks`` holds each scored sample's feedback in words (the reward's
``RewardResult.feedback``, see :mod:`tempering.rollouts.feedback`) or null; a client that
predates it ignores it, and a server that predates it sends none. A malformed request is a 400,
a body over ``max_body`` bytes a 413.
``GET /health`` answers ``{"status": "ok", ...}``.

Access: with a shared-secret ``token`` (``--token`` or ``$TEMPERING_REWARD_TOKEN``) every request
must carry ``Authorization: Bearer <token>`` (compared in constant time; 401 otherwise, checked
before the body is read). A server without a token binds loopback addresses only: a heavy
reward hosted on another machine is otherwise open to anyone who can reach the port. The
token is never printed or logged.

Rewards run with the same semantics as in training (:class:`~tempering.rollouts.scoring.RewardRunner`):
sync or ``async def``, float or :class:`~tempering.interfaces.RewardResult`; an async reward's
samples of one request are scored concurrently on an event loop.

Robustness: the server is the stdlib ``http.server`` (HTTP/1.1 keep-alive) hardened against
slow and many clients, since none of the project's dependencies brings a production HTTP
server (uvicorn, gunicorn, aiohttp, waitress are all absent) and a reward server should not
need one installed:

* a **bounded worker pool** (``workers`` threads) instead of a thread per connection, and a cap
  on open connections (``max_connections``; beyond it a connection is answered 503 and
  closed), so that no number of clients can take unbounded threads or file descriptors;
* a **read timeout** (``read_timeout``) on each whole request -- request line, headers and
  body must all arrive within it -- so a client that sends half a request (slowloris), even one
  dribbling a byte at a time, is dropped; answers are written under the same timeout;
* a connection waits at most ``KEEP_ALIVE_TIMEOUT`` (5 s, or the read timeout if shorter) for
  a request to begin, and an answer is sent with ``Connection: close`` while other connections
  wait for a worker, so kept-alive clients cannot starve new ones for long (an idle connection
  is not closed early: a client sending its next request at that moment would lose it);
* a **listen backlog** of 1024 (the stdlib's is 5, which reset connections at 20 concurrent
  clients);
* the token is checked as soon as the headers are in, before any body is read: a request
  without it is answered 401 and its connection closed without waiting for the body;
* JSON nested too deep to decode is a 400, like any other malformed body.
"""

from __future__ import annotations

import hmac
import inspect
import io
import ipaddress
import json
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from tempering.errors import ConfigError
from tempering.plugins.rewards._common import TOKEN_ENV, json_safe, reward_name
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample

MAX_BODY = 64 * 1024 * 1024
WORKERS = 64  # threads answering requests (the remote reward opens up to `concurrency`, 16, per run)
MAX_CONNECTIONS = 512  # open connections, served or waiting for a worker; 503 beyond
READ_TIMEOUT = 60.0  # seconds for a whole request to arrive, from its first byte
KEEP_ALIVE_TIMEOUT = 5.0  # seconds a connection may wait idle for its (next) request's first byte
LINGER_S = 1.0  # after refusing a request unread: how long its unread body is drained before closing
LINGER_BYTES = 1 << 20


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
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def check_access(host: str, token: str | None) -> None:
    """Refuse to serve a non-loopback address without a token (a ConfigError saying how)."""
    if token is not None and not token.strip():
        raise ConfigError(
            f"the token is empty; set {TOKEN_ENV} (or --token) to a secret, or unset it", "serve-reward --token"
        )
    if not token and not is_loopback(host):
        raise ConfigError(
            f"refusing to serve on '{host}' without a token: anyone who reaches the port could use the reward. "
            f"Set {TOKEN_ENV} to a shared secret on both machines (or pass --token; the remote reward sends "
            "it from that variable), or bind 127.0.0.1",
            "serve-reward --host",
        )


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
        "feedbacks": [s.feedback if not s.failed else None for s in samples],
    }


class _DeadlineReader(io.RawIOBase):
    """A connection's reading side that enforces a deadline on a whole request, not on each
    ``recv``: the socket's timeout is set to the time left before every read, so a client that
    dribbles a byte at a time still runs out of time. Waiting for a request's first byte has
    the (shorter) keep-alive deadline; from that byte on the request has the read timeout.
    ``deadline`` is ``None`` from the end of a request's body to the next request."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.deadline: float | None = None
        self._read_timeout: float | None = None  # set while waiting for a request's first byte

    def readable(self) -> bool:
        return True

    def expect_request(self, read_timeout: float, keep_alive_timeout: float) -> None:
        self.deadline = time.monotonic() + min(keep_alive_timeout, read_timeout)
        self._read_timeout = read_timeout

    def readinto(self, buffer: Any) -> int:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request did not arrive within the server's read timeout")
            self.sock.settimeout(left)
        n = self.sock.recv_into(buffer)
        if n and self._read_timeout is not None:  # a request begins: it has the whole read timeout
            self.deadline, self._read_timeout = time.monotonic() + self._read_timeout, None
        return n


class RewardHTTPServer(HTTPServer):
    """An HTTP server with a bounded worker pool, a cap on open connections, a whole-request
    read timeout and a large listen backlog (see the module docstring for why each), that can
    also drop its open keep-alive connections, so that stopping it really stops answering.

    The pool is a few daemon threads on a queue rather than ``concurrent.futures``'
    ``ThreadPoolExecutor``, whose workers are joined at interpreter exit: a connection blocked
    in a read would hold the exit of a process that never called ``stop()`` for up to the read
    timeout (the thread-per-connection server it replaces used daemon threads too)."""

    allow_reuse_address = True
    request_queue_size = 1024  # listen backlog (the kernel caps it at net.core.somaxconn)

    def __init__(
        self,
        address: tuple[str, int],
        runner: RewardRunner,
        name: str,
        quiet: bool = True,
        token: str | None = None,
        max_body: int = MAX_BODY,
        workers: int = WORKERS,
        max_connections: int = MAX_CONNECTIONS,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self.runner, self.reward_name, self.quiet = runner, name, quiet
        self._token = token.encode() if token else None  # kept out of repr and logs
        self.max_body = int(max_body)
        self.workers, self.max_connections = int(workers), int(max_connections)
        self.read_timeout = float(read_timeout)
        self.keep_alive_timeout = KEEP_ALIVE_TIMEOUT
        self.started = time.time()
        self.requests_served = 0
        self._conns: set[socket.socket] = set()  # open: being served or waiting for a worker
        self._serving = 0  # connections a worker holds
        self._conns_lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        super().__init__(address, _Handler)

    # -- the pool
    def process_request(self, request: Any, client_address: Any) -> None:
        with self._conns_lock:
            full = len(self._conns) >= self.max_connections
            if not full:
                self._conns.add(request)
                waiting = len(self._conns) - self._serving
                if len(self._threads) < self.workers and waiting > len(self._threads) - self._serving:
                    thread = threading.Thread(
                        target=self._work, name=f"reward-worker-{len(self._threads)}", daemon=True
                    )
                    self._threads.append(thread)
                    thread.start()
        if full:
            self._refuse_full(request)
            return
        self._queue.put((request, client_address))

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            request, client_address = item
            with self._conns_lock:
                self._serving += 1
            try:
                self.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - socketserver's own contract
                self.handle_error(request, client_address)
            finally:
                with self._conns_lock:
                    self._serving -= 1
                self.shutdown_request(request)

    def waiting(self) -> bool:
        """Whether connections wait for a worker (answers then close their keep-alive ones)."""
        with self._conns_lock:
            return len(self._conns) > self._serving

    def _refuse_full(self, request: socket.socket) -> None:
        try:
            request.settimeout(1.0)
            body = b'{"error": "the reward server has too many open connections; retry later"}'
            request.sendall(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
        except OSError:
            pass
        super().shutdown_request(request)

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away or timed out is routine, not a traceback on stderr."""
        if isinstance(sys.exc_info()[1], OSError):
            if not self.quiet:
                sys.stderr.write(f"[serve-reward] {client_address[0]} connection ended: {sys.exc_info()[1]}\n")
            return
        super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        for _ in self._threads:
            self._queue.put(None)

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

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced by a reader that enforces the whole-request deadline
        self._reader = _DeadlineReader(self.connection)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        """One request: its first byte within the keep-alive timeout, the whole of it within the
        read timeout from there."""
        self._reader.expect_request(self.server.read_timeout, self.server.keep_alive_timeout)
        super().handle_one_request()

    def _received(self) -> None:
        """The request is in: no read deadline while the reward runs; the answer is written under
        the same timeout per send (a client that never reads cannot hold the worker)."""
        self._reader.deadline = None
        self.connection.settimeout(self.server.read_timeout)

    def _reply(self, status: int, body: Mapping[str, Any]) -> None:
        data = json.dumps(body, allow_nan=False).encode()
        if not self.close_connection and self.server.waiting():
            self.close_connection = True  # others wait for a worker: this client reconnects
        self.send_response(status)
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:  # tell the client, so it does not send its next request here
            self.send_header("Connection", "close")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _linger(self) -> None:
        """Close a connection whose request body was left unread without resetting it: closing
        a socket with unread data sends a reset, and the client may then never see the answer.
        The answer is flushed, the writing side shut, and what the client still sends is read
        and dropped, for at most ``LINGER_S`` seconds and ``LINGER_BYTES`` bytes."""
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            end, drained = time.monotonic() + LINGER_S, 0
            while drained < LINGER_BYTES and (left := end - time.monotonic()) > 0:
                self.connection.settimeout(left)
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass

    def _refused(self) -> bool:
        """Answer 401 unless the request carries the token. Checked as soon as the headers are
        in: the body is not read (a client without the token cannot hold a worker by announcing
        a body it never sends); the connection is closed after the answer."""
        if self.server.authorized(self.headers.get("Authorization")):
            return False
        self._received()
        self.close_connection = True
        self._reply(
            401,
            {
                "error": f"this reward server needs a token: send 'Authorization: Bearer <token>' "
                f"(the remote reward reads it from {TOKEN_ENV})"
            },
        )
        if self.command == "POST" or self.headers.get("Content-Length") or self.headers.get("Transfer-Encoding"):
            self._linger()
        return True

    def do_GET(self) -> None:  # http.server's naming
        if self._refused():
            return
        self._received()
        if self.path.rstrip("/") == "/health":
            self._reply(
                200,
                {
                    "status": "ok",
                    "reward": self.server.reward_name,
                    "uptime_s": round(time.time() - self.server.started, 3),
                },
            )
        else:
            self._reply(404, {"error": f"no route GET {self.path}; use POST /score or GET /health"})

    def do_POST(self) -> None:
        if self._refused():
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0 or length > self.server.max_body:
            self._received()
            self.close_connection = True  # the body cannot be skipped: drop the connection
            status, what = (413, "is over") if length > 0 else (400, "is required, up to")
            self._reply(
                status, {"error": f"a Content-Length {what} this server's limit of {self.server.max_body} bytes"}
            )
            self._linger()
            return
        raw = self.rfile.read(length)  # read it even for a wrong path, to keep the stream in sync
        if len(raw) < length:  # the client closed before sending its whole body
            self.close_connection = True
            return
        self._received()
        if self.path.rstrip("/") != "/score":
            self._reply(404, {"error": f"no route POST {self.path}; use POST /score"})
            return
        try:
            payload = json.loads(raw or b"null")
            body = score_payload(self.server.runner, payload)
        except RecursionError:  # the decoder's own limit: a client's request, not a server bug
            self._reply(400, {"error": "the request's JSON is nested too deep to decode"})
            return
        except ValueError as exc:  # bad JSON or a malformed request: the client's fault
            self._reply(400, {"error": str(exc)})
            return
        except Exception as exc:  # noqa: BLE001 - the runner records reward errors; this is a bug
            self._reply(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self.server.requests_served += 1
        self._reply(200, body)

    def log_message(self, format: str, *args: Any) -> None:
        if not self.server.quiet:
            sys.stderr.write(f"[serve-reward] {self.address_string()} {format % args}\n")


def make_server(
    target: str | Callable[..., Any],
    host: str = "127.0.0.1",
    port: int = 0,
    timeout: float | None = 60.0,
    concurrency: int = 64,
    quiet: bool = True,
    token: str | None = None,
    max_body: int = MAX_BODY,
    workers: int = WORKERS,
    max_connections: int = MAX_CONNECTIONS,
    read_timeout: float = READ_TIMEOUT,
) -> RewardHTTPServer:
    """A bound (not yet serving) server for ``target``. ``timeout`` bounds each async reward
    call; ``concurrency`` the async calls in flight per request; ``token`` is the shared secret
    requests must carry (required unless ``host`` is loopback); ``max_body`` caps a request;
    ``workers`` threads answer requests, ``max_connections`` may be open at once (503 beyond),
    and a request must arrive whole within ``read_timeout`` seconds."""
    check_access(host, token)
    if max_body < 1:
        raise ConfigError(f"must be >= 1 byte, got {max_body}", "serve-reward --max-request-mb")
    for key, value, low in (("workers", workers, 1), ("max_connections", max_connections, 1)):
        if int(value) < low:
            raise ConfigError(f"must be >= {low}, got {value}", f"serve-reward {key}")
    if not read_timeout > 0:
        raise ConfigError(f"must be > 0 seconds, got {read_timeout}", "serve-reward read_timeout")
    reward = load_reward(target)
    runner = RewardRunner(reward, timeout=timeout, concurrency=concurrency)
    name = target if isinstance(target, str) else reward_name(reward)
    return RewardHTTPServer(
        (host, port),
        runner,
        name,
        quiet=quiet,
        token=token,
        max_body=max_body,
        workers=workers,
        max_connections=max_connections,
        read_timeout=read_timeout,
    )


def start_server(
    target: str | Callable[..., Any], host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> tuple[str, Callable[[], None]]:
    """Serve ``target`` from a background thread. Returns ``(url, stop)``; ``stop()`` closes the
    listening socket and every open connection (clients see connection errors at once) and is
    idempotent. ``port=0`` picks a free port."""
    server = make_server(target, host, port, **kwargs)
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": 0.05},
        name=f"reward-server-{server.server_address[1]}",
        daemon=True,
    )
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


def serve(
    target: str,
    host: str = "127.0.0.1",
    port: int = 8765,
    timeout: float | None = 60.0,
    quiet: bool = False,
    token: str | None = None,
    max_body: int = MAX_BODY,
    **limits: Any,
) -> None:
    """Serve ``target`` until interrupted (the ``tempering serve-reward`` command). ``token``
    defaults to ``$TEMPERING_REWARD_TOKEN``; ``limits``: ``workers``, ``max_connections``,
    ``read_timeout`` (see :func:`make_server`)."""
    token = os.environ.get(TOKEN_ENV) if token is None else token
    server = make_server(target, host, port, timeout=timeout, quiet=quiet, token=token, max_body=max_body, **limits)
    real_port = server.server_address[1]
    kind = (
        "async"
        if inspect.iscoroutinefunction(getattr(server.runner.reward, "__call__", None))
        or inspect.iscoroutinefunction(server.runner.reward)
        else "sync"
    )
    access = "requests need the token" if token else "no token: loopback only"
    print(
        f"tempering: serving {kind} reward '{server.reward_name}' on http://{host}:{real_port} "
        f"(POST /score, GET /health; {access}); Ctrl-C to stop",
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.close_connections()
        server.server_close()
