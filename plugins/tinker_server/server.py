"""A Tinker-compatible HTTP server on loopback: the real ``tinker`` SDK (0.38) talks to it as it
talks to Tinker, and local models train and sample behind it: tiny ones built in code, or a
pretrained one (``--model smollm2 --name HuggingFaceTB/SmolLM2-135M-Instruct``).

Why it exists: no open-source server speaks SDK 0.38's protocol (forward/backward and sampling
results moved to protobuf), and an in-process fake of the SDK's *client objects* hides what the
SDK itself does -- its retries, its futures, how it reports errors. With this server the tests
(and anyone without a Tinker account) run the official client end to end, offline:

```bash
python -m tempering.plugins.tinker_server --port 8765 &
TINKER_BASE_URL=http://127.0.0.1:8765 TINKER_API_KEY=tml-local \\
    tempering run arithmetic backend.name=tinker output_dir=runs/arithmetic-local-tinker
```

The endpoints are those the SDK's ServiceClient, TrainingClient and SamplingClient call:
``client/config`` (optional features off: JSON futures, client-side custom losses, no pyqwest),
``client/dynamic_config`` (404: the SDK's defaults), ``create_session``, ``session_heartbeat``,
``sessions/{id}/finish``, ``create_model``, ``get_info``, ``forward_backward`` (protobuf, with
``forward_only``), ``optim_step``, ``save_weights``, ``save_weights_for_sampler``,
``load_weights``, ``save_weights_external`` (the run's LoRA adapter as a peft folder),
``GET training_runs/{run}/checkpoints/external_weights/{name}/external_weights_urls`` (one signed URL
per file, served by this server under ``/external/{token}/``: no API key, the token is the
signature, valid for ``url_ttl_seconds``), ``DELETE training_runs/{run}/checkpoints/{id}``,
``create_sampling_session``, ``GET samplers/{id}``, ``asample``,
``retrieve_future`` (a long poll: it answers as soon as the result is ready, else
``try_again`` after ``hold_seconds``), ``healthz``, ``get_server_capabilities``, ``telemetry``
and ``cancel_future``; and the REST client's: ``GET training_runs`` (and ``/{run}``,
``/{run}/checkpoints``), ``GET checkpoints``, ``POST weights_info``, checkpoint ``publish``
(``POST``/``DELETE``) and ``ttl`` (``PUT``), ``GET sessions`` (and ``/{id}``).
State and compute: :mod:`~tempering.plugins.tinker_server.service`; what survives a restart:
:mod:`~tempering.plugins.tinker_server.registry`.

Errors surface as errors: a request refused for what it asks (a name taken, a bad TTL, a
checkpoint that does not fit the run) is a failed future of category ``user``, which the SDK
raises at once; any other 4xx answer but 408/429 carries ``x-should-retry: false``. A
housekeeping thread expires silent sessions and gives up missing ``seq_id`` s (see
:class:`~tempering.plugins.tinker_server.service.LocalService`), so no run waits forever on a
dead client.

Fault injection (:class:`Faults`, ``server.faults``) makes the next requests fail the ways the
service can: an HTTP status at submission (401, 409, 429, 5xx, ...), a failed future (category
``server`` or ``user``; the operation is not applied), a future that never completes (its
queue paused for capacity), an expired future (410), a ``retrieve_future`` that answers 408, every request answering an
HTTP 5xx (``faults.broken()``) until ``faults.clear()``.
The newest requests are recorded (``server.received``, a bounded log of ``request_log`` entries,
2000 by default; ``tempering serve-tinker`` keeps none) with their decoded ``tinker.types``
bodies, and the newest sequences sampled as ``(prompt, completion)`` tokens (``server.sampled``).
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import re
import secrets
import shutil
import tempfile
import threading
import time
import urllib.parse
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
from tinker import types

from tempering.plugins.tinker_server import wire
from tempering.plugins.tinker_server.service import (
    LocalService,
    Rejected,
    ServedModel,
    UserError,
)
from tempering.plugins.tinker_server.stability import session_of
from tempering.runs.serving import (
    BackgroundServer,
    Call,
    Limits,
    Policy,
    Refused,
    Reply,
    guarded_app,
    is_loopback_address,
)

log = logging.getLogger(__name__)
_request = threading.local()  # the query string of the request this thread answers
#: The JSON training routes, run in the model's ``seq_id`` order: route -> (request type, the
#: kind ``server.received`` records, the :class:`LocalService` method that answers it).
QUEUED_JSON: dict[str, tuple[Any, str, str]] = {
    "optim_step": (types.OptimStepRequest, "OptimStep", "optim_step"),
    "save_weights": (types.SaveWeightsRequest, "SaveWeights", "save_state"),
    "save_weights_for_sampler": (types.SaveWeightsForSamplerRequest, "SaveWeightsForSampler", "save_for_sampler"),
    "save_weights_external": (types.SaveWeightsExternalRequest, "SaveWeightsExternal", "save_external"),
}

__all__ = ["LocalTinkerServer", "Faults", "Received", "DEFAULT_MODELS"]

#: The largest request body: a forward_backward batch of long sequences in protobuf.
MAX_BODY = 64 * 1024 * 1024
INVALID_KEY = "Invalid API key"
#: How long a future's outcome stays retrievable after it was sent.
FUTURE_GRACE_SECONDS = 60.0

#: What ``tiny_llama`` means on a server started without ``models``: a very small char-level
#: Llama, so that a test step takes milliseconds.
DEFAULT_MODELS = {
    "tiny_llama": ServedModel(
        "tiny_llama", {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
    )
}
#: The server's feature flags (``/client/config``): the SDK's plain paths, nothing experimental.
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False,
    "sample_join_sampling_session": False,
}


@dataclass
class Received:
    """One request: its route, its kind (the SDK's request type for future-returning calls,
    e.g. ``ForwardBackward``, ``Forward``, ``Sample``), and its decoded body."""

    route: str
    kind: str
    body: Any
    at: float = field(default_factory=time.monotonic)


@dataclass
class _Fault:
    kind: str  # "http" | "fail" | "hang" | "expire" | "retrieve"
    status: int = 500
    message: str = "injected by the local Tinker server"
    category: str = "server"


class Faults:
    """Planned failures, consumed in order by the requests they match.

    ``route`` is an endpoint path without ``/api/v1`` (``"asample"``, ``"forward_backward"``,
    ``"client/config"``, ...); ``kind`` a future's request type (``"ForwardBackward"``,
    ``"Forward"``, ``"OptimStep"``, ``"SaveWeights"``, ``"SaveWeightsForSampler"``,
    ``"CreateModel"``, ``"LoadWeights"``, ``"SaveWeightsExternal"``, ``"Sample"``)."""

    def __init__(self) -> None:
        self._planned: dict[str, list[_Fault]] = defaultdict(list)
        self._broken: _Fault | None = None
        self._lock = threading.Lock()
        self.hit: list[tuple[str, str]] = []  # (key, fault kind) of every fault served

    def http(
        self, route: str, status: int, times: int = 1, message: str = "injected by the local Tinker server"
    ) -> None:
        """The next ``times`` requests to ``route`` answer ``status`` (nothing is done)."""
        self._add(f"route:{route}", _Fault("http", status, message), times)

    def fail(
        self, kind: str, times: int = 1, message: str = "injected server failure", category: str = "server"
    ) -> None:
        """The next ``times`` futures of ``kind`` fail (``category`` ``server`` or ``user``);
        the operation is not applied, and its place in the run's order is used up."""
        self._add(f"kind:{kind}", _Fault("fail", message=message, category=category), times)

    def hang(self, kind: str, times: int = 1) -> None:
        """The next ``times`` futures of ``kind`` never complete: every poll answers
        ``try_again`` with the queue ``paused_capacity``."""
        self._add(f"kind:{kind}", _Fault("hang"), times)

    def expire(self, kind: str, times: int = 1) -> None:
        """The next ``times`` futures of ``kind`` are gone when polled (HTTP 410)."""
        self._add(f"kind:{kind}", _Fault("expire", 410), times)

    def retrieve(self, status: int = 408, times: int = 1) -> None:
        """The next ``times`` ``retrieve_future`` polls answer ``status`` (408: try again)."""
        self._add("retrieve", _Fault("retrieve", status), times)

    def broken(self, status: int = 500, message: str = "injected: the service is broken") -> None:
        """Every request, health check included, answers ``status`` until :meth:`clear`: a
        service that fails persistently (the SDK retries 5xx answers without a word)."""
        with self._lock:
            self._broken = _Fault("http", status, message)

    def take_broken(self) -> _Fault | None:
        with self._lock:
            return self._broken

    def clear(self) -> None:
        with self._lock:
            self._planned.clear()
            self._broken = None

    def _add(self, key: str, fault: _Fault, times: int) -> None:
        with self._lock:
            self._planned[key].extend([fault] * times)

    def take(self, key: str, kinds: tuple[str, ...] | None = None) -> _Fault | None:
        """The next planned fault for ``key`` (only if it is one of ``kinds``), used up."""
        with self._lock:
            planned = self._planned.get(key)
            if not planned or (kinds is not None and planned[0].kind not in kinds):
                return None
            fault = planned.pop(0)
            self.hit.append((key, fault.kind))
            return fault


