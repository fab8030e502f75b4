"""Small rewards for tests, benchmarks and smoke-checking a deployment, importable by name in
any process (worker pools, ``tempering serve-reward``)::

    tempering serve-reward tempering.plugins.rewards.testing:async_length --port 8765

Each returns ``len(completion)`` and obeys a few example keys: ``burn_ms`` (busy CPU for that
long, not sleep), ``sleep_s`` (async only: ``await asyncio.sleep``), ``fail`` (raise
``ValueError``), ``nan`` (return NaN), ``hang`` (never return), ``crash`` (kill the process).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping
from typing import Any

from tempering.interfaces import RewardResult


def burn_cpu(ms: float) -> int:
    """Spin (no sleep, no I/O) for ``ms`` milliseconds; returns the loop count."""
    end = time.perf_counter() + ms / 1000.0
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


def _misbehave(example: Mapping[str, Any]) -> float | None:
    if example.get("crash"):
        os._exit(13)
    if example.get("hang"):
        while True:  # a checker stuck in a loop
            burn_cpu(100)
    if example.get("fail"):
        raise ValueError(f"asked to fail: {example.get('fail')}")
    if example.get("nan"):
        return float("nan")
    return None


def length(completion: str, example: Mapping[str, Any]) -> float:
    """``len(completion)``, after burning ``example["burn_ms"]`` of CPU."""
    burn_cpu(float(example.get("burn_ms", 0)))
    bad = _misbehave(example)
    return bad if bad is not None else float(len(completion))


def length_with_pid(completion: str, example: Mapping[str, Any]) -> RewardResult:
    """:func:`length` with the scoring process's pid in ``info`` (to see which worker ran it)."""
    return RewardResult(length(completion, example), {"pid": os.getpid()})


async def async_length(completion: str, example: Mapping[str, Any]) -> float:
    """``len(completion)`` after ``await asyncio.sleep(example["sleep_s"])``."""
    await asyncio.sleep(float(example.get("sleep_s", 0)))
    bad = _misbehave(example)
    return bad if bad is not None else float(len(completion))
