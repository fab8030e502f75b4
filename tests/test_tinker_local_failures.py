"""The local Tinker server answers the SDK's telemetry, and a dead, failing or frozen service is
named as such (issue 24 item 6).

* The documented local-server command printed a 47-line ``APIResponseValidationError ...
  TelemetryResponse`` traceback unless ``TINKER_TELEMETRY=0``: the server answered ``{}`` where
  SDK 0.38 validates ``{"status": "accepted"}``.
* A dead server (connection refused), persistent HTTP 500s and a frozen server (it accepts
  connections, answers nothing) all ended with "the service may be paused for capacity or rate
  limits" (the SDK retries all three without a word); the message now says which.
* ``TinkerBackend.close`` on such a service waited 30 s and warned ``"TinkerBackend.close: "``
  with nothing after it (a ``TimeoutError`` has no text).

Dead and frozen servers are real processes (``python -m tempering.plugins.tinker_server``), killed or stopped
with SIGSTOP: an in-process server keeps answering on connections the SDK holds open.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import MODEL_KWARGS, make_backend, serve, set_env

from tempering.plugins.backends.tinker.backend import TinkerBackend
from tempering.plugins.backends.tinker.errors import TinkerServiceError
from tempering.plugins.tinker_server import server as local_server
from tempering.types import SamplingParams

pytestmark = pytest.mark.timeout(180)

PROMPT = [1, 4, 5, 13, 6, 7, 14]  # "12+34="
GUESS = "paused for capacity"


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path)


def sample(backend: TinkerBackend) -> None:
    backend.sample([PROMPT], 1, SamplingParams(max_tokens=1)).result()


def test_telemetry_is_answered_as_the_sdk_expects(server, monkeypatch, capfd, caplog):
    monkeypatch.delenv("TINKER_TELEMETRY")  # on, as for anyone following docs/tinker.md
    asked = []
    route = local_server.LocalTinkerServer._route

    def counting(self, method, name, headers, body):
        asked.append(name)
        return route(self, method, name, headers, body)

    monkeypatch.setattr(local_server.LocalTinkerServer, "_route", counting)
    backend = make_backend(server)
    sample(backend)
    backend.close()  # the SDK flushes its telemetry when the session ends
    err = capfd.readouterr().err + caplog.text  # the SDK logs the traceback
    assert "telemetry" in asked
    assert "APIResponseValidationError" not in err and "TelemetryResponse" not in err, err


def test_persistent_http_500s_are_named_with_status_and_body(server):
    backend = make_backend(server, request_timeout_seconds=3, wait_warning_seconds=60)
    sample(backend)
    server.faults.broken(500, "the database is on fire")
    with pytest.raises(TinkerServiceError) as info:
        sample(backend)
    message = str(info.value)
    assert "HTTP 500" in message and "the database is on fire" in message and GUESS not in message, message
    assert "request_timeout_seconds" in message
    server.faults.clear()


class ServerProcess:
    """``python -m tempering.plugins.tinker_server`` on a free loopback port."""

    def __init__(self) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tempering.plugins.tinker_server",
                "--port",
                str(port),
                "--model-kwargs",
                json.dumps(MODEL_KWARGS),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()  # "serving tiny_llama at ..." once it listens
        assert self.url in line, line

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


@pytest.fixture
def process(monkeypatch, tmp_path):
    set_env(monkeypatch, tmp_path)
    proc = ServerProcess()
    try:
        yield proc
    finally:
        proc.stop()


def closed_with_warning(backend: TinkerBackend) -> tuple[str, float]:
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend.close()
    took = time.monotonic() - start
    [warning] = [w for w in caught if "TinkerBackend.close" in str(w.message)]
    return str(warning.message), took


def test_a_dead_server_is_connection_refused(process):
    backend = TinkerBackend(
        base_model="tiny_llama",
        base_url=process.url,
        retry_backoff=0.0,
        request_timeout_seconds=3,
        wait_warning_seconds=60,
    )
    sample(backend)
    process.proc.kill()
    process.proc.wait()
    with pytest.raises(TinkerServiceError) as info:
        sample(backend)
    message = str(info.value)
    assert "connection refused" in message and process.url in message and GUESS not in message, message
    text, took = closed_with_warning(backend)
    assert "connection refused" in text and "session was not finished" in text, text
    assert took < 15  # was 30 s
    # and the SDK's session heartbeat stops (it warned every 10 s for minutes after the run)
    heartbeat = backend.service._session_holder._session_heartbeat_task
    deadline = time.monotonic() + 10
    while not heartbeat.done() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert heartbeat.done()


def test_a_frozen_server_is_no_answer_within_n_seconds(process):
    backend = TinkerBackend(
        base_model="tiny_llama",
        base_url=process.url,
        retry_backoff=0.0,
        request_timeout_seconds=3,
        wait_warning_seconds=60,
    )
    sample(backend)
    os.kill(process.proc.pid, signal.SIGSTOP)  # it still accepts connections (the kernel does), answers nothing
    with pytest.raises(TinkerServiceError) as info:
        sample(backend)
    message = str(info.value)
    assert "no answer within" in message and process.url in message and GUESS not in message, message
    text, took = closed_with_warning(backend)
    assert "no answer within" in text, text
    assert took < 20


def test_a_server_that_dies_mid_run_is_named_at_once(process, monkeypatch):
    """Issue 35 item 13: a service killed mid-run was waited on for request_timeout_seconds (and
    then setup_timeout_seconds, for a new training client on the same dead service), warning
    "paused for capacity or rate limits" 4x. Its health is now asked while the call waits (every
    HEALTH_CHECK_SECONDS, 10 by default, shortened here): a refused connection ends the wait at
    once, in one line, with no recovery attempt and no guess about capacity."""
    from tempering.plugins.backends.tinker import waits
    from tempering.types import AdamParams

    monkeypatch.setattr(waits, "HEALTH_CHECK_SECONDS", 1.0)
    backend = TinkerBackend(
        base_model="tiny_llama",
        base_url=process.url,
        retry_backoff=0.0,
        request_timeout_seconds=600,
        setup_timeout_seconds=600,
        wait_warning_seconds=60,  # the defaults: before, the first word came after 60 s
    )
    backend.optim_step(AdamParams()).result()
    process.proc.kill()
    process.proc.wait()
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TinkerServiceError) as info:
            backend.optim_step(AdamParams()).result()
    took = time.monotonic() - start
    message = str(info.value)
    assert "stopped answering while waiting for optim_step (connection refused" in message, message
    assert process.url in message and GUESS not in message and "\n" not in message
    assert took < 15, took
    texts = [str(w.message) for w in caught]
    assert not [t for t in texts if "capacity" in t or "rebuilding the training client" in t], texts
    backend.close()


def test_the_sdks_telemetry_failures_are_one_line(server, caplog):
    """The SDK's telemetry sender logged each failed flush with its whole chained traceback
    (~75 lines when the service died); a backend keeps the record, in one line."""
    import logging

    import httpx
    import tinker

    make_backend(server)
    try:
        raise tinker.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:1/telemetry"))
    except tinker.APIConnectionError as err:  # as the SDK's sender logs it (tinker/lib/telemetry.py)
        logging.getLogger("tinker.lib.telemetry").warning("Dropping telemetry batch that failed to send", exc_info=err)
    [record] = [r for r in caplog.records if r.name == "tinker.lib.telemetry"]
    assert record.exc_info is None
    assert record.getMessage() == "Dropping telemetry batch that failed to send (APIConnectionError: Connection error.)"
    assert "Traceback" not in caplog.text
