"""The tinker-cookbook compatibility suite's server: ``tempering serve-tinker`` serving the real
SmolLM2-135M-Instruct as ``HuggingFaceTB/SmolLM2-135M-Instruct``, one process for the module,
with its tokenizer in a Hugging Face cache of the test's own (``HF_HUB_OFFLINE=1``).

The suite needs tinker-cookbook, installed as a user would (``pip install --no-deps
tinker-cookbook==0.6.1`` and what it imports; .ci/run does it in a venv of its own) and the
SmolLM2 weights (``tempering install-model smollm2``). Its tests are marked ``extras``: the
default suite skips them, .ci/run runs them in that venv.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import KEY, MODEL, Served

START_S = 60  # the server's first line, then the tokenizer's line: each bounded


def _readline(proc: subprocess.Popen, seconds: float) -> str:
    """One line of the server's output within ``seconds`` (it prints as it becomes ready)."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(seconds):
        raise AssertionError(f"the server printed nothing within {seconds} s")
    return proc.stdout.readline()


@pytest.fixture(scope="session")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    pytest.importorskip(
        "tinker_cookbook", reason="tinker-cookbook is not installed (.ci/run installs it in its own venv)"
    )
    from tempering.plugins.models.smollm2 import smollm2_folder

    try:
        smollm2_folder()
    except Exception as err:  # noqa: BLE001 - an optional install
        pytest.skip(f"SmolLM2 is not installed: tempering install-model smollm2 ({err})")
    root = tmp_path_factory.mktemp("serve-tinker")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TINKER_TELEMETRY": "0",
        "TINKER_API_KEY": KEY,
        "TINKER_BASE_URL": f"http://127.0.0.1:{port}",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tempering",
            "serve-tinker",
            "--model",
            "smollm2",
            "--name",
            MODEL,
            "--port",
            str(port),
            "--root",
            str(root / "root"),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        first = _readline(proc, START_S)
        assert f"127.0.0.1:{port}" in first, first
        while "tokenizer of" not in (line := _readline(proc, START_S)):
            assert line, "the server exited"
        yield Served(f"http://127.0.0.1:{port}", env)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.stdout.close()