@dataclass
class _Pending:
    """A server future: the request's result future and how to send it back."""

    kind: str
    future: Future[Any]
    render: Callable[[Any], tuple[str, bytes]]
    fault: _Fault | None = None
    answered: float | None = None  # when its outcome was sent (it is forgotten a while after)


def _json(value: object) -> tuple[str, bytes]:
    return "application/json", json.dumps(value).encode()


class LocalTinkerServer:
    """A Tinker-compatible service on ``http://127.0.0.1:<port>`` (see the module docstring).

    Args:
        models: base-model name -> :class:`~tempering.plugins.tinker_server.service.ServedModel`
            (or a mapping of its fields); default :data:`DEFAULT_MODELS`.
        host / port: where to listen (port 0: a free port; loopback only by default).
        api_keys: the keys accepted (default: any key starting with ``tml-``); another key gets
            HTTP 401.
        hold_seconds: how long ``retrieve_future`` waits for a result before ``try_again``.
        root: a folder for checkpoints, tokenizers and the run registry; given, it is kept and
            reused (a server started again on it knows its checkpoints); default: a temporary
            one, removed by :meth:`stop`.
        url_ttl_seconds: how long a signed download URL of external weights stays valid.
        session_timeout_seconds / gap_timeout_seconds / batch_sampling / keep_checkpoints /
            keep_sampling_clients: see
            :class:`~tempering.plugins.tinker_server.service.LocalService`.
        allowed_hosts: ``Host`` names answered besides loopback ones (403 otherwise, against DNS
            rebinding); default: loopback names on a loopback address, any name on another
            (which needs ``api_keys``).
        request_log: how many of the newest requests (``received``) and sampled sequences
            (``sampled``) to keep, for tests; 0 keeps none (a long-running server).

    The transport is tempering's one server stack (:mod:`tempering.runs.serving`): the Host
    check, the key (before the body is read), a 64 MiB body cap, head/body timeouts, a
    connection cap and JSON checks happen there, in Tinker's error shape.

    Binding anything but a loopback address needs ``api_keys``: the server trains and samples
    for whoever reaches it.

    Use as a context manager, or :meth:`start` / :meth:`stop`. ``url`` is the base URL to give
    the SDK (``TINKER_BASE_URL`` or ``ServiceClient(base_url=...)``).
    """

    def __init__(
        self,
        models: Mapping[str, ServedModel | Mapping[str, Any]] | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_keys: set[str] | None = None,
        hold_seconds: float = 1.0,
        root: str | None = None,
        url_ttl_seconds: float = 3600.0,
        session_timeout_seconds: float = 60.0,
        gap_timeout_seconds: float = 30.0,
        batch_sampling: bool = False,
        allowed_hosts: Iterable[str] | None = None,
        request_log: int = 2000,
        keep_checkpoints: int | None = None,
        keep_sampling_clients: int = 16,
    ) -> None:
        if not is_loopback_address(host) and not api_keys:
            raise ValueError(
                f"serving on {host!r} (not loopback) needs api_keys: anyone who reaches the port could "
                "train and sample; give a key (clients send it as TINKER_API_KEY)"
            )
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="tempering-tinker-")
        self.service = LocalService(
            models if models is not None else DEFAULT_MODELS,
            self.root,
            session_timeout_seconds,
            gap_timeout_seconds,
            batch_sampling,
            keep_checkpoints,
            keep_sampling_clients,
        )
        self.housekeeping: list[str] = []  # what the housekeeping thread did (expired sessions, given-up seq_ids)
        self._stopping = threading.Event()
        self.api_keys = api_keys
        self.hold_seconds = float(hold_seconds)
        self.faults = Faults()
        # the newest ``request_log`` requests and sampled sequences (a bounded log: 0 keeps none)
        self.received: deque[Received] = deque(maxlen=request_log)
        self.sampled: deque[tuple[list[int], list[int]]] = deque(maxlen=request_log)  # (prompt, completion)
        self.futures: dict[str, _Pending] = {}
        self.paused = threading.Event()  # while set, finished results are held back (try_again)
        self.url_ttl_seconds = float(url_ttl_seconds)
        self._signed: dict[str, tuple[str, float]] = {}  # URL token -> (external weights path, expiry time)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        rules = _policy(self, host, allowed_hosts)
        self._http = BackgroundServer(guarded_app(rules, _handler(self)), rules, host, port, "local-tinker-server")

    @property
    def url(self) -> str:
        host, port = self._http.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> LocalTinkerServer:
        self._http.start()
        threading.Thread(target=self._housekeep, name="local-tinker-housekeeping", daemon=True).start()
        return self

    def _housekeep(self) -> None:
        while not self._stopping.wait(1.0):
            try:
                for line in self.service.reap():
                    log.warning("tinker server: %s", line)
                    self.housekeeping.append(line)
                self.forget_futures()
            except Exception:
                log.exception("tinker server housekeeping failed")

    def stop(self) -> None:
        """Stop listening, release the models, remove the temporary folder."""
        self._stopping.set()
        self._http.close()  # drops kept-alive connections too: nothing is answered after this
        self.service.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalTinkerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ for tests
    def requests(self, *kinds: str) -> list[Received]:
        """The requests received (of these kinds, or routes), in arrival order."""
        with self._lock:
            return [r for r in self.received if not kinds or r.kind in kinds or r.route in kinds]

    def bodies(self, *kinds: str) -> list[Any]:
        return [r.body for r in self.requests(*kinds)]

    def forget_futures(self, answered_for: float = FUTURE_GRACE_SECONDS) -> int:
        """Drop the futures whose outcome was sent ``answered_for`` seconds ago (a client may
        poll once more after a dropped connection), and the finished futures of sessions that
        ended: a server future holds its result (logprobs, samples) until then. Returns how
        many were dropped (the housekeeping thread calls it every second)."""
        stamp, gone = time.monotonic(), []
        for request_id, pending in list(self.futures.items()):
            session = self.service.sessions.get(session_of(self.service.request_sessions.get(request_id, "")))
            ended = session is not None and session.status is not None and pending.future.done()
            if ended or (pending.answered is not None and stamp - pending.answered > answered_for):
                gone.append(request_id)
        for request_id in gone:
            self.futures.pop(request_id, None)
            self.service.request_sessions.pop(request_id, None)
        return len(gone)

    # ------------------------------------------------------------------ internals
    def _record(self, route: str, kind: str, body: object) -> None:
        with self._lock:
            self.received.append(Received(route, kind, body))

    def _future(
        self,
        kind: str,
        future: Future[Any],
        render: Callable[[Any], tuple[str, bytes]],
        model_id: str | None = None,
        **extra: object,
    ) -> dict[str, Any]:
        """Register a server future (applying a planned fault for ``kind``): the UntypedAPIFuture."""
        request_id = f"req-{next(self._ids)}"
        self.futures[request_id] = _Pending(kind, future, render, self.faults.take(f"kind:{kind}", ("hang", "expire")))
        if model_id is not None:
            self.service.request_sessions[request_id] = model_id
        out = {"request_id": request_id, **extra}
        if model_id is not None:
            out["model_id"] = model_id
        return out

    def _submit(self, kind: str, model_id: str, seq_id: int | None, start: Callable[[], Future[Any]]) -> Future[Any]:
        """Start a run's operation unless a fault fails it (then it uses up its place only)."""
        fault = self._peek_fail(kind)
        if fault is None:
            return start()
        run = self.service.run(model_id)
        if seq_id is not None:
            run.skip(seq_id)
        failed: Future[Any] = Future()
        failed.set_exception(UserError(fault.message) if fault.category == "user" else RuntimeError(fault.message))
        return failed

    def _peek_fail(self, kind: str) -> _Fault | None:
        return self.faults.take(f"kind:{kind}", ("fail",))

    def _record_samples(self, prompt: list[int], fut: Future[Any]) -> None:
        if fut.exception() is None:
            with self._lock:
                self.sampled.extend((list(prompt), list(c.tokens)) for c in fut.result().completions)

    def _sign(self, path: str) -> dict[str, Any]:
        """``ExternalWeightsUrlsResponse``: a URL per file under a fresh token (the signature)."""
        files = self.service.external_files(path)
        token = secrets.token_urlsafe(16)
        with self._lock:
            self._signed[token] = (path, time.time() + self.url_ttl_seconds)
        expires = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=self.url_ttl_seconds)
        return {
            "urls": {name: f"{self.url}/external/{token}/{name}" for name in sorted(files)},
            "expires": expires.isoformat(),
        }

    def _download(self, token: str, name: str) -> tuple[int, str, bytes]:
        """A file of signed URL ``token``: 403 once the token is unknown or expired."""
        with self._lock:
            path, until = self._signed.get(token, ("", 0.0))
        if time.time() >= until:
            return 403, *_json({"detail": "the signed URL is invalid or has expired"})
        file = self.service.external_files(path).get(name)
        if file is None:
            return 404, *_json({"detail": f"no file {name!r} in {path}"})
        with open(file, "rb") as fh:
            return 200, "application/octet-stream", fh.read()

    def _retrieve(self, request_id: str) -> tuple[int, str, bytes]:
        pending = self.futures.get(request_id)
        if pending is None:
            return 404, *_json({"detail": f"no future {request_id!r} (a future does not outlive the server process)"})
        self.service.seen(self.service.request_sessions.get(request_id))
        fault = self.faults.take("retrieve")
        if fault is not None:
            return fault.status, *_json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if pending.fault is not None and pending.fault.kind == "expire":
            return 410, *_json({"detail": f"future {request_id!r} expired"})
        hung = pending.fault is not None and pending.fault.kind == "hang"
        if hung or self.paused.is_set():
            time.sleep(self.hold_seconds)
        else:
            wait([pending.future], timeout=self.hold_seconds)
        if hung or self.paused.is_set() or not pending.future.done():
            state = "paused_capacity" if hung or self.paused.is_set() else "active"
            return 200, *_json({"type": "try_again", "request_id": request_id, "queue_state": state})
        pending.answered = time.monotonic()
        err = pending.future.exception()
        if err is not None:
            return 200, *_json({"error": str(err), "category": "user" if isinstance(err, UserError) else "server"})
        return 200, *pending.render(pending.future.result())

    # ------------------------------------------------------------------ routes
    def key_accepted(self, route: str, headers: Mapping[str, str]) -> bool:
        """Whether a request to ``route`` (without ``/api/v1/``) may proceed: ``healthz`` and
        signed URLs (the token is the signature) need no key; the rest one of ``api_keys``,
        or any ``tml-`` key when none are set."""
        if route == "healthz" or route.startswith("external/"):
            return True
        key = headers.get("x-api-key") or ""
        return key in self.api_keys if self.api_keys is not None else key.startswith("tml-")

    def handle(self, method: str, path: str, headers: Mapping[str, str], body: bytes) -> tuple[int, str, bytes]:
        """One HTTP request -> ``(status, content type, body)``."""
        route = path.split("?", 1)[0].removeprefix("/api/v1/").strip("/")
        _request.query = dict(urllib.parse.parse_qsl(path.split("?", 1)[1])) if "?" in path else {}
        broken = self.faults.take_broken()
        if broken is not None:
            return broken.status, *_json({"detail": broken.message})
        if not self.key_accepted(route, headers):
            return 401, *_json({"detail": INVALID_KEY})
        fault = self.faults.take(f"route:{route}")
        if fault is not None:
            return fault.status, *_json({"detail": fault.message})
        try:
            return self._route(method, route, headers, body)
        except Rejected as err:
            return err.status, *_json({"detail": str(err)})
        except UserError as err:
            return 400, *_json({"detail": str(err)})

    def _rest(self, method: str, route: str, data: Any, query: Mapping[str, str]) -> tuple[int, str, bytes] | None:
        """The REST client's routes (runs, checkpoints, sessions), or None for another route."""
        reg = self.service.registry
        offset, limit = int(query.get("offset", 0)), int(query.get("limit", 20))
        if method == "GET" and route == "training_runs":
            runs = [reg.training_run(r) for r in sorted(reg.runs, key=lambda r: reg.runs[r].created, reverse=True)]
            page, cursor = reg.page(runs, offset, limit)
            return 200, *_json({"training_runs": page, "cursor": cursor})
        if method == "GET" and route == "checkpoints":
            page, cursor = reg.page(
                [c.as_checkpoint() for c in reversed(reg.checkpoints_of())], offset, int(query.get("limit", 100))
            )
            return 200, *_json({"checkpoints": page, "cursor": cursor})
        if method == "POST" and route == "weights_info":
            return 200, *_json(self.service.weights_info(data["tinker_path"]))
        if method == "GET" and route == "sessions":
            return 200, *_json({"sessions": sorted(self.service.sessions)})
        if method == "GET" and (m := re.fullmatch(r"sessions/([^/]+)", route)):
            if m.group(1) not in self.service.sessions:
                return 404, *_json({"detail": f"no session {m.group(1)!r}"})
            run_ids = [r for r in reg.runs if r.startswith(m.group(1) + ":")]
            samplers = [s for s in self.service.samplers if s.startswith(m.group(1) + ":")]
            return 200, *_json({"training_run_ids": run_ids, "sampler_ids": samplers})
        if method == "GET" and (m := re.fullmatch(r"training_runs/([^/]+)", route)):
            run = reg.training_run(m.group(1))
            return (
                (200, *_json(run)) if run is not None else (404, *_json({"detail": f"no training run {m.group(1)!r}"}))
            )
        if method == "GET" and (m := re.fullmatch(r"training_runs/([^/]+)/checkpoints", route)):
            if m.group(1) not in reg.runs:
                return 404, *_json({"detail": f"no training run {m.group(1)!r}"})
            return 200, *_json({"checkpoints": [c.as_checkpoint() for c in reg.checkpoints_of(m.group(1))]})
        if (m := re.fullmatch(r"training_runs/([^/]+)/checkpoints/(.+)/(publish|ttl)", route)) and method in (
            "POST",
            "DELETE",
            "PUT",
        ):
            record = reg.checkpoints.get(f"tinker://{m.group(1)}/{m.group(2)}")
            if record is None:
                return 404, *_json({"detail": f"no checkpoint tinker://{m.group(1)}/{m.group(2)}"})
            if m.group(3) == "publish":
                if record.public == (method == "POST"):
                    # 400, not the service's 409: the SDK retries a 409 for five minutes whatever the headers say
                    return 400, *_json(
                        {"detail": f"the checkpoint is already {'public' if record.public else 'private'}"}
                    )
                record.public = method == "POST"
            else:
                ttl = (data or {}).get("ttl_seconds")
                try:
                    from tempering.plugins.tinker_server.service import _check_ttl

                    _check_ttl(ttl)
                except Rejected as err:
                    return err.status, *_json({"detail": str(err)})
                until = (
                    None
                    if ttl is None
                    else datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=int(ttl))
                )
                record.expires_at = until.isoformat() if until else None
            reg.save()
            return 200, *_json(None)
        return None

    def _route(self, method: str, route: str, headers: Mapping[str, str], body: bytes) -> tuple[int, str, bytes]:
        svc = self.service
        query: dict[str, str] = getattr(_request, "query", {})
        data: Any = json.loads(body or b"null") if "protobuf" not in headers.get("content-type", "") else None
        fut: Future[Any]  # the answer of a queued or sampled request, one name for every route below
        if route == "healthz":
            return 200, *_json({"status": "ok"})
        if route == "client/config":
            return 200, *_json(CLIENT_CONFIG)
        if route == "telemetry":  # the SDK validates the reply as types.TelemetryResponse: {} was a 47-line traceback
            return 200, *_json(types.TelemetryResponse(status="accepted").model_dump(mode="json"))
        if route == "cancel_future":  # the SDK reads no body (cast_to=NoneType)
            return 200, *_json({})
        if route == "get_server_capabilities":
            return 200, *_json(
                {"supported_models": [{"model_name": m, "trainable": True, "sampleable": True} for m in svc.models]}
            )
        if route == "create_session":
            self._record(route, "CreateSession", types.CreateSessionRequest.model_validate(data))
            return 200, *_json({"type": "create_session", "session_id": svc.create_session()})
        if route == "session_heartbeat":
            svc.heartbeat(data["session_id"])
            return 200, *_json({"type": "session_heartbeat"})
        if (m := re.fullmatch(r"sessions/([^/]+)/finish", route)) is not None:
            self._record(route, "FinishSession", data)
            svc.finish(m.group(1), (data.get("reason") or {}).get("type", "success"))
            return 200, *_json(None)
        if route == "create_model":
            create = types.CreateModelRequest.model_validate(data)
            self._record(route, "CreateModel", create)
            model_id, fut = svc.create_model(create)
            return 200, *_json(self._future("CreateModel", fut, _json, model_id))
        if route == "get_info":
            return 200, *_json(svc.info(data["model_id"]))
        if route == "forward_backward":
            call = wire.decode_forward_backward(body)
            kind = "Forward" if call.forward_only else "ForwardBackward"
            self._record(route, kind, call)
            fut = self._submit(kind, call.model_id, call.seq_id, lambda: svc.forward_backward(call))
            return 200, *_json(
                self._future(kind, fut, lambda r: (wire.PROTO, wire.encode_forward_backward(*r)), call.model_id)
            )
        if route in QUEUED_JSON:
            request_type, kind, run = QUEUED_JSON[route]
            req = request_type.model_validate(data)
            self._record(route, kind, req)
            fut = self._submit(kind, req.model_id, req.seq_id, lambda: getattr(svc, run)(req))
            return 200, *_json(self._future(kind, fut, _json, req.model_id))
        rest = self._rest(method, route, data, query)
        if rest is not None:
            return rest
        if method == "GET" and (
            m := re.fullmatch(r"training_runs/([^/]+)/checkpoints/(.+)/external_weights_urls", route)
        ):
            self._record(route, "ExternalWeightsUrls", None)
            return 200, *_json(self._sign(f"tinker://{m.group(1)}/{m.group(2)}"))
        if method == "DELETE" and (m := re.fullmatch(r"training_runs/([^/]+)/checkpoints/(.+)", route)):
            self._record(route, "DeleteCheckpoint", None)
            svc.delete_checkpoint(f"tinker://{m.group(1)}/{m.group(2)}")
            return 200, *_json(None)
        if method == "GET" and (m := re.fullmatch(r"external/([^/]+)/(.+)", route)):
            return self._download(m.group(1), m.group(2))
        if route == "load_weights":
            load = types.LoadWeightsRequest.model_validate(data)
            self._record(route, "LoadWeights", load)
            model_id, fut = svc.load_state(load)
            return 200, *_json(self._future("LoadWeights", fut, _json, model_id))
        if route == "create_sampling_session":
            session = types.CreateSamplingSessionRequest.model_validate(data)
            self._record(route, "CreateSamplingSession", session)
            return 200, *_json(
                {"type": "create_sampling_session", "sampling_session_id": svc.create_sampling_session(session)}
            )
        if method == "GET" and (m := re.fullmatch(r"samplers/([^/]+)", route)) is not None:
            sampler = svc.sampler(m.group(1))
            return 200, *_json({"sampler_id": m.group(1), "base_model": sampler.base_model, "model_path": sampler.path})
        if route == "asample":
            sample = types.SampleRequest.model_validate(data)
            self._record(route, "Sample", sample)
            ids = [f"{sample.sampling_session_id}:{sample.seq_id}:{i}" for i in range(int(sample.num_samples))]
            if self._peek_fail("Sample") is not None:
                fut = Future()
                fut.set_exception(RuntimeError("injected server failure"))
            else:
                fut = svc.sample(sample, ids)
                if not (
                    sample.prompt_logprobs or sample.topk_prompt_logprobs
                ):  # not a scoring request's throwaway token
                    prompt_ids = sample.prompt.to_ints()
                    fut.add_done_callback(lambda f: self._record_samples(prompt_ids, f))
            return 200, *_json(
                self._future("Sample", fut, _render_sample, sample.sampling_session_id, sample_sequence_ids=ids)
            )
        if route == "retrieve_future":
            return self._retrieve(types.FutureRetrieveRequest.model_validate(data).request_id)
        return 404, *_json({"detail": f"no route {method} /api/v1/{route}"})


