"""The Tinker tests' fixtures: the local Tinker server, and backends that talk to it through the
real SDK.

``serve`` (the body of each module's ``server`` fixture) starts
:class:`~tempering.plugins.tinker_server.server.LocalTinkerServer` on loopback for one
test (its own models, faults and request log), points ``TINKER_BASE_URL`` at it, sets a ``tml-``
key, turns the SDK's telemetry off and keeps every cache in the test's folder.
``make_backend(server, **kwargs)`` builds a ``TinkerBackend`` on it -- the real
``tinker.ServiceClient`` underneath, over HTTP -- and closes it (finishing its session) when the
test ends. ``MODEL_KWARGS`` are the served ``tiny_llama``'s (small enough for milliseconds per
step); ``sent(server, kind)`` lists the decoded requests of a kind (``"ForwardBackward"``,
``"Sample"``, ...); ``plain(call)`` a forward_backward request's rows as plain lists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker  # noqa: F401 - a dev dependency: missing is a failure, not a skip

from tempering.plugins.backends.tinker.backend import TinkerBackend
from tempering.plugins.backends.tinker.mapping import plain_datum
from tempering.plugins.tinker_server.server import LocalTinkerServer
from tempering.plugins.tinker_server.service import ServedModel

MODEL_KWARGS = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
CHAT_KWARGS = {**MODEL_KWARGS, "chat": True, "max_position_embeddings": 128}
KEY = "tml-local-test"


def set_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A clean SDK environment: a valid-looking key, no telemetry, caches and credentials in
    the test's folder."""
    monkeypatch.setenv("TINKER_API_KEY", KEY)
    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    monkeypatch.delenv("TINKER_PROJECT_ID", raising=False)


def start_server(
    monkeypatch: pytest.MonkeyPatch, models: dict[str, Any] | None = None, **kwargs: Any
) -> LocalTinkerServer:
    """A started server (``tiny_llama`` at :data:`MODEL_KWARGS` unless ``models``), and
    ``TINKER_BASE_URL`` pointing at it."""
    server = LocalTinkerServer(
        models or {"tiny_llama": ServedModel("tiny_llama", MODEL_KWARGS)}, hold_seconds=0.5, **kwargs
    )
    server.start()
    monkeypatch.setenv("TINKER_BASE_URL", server.url)
    return server


def serve(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, models: dict[str, Any] | None = None
) -> Iterator[LocalTinkerServer]:
    """The body of a test module's ``server`` fixture (``yield from serve(monkeypatch, tmp_path)``):
    the environment, a started server, and at the end every backend closed and the server stopped."""
    set_env(monkeypatch, tmp_path)
    srv = start_server(monkeypatch, models)
    try:
        yield srv
    finally:
        close_backends()
        srv.stop()


_OPEN: list[TinkerBackend] = []


def make_backend(server: LocalTinkerServer, **kwargs: Any) -> TinkerBackend:
    """A backend on ``server`` through the real SDK; closed when the test ends."""
    kwargs.setdefault("base_model", "tiny_llama")
    kwargs.setdefault("retry_backoff", 0.0)
    backend = TinkerBackend(base_url=server.url, **kwargs)
    _OPEN.append(backend)
    return backend


def close_backends() -> None:
    while _OPEN:
        _OPEN.pop().close()


def sent(server: LocalTinkerServer, kind: str) -> list[Any]:
    """The decoded bodies of the requests of ``kind`` (e.g. ``ForwardBackward``), in order."""
    return server.bodies(kind)


def plain(call: Any) -> list[dict[str, Any]]:
    """A forward_backward request's rows as plain lists."""
    return [plain_datum(d) for d in call.data]
