"""The checks every tempering server makes before its own code sees a request, as one ASGI app.

A request is refused, in this order and each in the server's own JSON error shape, when:

1. its ``Host`` names neither this machine's loopback nor a host the user named (403): a web page
   that points its own name at 127.0.0.1 (DNS rebinding) sends its own name as ``Host``;
2. its headers fail the server's authentication (401) -- decided before any of the body is read,
   so a client without the key cannot make the server buffer anything;
3. its body is over ``max_body`` bytes (413: from ``Content-Length`` before reading, or counted
   while a chunked body arrives) or does not arrive within ``body_timeout`` (408);
4. its JSON body does not decode or is nested deeper than ``max_json_depth`` (400 naming which).

What passes runs in a daemon thread (the servers' request logic blocks: model calls, training,
long polls), at most ``workers`` at once, so a slow request never blocks the event loop and a
request still waiting at interpreter exit never holds the process. A client that disconnects
is no error; any other exception is a 500 whose first traceback is logged once and which is
counted (:attr:`Counters.errors`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("tempering.serving")
T = TypeVar("T")
#: The ASGI callable type (scope, receive, send).
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


@dataclass(frozen=True)
class Limits:
    """What one client may take from a server; the defaults suit every tempering server."""

    max_body: int = 16 * 1024 * 1024  #: bytes of a request body (413 beyond)
    max_json_depth: int = 64  #: nesting of a JSON body (400 beyond)
    header_timeout: float = 10.0  #: seconds from connect (or the last answer) to a whole request head
    body_timeout: float = 30.0  #: seconds for a whole body once the head is in (408 beyond)
    max_connections: int = 1024  #: open connections; one more is answered 503 and closed
    workers: int = 64  #: requests whose server code runs at once (the others wait, off-thread)


@dataclass
class Call:
    """One request that passed the checks: what a server's handler gets."""

    method: str
    path: str  #: without the query string
    query: str  #: the raw query string ("" if none)
    headers: Mapping[str, str]  #: lower-case names
    body: bytes
    json: Any = None  #: the decoded body where the server's policy says it is JSON


@dataclass
class Reply:
    """A handler's answer: ``content`` bytes as they are, anything else as JSON."""

    status: int
    content: Any
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


