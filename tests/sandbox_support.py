"""Shared by the sandbox reward's tests: a sandbox with short limits (or a skip naming why this
machine cannot run one), a blocking call, and the processes a sandbox may have left behind."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from tempering.errors import ConfigError
from tempering.interfaces import RewardResult
from tempering.plugins.rewards.sandbox.reward import Sandbox

#: Limits short enough for tests of seconds: a runaway program is killed within ``wall_seconds``.
SHORT = {"cpu_seconds": 1, "wall_seconds": 3.0, "memory_mb": 256, "max_processes": 16, "max_output_kb": 64}


def make_sandbox(**keys: Any) -> Sandbox:
    """A :class:`Sandbox` with :data:`SHORT` limits; skips the test, with the reason, when the
    machine cannot isolate (no bubblewrap, no user namespaces)."""
    try:
        return Sandbox(**{**SHORT, **keys})
    except ConfigError as exc:
        pytest.skip(f"this machine cannot run the sandbox: {exc}")


def call(sandbox: Sandbox, program: str, tests: list[str]) -> RewardResult:
    return asyncio.run(sandbox(f"```python\n{program}\n```", {"tests": tests}))


def leftover_processes() -> list[str]:
    """Processes still running the harness of a call that has ended: the last word of a
    harness's command line is its call's host folder, removed when the call returns (forked
    children keep the command line). Calls still running elsewhere (another test worker) keep
    their folder, so they are not counted."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if len(argv) > 3 and argv[-3].endswith("program.py") and "harness.py" in " ".join(argv):
            if not os.path.isdir(argv[-1]):
                found.append(f"{pid}: {' '.join(argv)[:160]}")
    return found
