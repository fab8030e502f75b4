"""Run a command that starts children (``torchrun`` and its ranks) with a deadline that holds.

``subprocess.run(..., capture_output=True, timeout=...)`` does not bound such a command: on
timeout it kills only the direct child, then waits for the pipes to close, and the ranks, which
hold them, go on. A hung rank therefore hung the whole CI run (it ran out of its 90 minutes in
the vLLM torchrun test). Here the command writes to a file rather than a pipe, and on timeout it
and every process it started are killed. Not by process group alone: torchrun starts each rank
in a session of its own, so the tree is read from ``/proc`` (Linux) before anything is killed
(a killed parent's children are handed to init and can no longer be traced to it).
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Finished:
    """What a command left: its exit status (None where it ran out of time) and its output."""

    returncode: int | None
    output: str

    def tail(self, chars: int = 6000) -> str:
        status = "ran out of time (killed)" if self.returncode is None else f"exit status {self.returncode}"
        return f"{status}; its output ends:\n{self.output[-chars:]}"


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start ``cmd`` in a session of its own (a signal to the test's terminal does not reach
    it), stdout and stderr into ``log``."""
    with log.open("w") as sink:
        return subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children, their children, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # it ended while we looked
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])  # after "pid (comm) state"
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process it started (ranks in sessions of their own too), then
    reap it."""
    for pid in [*descendants(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def wait(proc: subprocess.Popen, log: Path, timeout: float) -> Finished:
    """Wait up to ``timeout`` seconds for ``proc``; past it, kill it and all it started. Only
    then: once ``proc`` has ended and been reaped its pid may already be another process's, and
    torchrun itself waits for its ranks before it ends."""
    try:
        code: int | None = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        code = None
        kill(proc)
    return Finished(code, log.read_text(errors="replace"))


def run(cmd: list[str], env: dict[str, str], log: Path, timeout: float) -> Finished:
    """:func:`start` then :func:`wait`."""
    return wait(start(cmd, env, log), log, timeout)