class Refused(Exception):
    """A request answered ``status`` with ``message`` in the server's error shape."""

    def __init__(self, status: int, message: str, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, dict(headers or {})


@dataclass
class Counters:
    """Requests refused, by reason (``host``, ``auth``, ``too_large``, ``timeout``, ``bad_json``,
    ``bad_http``, ``busy``, ``slow_reader``), and server errors (500) with the first one's text."""

    refused: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    first_error: str | None = None


@dataclass(frozen=True)
class Policy:
    """One server's rules and error shape for :func:`guarded_app`.

    ``error_body(status, message)`` is the server's JSON error (OpenAI's, Tinker's, ...) and
    ``error_headers(status)`` headers it adds to an error (e.g. ``WWW-Authenticate``);
    ``authorize(method, path, headers)`` returns why a request is refused (401), or None;
    ``allowed_hosts``: host names answered besides loopback ones (``None``: any host);
    ``host_hint`` says how the user names one; ``is_json(method, path, headers)`` which bodies to
    decode; ``log`` gets one access line per request (off when None)."""

    error_body: Callable[[int, str], Any]
    error_headers: Callable[[int], Mapping[str, str]] = lambda status: {}
    authorize: Callable[[str, str, Mapping[str, str]], str | None] = lambda method, path, headers: None
    allowed_hosts: frozenset[str] | None = frozenset()
    host_hint: str = "the server's allowed-hosts option"
    is_json: Callable[[str, str, Mapping[str, str]], bool] = lambda method, path, headers: False
    limits: Limits = Limits()
    log: Callable[[str], None] | None = None

    def error(self, status: int, message: str, extra: Mapping[str, str] | None = None) -> Response:
        headers = {**self.error_headers(status), **(extra or {})}
        return Response(json.dumps(self.error_body(status, message)).encode(), status, headers, "application/json")


def host_allowed(host: str | None, allowed: Iterable[str] | None = ()) -> bool:
    """Whether a ``Host`` header names this machine's loopback (a loopback IP literal,
    ``localhost`` or a ``*.localhost`` name, which resolve to loopback by RFC 6761) or one of
    ``allowed`` (compared without port and case; ``None`` allows any). A missing header is
    refused: every HTTP/1.1 client sends one."""
    if allowed is None:
        return True
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.rstrip(".")
    if name in {a.strip().lower().rstrip(".") for a in allowed}:
        return True
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def is_loopback_address(host: str) -> bool:
    """Whether a bind address is loopback only (``localhost`` counts; ``""``/``0.0.0.0`` do not)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def decode_json(body: bytes, max_depth: int) -> Any:
    """``body`` decoded, or :class:`Refused` (400) naming what is wrong with it."""
    try:
        value = json.loads(body or b"null")
    except RecursionError:  # the C decoder's own limit, at ~1000 levels
        raise Refused(
            400, f"the request's JSON is nested too deep to decode (the limit is {max_depth} levels)"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Refused(400, f"the request body is not valid JSON: {exc}") from None
    depth = json_depth(value)
    if depth > max_depth:
        raise Refused(400, f"the request's JSON is nested {depth} levels deep; the limit is {max_depth}")
    return value


def json_depth(value: object) -> int:
    """How deep lists and objects nest in a decoded value (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


async def in_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a fresh daemon thread, awaited without blocking the loop. Daemon: a
    request blocked on a model that never answers must not hold the process at exit (a pool's
    threads are joined then); a thread costs ~0.1 ms next to any request's own work."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not done.done():
            done.set_exception(error) if error is not None else done.set_result(result)

    def work() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting request
            result, error = None, exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the server stopped: nobody awaits the answer
            pass

    threading.Thread(target=work, name="tempering-request", daemon=True).start()
    return await done


class GuardedApp:
    """The ASGI app :func:`guarded_app` makes; ``counters`` says what it refused."""

    def __init__(self, app: ASGIApp, counters: Counters) -> None:
        self.app, self.counters = app, counters

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def guarded_app(policy: Policy, handler: Callable[[Call], Reply]) -> GuardedApp:
    """An ASGI app that makes the module's checks, then answers with ``handler`` (run in a
    thread); its ``counters`` record what was refused (the server's protocol adds to them)."""
    seen = Counters()
    limits = policy.limits
    workers = asyncio.Semaphore(limits.workers)  # bound to the loop it is first awaited on

    def refuse(reason: str, status: int, message: str, request: Request, unread: bool) -> Response:
        seen.refused[reason] += 1
        # a body left unread cannot be skipped on a kept-alive connection: close it after the answer
        return policy.error(status, message, {"connection": "close"} if unread else None)

    async def read_body(request: Request) -> bytes:
        length = request.headers.get("content-length")
        if length is not None and int(length) > limits.max_body:  # h11 has checked it is a number
            raise Refused(
                413, f"the request body of {length} bytes is over this server's limit of {limits.max_body} bytes"
            )
        chunks, size = [], 0
        with anyio.fail_after(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limits.max_body:
                    raise Refused(413, f"the request body is over this server's limit of {limits.max_body} bytes")
                chunks.append(chunk)
        return b"".join(chunks)

    async def answer(request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items()}
        method, path = request.method, request.url.path
        has_body = ("content-length" in headers and headers["content-length"] != "0") or "transfer-encoding" in headers
        if not host_allowed(headers.get("host"), policy.allowed_hosts):
            names = ", ".join(sorted(policy.allowed_hosts or ()))
            return refuse(
                "host",
                403,
                f"host {headers.get('host')!r} refused: this server answers loopback names (127.0.0.1, localhost, "
                f"[::1]){' and ' + names if names else ''} only, against DNS rebinding; to use another name, "
                f"give it with {policy.host_hint}",
                request,
                has_body,
            )
        why = policy.authorize(method, path, headers)
        if why is not None:
            return refuse("auth", 401, why, request, has_body)
        try:
            body = await read_body(request)
        except Refused as exc:
            return refuse("too_large", exc.status, exc.message, request, True)
        except TimeoutError:
            return refuse(
                "timeout", 408, f"the request body did not arrive within {limits.body_timeout:g} s", request, True
            )
        call = Call(method, path, request.url.query, headers, body)
        if body and policy.is_json(method, path, headers):
            try:
                call.json = decode_json(body, limits.max_json_depth)
            except Refused as exc:
                return refuse("bad_json", exc.status, exc.message, request, False)
        async with workers:
            try:
                reply = await in_thread(handler, call)
            except Refused as exc:
                return policy.error(exc.status, exc.message, exc.headers)
            except Exception as exc:
                seen.errors += 1
                if seen.first_error is None:
                    seen.first_error = f"{type(exc).__name__}: {exc}"
                    log.error("%s %s failed (first server error; later ones are counted)", method, path, exc_info=exc)
                return policy.error(500, f"{type(exc).__name__}: {exc}")
        content = reply.content
        data = content if isinstance(content, bytes) else json.dumps(content, ensure_ascii=False).encode()
        return Response(data, reply.status, dict(reply.headers), reply.content_type)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await answer(request)
            if policy.log is not None:
                client = scope["client"][0] if scope.get("client") else "-"
                policy.log(f"{client} {request.method} {request.url.path} {response.status_code}")
            await response(scope, receive, send)
        except (ClientDisconnect, OSError):
            return  # the client went away: nothing to answer, nothing to report
        except asyncio.CancelledError:
            return  # the server is stopping and dropped this connection

    return GuardedApp(app, seen)