def _render_sample(result: Any) -> tuple[str, bytes]:
    seqs = [(c.tokens, c.logprobs, c.stop_reason) for c in result.completions]
    return wire.PROTO, wire.encode_sample(
        seqs, result.prompt_logprobs, result.topk_prompt, result.k, result.topk_sampled, result.k_sampled
    )


def _route_of(path: str) -> str:
    return path.removeprefix("/api/v1/").strip("/")


def _policy(server: LocalTinkerServer, host: str, allowed_hosts: Iterable[str] | None) -> Policy:
    """Tinker's error shape (``{"detail": ...}``, ``x-should-retry: false`` on a 4xx the SDK
    must not retry), the API key before the body, JSON bodies unless protobuf; loopback names
    only on a loopback address (DNS rebinding), any on another (which needs ``api_keys``)."""
    hosts: frozenset[str] | None = frozenset(allowed_hosts or ())
    if allowed_hosts is None and not is_loopback_address(host):
        hosts = None
    return Policy(
        error_body=lambda status, message: {"detail": message},
        error_headers=server_headers,
        authorize=lambda method, path, headers: None if server.key_accepted(_route_of(path), headers) else INVALID_KEY,
        allowed_hosts=hosts,
        host_hint="serve-tinker --allow-host NAME",
        is_json=lambda method, path, headers: "protobuf" not in headers.get("content-type", ""),
        # a long poll holds a worker for hold_seconds (20 s under the CLI): one per waiting future
        limits=Limits(max_body=MAX_BODY, workers=1024),
    )


def _handler(server: LocalTinkerServer) -> Callable[[Call], Reply]:
    """The transport's side of :meth:`LocalTinkerServer.handle`: a request that does not fit
    its route's schema (a JSON list, a missing field, protobuf that does not decode) is the
    client's 400, not a 500 with a traceback."""

    def answer(call: Call) -> Reply:
        target = call.path + (f"?{call.query}" if call.query else "")
        try:
            status, ctype, payload = server.handle(call.method, target, call.headers, call.body)
        except (DecodeError, KeyError, TypeError, ValueError) as err:  # pydantic's ValidationError too
            why = f"{type(err).__name__}: {err}"
            raise Refused(400, f"{call.method} {call.path}: the request does not fit its route: {why}") from None
        return Reply(status, payload, ctype, server_headers(status))

    return answer


def server_headers(status: int) -> dict[str, str]:
    """``x-should-retry: false`` on a 4xx but 408/429: the SDK's base client obeys it."""
    return {"x-should-retry": "false"} if 400 <= status < 500 and status not in (408, 429) else {}
