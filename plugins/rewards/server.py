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

Robustness: the server is tempering's one HTTP stack (:mod:`tempering.runs.serving`: Starlette
on uvicorn), shared with every tempering server:

* connections live on one event loop, so slow or idle clients cost a socket each, never a
  thread; at most ``workers`` requests are scored at once (in threads: a sync reward blocks),
  the others wait without holding anything but their connection;
* a cap on open connections (``max_connections``; beyond it a connection is answered 503 and
  closed), and a listen backlog of 2048;
* a request's head must arrive within ``read_timeout`` of the connection (or of the previous
  answer) and its body within ``read_timeout`` of the head -- a client that sends half a
  request (slowloris), even one dribbling a byte at a time, is answered 408 and dropped;
* the token is checked as soon as the headers are in, before any body is read: a request
  without it is answered 401 and its connection closed without waiting for the body;
* requests must name a loopback host (``Host``) when the server is bound to loopback, against
  DNS rebinding (a server on another address needs the token anyway);
* JSON nested deeper than 64 levels, malformed JSON or HTTP are a 400 naming the problem.
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tempering.errors import ConfigError
from tempering.plugins.rewards.common import TOKEN_ENV, json_safe, reward_name
from tempering.rollouts.scoring import RewardRunner
from tempering.runs.serving import BackgroundServer, Call, Limits, Policy, Refused, Reply, guarded_app
from tempering.types import Completion, Sample

MAX_BODY = 64 * 1024 * 1024
WORKERS = 64  # threads answering requests (the remote reward opens up to `concurrency`, 16, per run)
MAX_CONNECTIONS = 512  # open connections, served or waiting for a worker; 503 beyond
READ_TIMEOUT = 60.0  # seconds for a request's head to arrive, and again for its body


def load_reward(target: str | Callable[..., Any]) -> Callable[..., Any]:
    """``"module:func"`` (a class there is instantiated without arguments; the working folder is
    on ``sys.path``, as for ``python -m``), a registered reward name, or a callable."""
    from tempering.plugins.rewards.common import resolve_reward
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


def score_payload(runner: RewardRunner, payload: object) -> dict[str, Any]:
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


class RewardHTTPServer(BackgroundServer):
    """The reward server: ``POST /score`` and ``GET /health`` on the shared stack (module docs).
    Bound when made (``server_address``); :meth:`start` serves from a thread,
    :meth:`serve_forever` in the foreground, :meth:`server_close` stops."""

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
        allowed_hosts: Iterable[str] | None = None,
    ) -> None:
        self.runner, self.reward_name, self.quiet = runner, name, quiet
        self._token = token.encode() if token else None  # kept out of repr and logs
        self.max_body = int(max_body)
        self.started = time.time()
        self.requests_served = 0
        host = address[0]
        hosts = frozenset(allowed_hosts) if allowed_hosts is not None else frozenset() if is_loopback(host) else None
        rules = Policy(
            error_body=lambda status, message: {"error": message},
            error_headers=lambda status: {"WWW-Authenticate": "Bearer"} if status == 401 else {},
            authorize=lambda method, path, headers: (
                None if self.authorized(headers.get("authorization")) else UNAUTHORIZED
            ),
            allowed_hosts=hosts,
            host_hint="serve-reward's allowed_hosts option",
            is_json=lambda method, path, headers: method == "POST",
            limits=Limits(
                max_body=self.max_body,
                header_timeout=float(read_timeout),
                body_timeout=float(read_timeout),
                max_connections=int(max_connections),
                workers=int(workers),
            ),
            log=None if quiet else _log_request,
        )
        super().__init__(guarded_app(rules, self._answer), rules, host, address[1], f"reward-server-{address[1]}")

    def _answer(self, call: Call) -> Reply:
        path = call.path.rstrip("/")
        if call.method == "GET" and path == "/health":
            uptime = round(time.time() - self.started, 3)
            return Reply(200, {"status": "ok", "reward": self.reward_name, "uptime_s": uptime})
        if call.method != "POST" or path != "/score":
            return Reply(404, {"error": f"no route {call.method} {call.path}; use POST /score or GET /health"})
        try:
            body = score_payload(self.runner, call.json)
        except ValueError as exc:  # a malformed request: the client's fault
            raise Refused(400, str(exc)) from None
        self.requests_served += 1
        return Reply(200, body)

    def server_close(self) -> None:
        self.close()

    def authorized(self, header: str | None) -> bool:
        """``Authorization: Bearer <token>`` matches (constant time), or no token is set."""
        if self._token is None:
            return True
        scheme, _, value = (header or "").strip().partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self._token)


def _log_request(line: str) -> None:
    sys.stderr.write(f"[serve-reward] {line}\n")


UNAUTHORIZED = (
    "this reward server needs a token: send 'Authorization: Bearer <token>' "
    f"(the remote reward reads it from {TOKEN_ENV})"
)


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
    allowed_hosts: Iterable[str] | None = None,
) -> RewardHTTPServer:
    """A bound (not yet serving) server for ``target``. ``timeout`` bounds each async reward
    call; ``concurrency`` the async calls in flight per request; ``token`` is the shared secret
    requests must carry (required unless ``host`` is loopback); ``max_body`` caps a request;
    ``workers`` threads answer requests, ``max_connections`` may be open at once (503 beyond),
    a request's head and then its body must each arrive within ``read_timeout`` seconds;
    ``allowed_hosts``: the ``Host`` names answered (default: loopback names on a loopback
    address, any name on another, which needs the token)."""
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
        allowed_hosts=allowed_hosts,
    )


def start_server(
    target: str | Callable[..., Any], host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> tuple[str, Callable[[], None]]:
    """Serve ``target`` from a background thread. Returns ``(url, stop)``; ``stop()`` closes the
    listening socket and every open connection (clients see connection errors at once) and is
    idempotent. ``port=0`` picks a free port."""
    server = make_server(target, host, port, **kwargs).start()
    url = f"http://{host}:{server.server_address[1]}"

    def stop() -> None:
        server.close()  # idempotent

    stop.server = server  # type: ignore[attr-defined]
    return url, stop


def serve(
    target: str,
    host: str = "127.0.0.1",
    port: int = 8765,
    timeout: float | None = 60.0,
    quiet: bool = True,
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
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
