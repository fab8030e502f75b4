"""uvicorn serving a guarded app from a background thread, with what uvicorn leaves to its users.

uvicorn (h11) parses HTTP, caps a request head at 16 KiB, closes idle kept-alive connections
(``timeout_keep_alive``) and serves every connection on one event loop, so slow clients cost a
socket each, never a thread. What it does not do, this module's protocol adds:

* a **head timeout**: uvicorn arms no timer until a first answer, so a client that connects and
  sends half a request head (slowloris), or dribbles it a byte at a time, would hold its
  connection forever; here the whole head must arrive within ``header_timeout`` of the
  connection (or of the previous answer), else 408 and close;
* a **write timeout**: a client that stops reading its answer has ``body_timeout`` to read on
  before its connection is dropped (uvicorn would wait for it forever);
* a **connection cap**: a connection beyond ``max_connections`` is answered 503 (in the server's
  error shape, ``Retry-After: 1``) and closed at once; uvicorn's ``limit_concurrency`` would
  answer it only once its request head is in, and in plain text;
* malformed HTTP (e.g. ``Content-Length: abc``) answered 400 in the server's JSON shape, naming
  h11's reason, instead of uvicorn's plain-text line and a logged warning;
* a socket bound up front (``SO_REUSEADDR``), so a busy port is the caller's ``OSError`` --
  uvicorn would log it and ``sys.exit`` -- and the port is known before serving;
* a prompt :meth:`BackgroundServer.close`: every open connection is dropped and every request
  still running cancelled, as the stdlib servers it replaces did.

Its logger is ``tempering.serving.wire`` at ERROR: a hostile client's bad request is counted
(:class:`~tempering.runs.serving.guard.Counters`), not printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from http import HTTPStatus
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tempering.runs.serving.guard import Counters, GuardedApp, Limits, Policy

WIRE_LOG = logging.getLogger("tempering.serving.wire")
WIRE_LOG.setLevel(logging.ERROR)
#: The listen backlog: a batch of agent episodes connects at once (hundreds).
BACKLOG = 2048
#: Seconds :meth:`BackgroundServer.close` lets answers being written finish.
GRACE_S = 0.5


class _Connection(h11.Connection):
    """h11's connection, remembering why it refused the client's bytes (uvicorn drops the reason)."""

    refusal = ""

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = str(exc)
            raise


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a head timeout, a connection cap and JSON 400s (module docs)."""

    policy: ClassVar[Policy]
    counters: ClassVar[Counters]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = _Connection(h11.SERVER, self.config.h11_max_incomplete_event_size or 16 * 1024)
        self.logger = WIRE_LOG
        self._head_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.policy.limits
        if len(self.connections) > limits.max_connections:
            self.counters.refused["busy"] += 1
            self._answer_and_close(
                503,
                f"the server has {limits.max_connections} connections open, its limit; retry shortly",
                {"Retry-After": "1"},
            )
            return
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.policy.limits.header_timeout, self._head_expired)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the head is in (or the connection failed)
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request's head has the same time

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._write_ok()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The client stopped reading: it has ``body_timeout`` to read on, or is dropped."""
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.policy.limits.body_timeout, self._write_expired)

    def resume_writing(self) -> None:
        self._write_ok()
        super().resume_writing()

    def _write_ok(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_expired(self) -> None:
        self._write_timer = None
        self.counters.refused["slow_reader"] += 1
        self.transport.abort()  # the answer being written is dropped; its request task ends quietly

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if not self.conn.trailing_data[0]:  # idle between requests: just close
            self.transport.close()
            return
        self.counters.refused["timeout"] += 1
        timeout = self.policy.limits.header_timeout
        self._answer_and_close(408, f"the request head did not arrive within {timeout:g} s")

    def send_400_response(self, msg: str) -> None:
        self.counters.refused["bad_http"] += 1
        self._answer_and_close(400, f"malformed HTTP request: {getattr(self.conn, 'refusal', '') or msg}")

    def _answer_and_close(self, status: int, message: str, extra: dict[str, str] | None = None) -> None:
        """Write an error in the server's shape straight to the socket and close it (no request
        cycle exists yet, or h11 has given up on the connection)."""
        body = json.dumps(self.policy.error_body(status, message)).encode()
        headers = {
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            **self.policy.error_headers(status),
            **(extra or {}),
            "Connection": "close",
        }
        head = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}"] + [f"{k}: {v}" for k, v in headers.items()]
        with contextlib.suppress(Exception):
            self.transport.write("\r\n".join(head).encode("latin-1") + b"\r\n\r\n" + body)
        self._disarm()
        self.transport.close()


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0: any free one); ``OSError`` if taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restarted server gets its port back
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class BackgroundServer:
    """``app`` served by uvicorn on ``host:port`` from a daemon thread with its own event loop.

    Bound at construction (``server_address`` is known then; a busy port raises ``OSError``);
    :meth:`start` serves, :meth:`close` stops and drops every connection (idempotent);
    :meth:`serve_forever` serves in the foreground until interrupted."""

    def __init__(
        self, app: GuardedApp, policy: Policy, host: str = "127.0.0.1", port: int = 0, name: str = "tempering-server"
    ) -> None:
        self.policy, self.name = policy, name
        self.counters: Counters = app.counters
        self.socket = bind(host, port)
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]
        protocol = type("GuardedH11ForServer", (GuardedH11,), {"policy": policy, "counters": self.counters})
        limits: Limits = policy.limits
        config = uvicorn.Config(
            app,
            http=protocol,
            lifespan="off",
            log_config=None,
            access_log=False,
            proxy_headers=False,
            server_header=False,
            timeout_keep_alive=max(1, int(limits.header_timeout)),
            timeout_graceful_shutdown=1,
            backlog=BACKLOG,
            loop="asyncio",
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._closed = False

    def start(self) -> BackgroundServer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
            self._started.wait(10)
        return self

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._started.set)
        try:
            await self._server.serve(sockets=[self.socket])
        finally:
            self._drop_connections()

    def _drop_connections(self) -> None:
        """Close every connection and cancel every request still running (called in the loop)."""
        state = self._server.server_state
        for conn in list(state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        for task in list(state.tasks):
            task.cancel()

    def serve_forever(self) -> None:
        """Serve in the foreground until the server is closed (or Ctrl-C, which propagates)."""
        self.start()
        assert self._thread is not None
        while self._thread.is_alive():
            self._thread.join(0.2)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._drop_connections)
            self._server.should_exit = True
            thread.join(timeout=5)
        self.socket.close()
