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
    """Processes still running a sandbox's harness (forked children keep its command line)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "harness.py" in cmdline and "job.json" in cmdline:
            found.append(f"{pid}: {cmdline[:120]}")
    return found
