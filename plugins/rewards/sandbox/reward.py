"""The ``sandbox`` reward: run the model's program against the example's tests in an isolated
process and score the share of tests it passes.

```yaml
reward: {name: sandbox}                                  # example["tests"]: ["assert add(2, 3) == 5", ...]
reward: {name: sandbox, scoring: all, cpu_seconds: 2, memory_mb: 256, isolation: bubblewrap}
```

Every call is ``async`` (a subprocess the event loop waits on), so the reward runner keeps
``workers`` calls in flight at once; each call is bounded by ``wall_seconds`` on the host's
clock, after which the whole sandbox (its pid namespace, or its process group under
``rlimits``) is killed: no call blocks the run for longer.

What the program does decides the sample's ``info["outcome"]`` (counted per step as
``outcome/<label>``, see :mod:`tempering.runs.outcomes`): ``passed``, ``failed_tests``,
``error`` (it raised while loading), ``syntax_error``, ``no_code``, ``crashed`` (it ended the
process before reporting); or a limit it hit -- ``timeout`` (wall clock), ``cpu_time``,
``memory``, ``process_limit``, ``output_limit`` -- which scores 0 whatever tests passed first.
All of these are *scores* (the model wrote that program), never failures. A sandbox that
cannot start at all is a failure: :class:`SandboxError`, counted as ``failed/raised:SandboxError``
and left out of the loss. The isolation in use (see :mod:`.isolation`) is found when the reward
is built and said in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from tempering.interfaces import RewardResult
from tempering.plugins.rewards.common import LoopLocal, RewardError
from tempering.plugins.rewards.sandbox.isolation import (
    ISOLATIONS,
    Isolation,
    IsolationUnavailable,
    default_python,
    detect,
)
from tempering.plugins.rewards.sandbox.job import Job, Limits
from tempering.plugins.rewards.sandbox.program import EXTRACT_MODES, CodeTest, extract_program, parse_tests, passed
from tempering.schema import Problem, check_config_at, field_values, one_of

#: Outcomes of a program that hit a limit: scored 0.
LIMIT_OUTCOMES = ("timeout", "cpu_time", "memory", "process_limit", "output_limit")
#: Exceptions that mean a limit was hit, by the outcome they stand for.
LIMIT_ERRORS = {"MemoryError": "memory", "BlockingIOError": "process_limit"}
SCORINGS = ("fraction", "all")
_started: set[str] = set()  # isolation lines already printed in this process


class SandboxError(RewardError):
    """The sandbox itself failed (it did not start): not the program's doing."""


@dataclass
class Finished:
    """What one sandboxed run left: the program's output, the harness's report, the exit
    status and the limit that ended it."""

    stdout: bytes
    stderr: bytes
    report: bytes
    returncode: int | None
    limit: str | None
    seconds: float


@dataclass
class Sandbox:
    """Runs the program in a completion against ``example[tests_key]`` (assert strings) in a
    sandbox; the reward is the share of tests passed (``scoring: fraction``) or 1/0
    (``scoring: all``). See the module docs and docs/sandbox.md for the keys and the threat model.
    """

    column_keys: ClassVar[tuple[str, ...]] = ("tests_key",)
    tests_key: str = "tests"
    scoring: str = "fraction"
    extract: str = "auto"
    isolation: str = "auto"
    cpu_seconds: int = 5
    wall_seconds: float = 10.0
    memory_mb: int = 512
    max_processes: int = 16
    max_output_kb: int = 64
    tmp_mb: int = 16
    workers: int = 0
    uid: int = 65534
    python: str = ""

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """One line per wrong key, before anything trains; last, whether the isolation asked for
        works on this machine (it is probed once per process)."""
        yield one_of("scoring", config["scoring"], SCORINGS, f"use one of {', '.join(SCORINGS)}")
        yield one_of("extract", config["extract"], EXTRACT_MODES, f"use one of {', '.join(EXTRACT_MODES)}")
        yield one_of("isolation", config["isolation"], ISOLATIONS, f"use one of {', '.join(ISOLATIONS)}")
        for key in ("cpu_seconds", "wall_seconds", "memory_mb", "max_processes", "max_output_kb", "tmp_mb"):
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                yield Problem(key, f"must be a number > 0, got {value!r}")
                return
        if config["memory_mb"] < 64:
            yield Problem(
                "memory_mb", f"must be at least 64 (the interpreter alone needs ~20 MB), got {config['memory_mb']}"
            )
        if config["max_processes"] < 2:
            yield Problem(
                "max_processes",
                f"must be at least 2 (the sandbox's init and the program), got {config['max_processes']}",
            )
        if isinstance(config["uid"], bool) or not isinstance(config["uid"], int) or config["uid"] <= 0:
            yield Problem("uid", f"must be an unprivileged host uid > 0 (e.g. 65534, nobody), got {config['uid']!r}")
        python = config["python"] or default_python()
        if not os.access(python, os.X_OK):
            yield Problem(
                "python",
                f"{python} is not an executable interpreter; name one the sandbox can run (e.g. /usr/bin/python3)",
            )
            return
        if config["isolation"] in ISOLATIONS:
            try:
                detect(config["isolation"], config["uid"], python)
            except IsolationUnavailable as exc:
                yield Problem(
                    "isolation",
                    f"{exc}; install bubblewrap (apt-get install bubblewrap) and allow user namespaces, or set "
                    "isolation: rlimits to accept weaker isolation "
                    "(the program then sees the host's files and network)",
                )

    def __post_init__(self) -> None:
        check_config_at(type(self), field_values(self), "reward")
        self.workers = int(self.workers) or (os.cpu_count() or 1)
        self.max_concurrency = self.workers  # read by RewardRunner: its timeout then excludes queueing
        self.used: Isolation = detect(self.isolation, self.uid, self.python or default_python())
        self.limits = Limits(
            cpu_seconds=int(self.cpu_seconds),
            memory_bytes=int(self.memory_mb) << 20,
            max_processes=int(self.max_processes),
            file_bytes=int(self.tmp_mb) << 20,
        )
        self._slots: LoopLocal[asyncio.Semaphore] = LoopLocal(lambda: asyncio.Semaphore(self.workers))
        line = self.used.describe()
        if line not in _started:
            _started.add(line)
            from tempering.runs.failures import announce

            announce(line)

    # ------------------------------------------------------------------ a call
    async def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        if self.tests_key not in example:
            raise KeyError(
                f"sandbox: the example has no '{self.tests_key}' key (keys: {sorted(example)}); set reward.tests_key"
            )
        tests = parse_tests(example[self.tests_key], self.tests_key)
        program = extract_program(completion, self.extract)
        if program is None:
            return self._result("no_code", tests, [], 0.0, "no ```python block in the completion")
        async with self._slots.get():
            with Job(program, [t.expression for t in tests], self.limits) as job:
                run = await self.run(job)
                if not job.started(run.stderr) and run.limit is None:
                    first = (run.stderr.decode(errors="replace").strip().splitlines() or [f"exit {run.returncode}"])[0]
                    raise SandboxError(f"the sandbox did not start ({self.used.kind}): {first}")
                return self._score(job, run, tests)

    async def run(self, job: Job) -> Finished:
        """Run the harness on ``job`` under the isolation in use, within the limits."""
        info_read, info_write = os.pipe()  # bubblewrap's --info-fd: the namespace's init, to kill
        report_read, report_write = os.pipe()  # the harness's report, apart from the program's output
        argv = self.used.argv(job.folder, self.limits.file_bytes, report_write)
        bwrap = self.used.kind == "bubblewrap"
        if bwrap:
            argv[1:1] = ["--info-fd", str(info_write)]
        t0 = time.monotonic()
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(info_write, report_write) if bwrap else (report_write,),
                cwd=job.folder,  # never the trainer's (the run folder): the rlimits fallback starts there
                **self.used.popen_kwargs(),
            )
        except OSError as exc:
            os.close(info_read)
            os.close(report_read)
            raise SandboxError(f"could not start the sandbox ({self.used.kind}): {exc}") from None
        finally:
            os.close(info_write)
            os.close(report_write)
        report_stream = asyncio.StreamReader()
        loop = asyncio.get_running_loop()
        report_pipe, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(report_stream), os.fdopen(report_read, "rb", 0)
        )
        out, err, report = bytearray(), bytearray(), bytearray()
        budget, report_budget, over = [int(self.max_output_kb) << 10], [job.report_bytes()], asyncio.Event()
        done: asyncio.Future[Any] = asyncio.ensure_future(
            asyncio.gather(
                _drain(proc.stdout, out, budget, over),
                _drain(proc.stderr, err, budget, over),
                _drain(report_stream, report, report_budget, over),
                proc.wait(),
            )
        )
        watch: asyncio.Future[Any] = asyncio.ensure_future(over.wait())
        limit: str | None = None
        try:
            finished, _ = await asyncio.wait(
                {done, watch}, timeout=self.wall_seconds, return_when=asyncio.FIRST_COMPLETED
            )
            if done not in finished:
                limit = "output_limit" if watch in finished else "timeout"
        finally:  # also when the caller gave up (cancelled): the sandbox must not outlive the call
            if not done.done():
                self._kill(proc.pid, info_read)
            # Once all is dead the pipes drain to EOF and the process is reaped (asyncio reports
            # the exit only then); waiting here also keeps a cancelled call from leaving both.
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(done), 10.0)
            for task in (done, watch):
                task.cancel()
            await asyncio.gather(done, watch, return_exceptions=True)
            report_pipe.close()
            os.close(info_read)
        return Finished(bytes(out), bytes(err), bytes(report), proc.returncode, limit, time.monotonic() - t0)

    def _kill(self, pid: int, info_read: int) -> None:
        """End the whole sandbox: bubblewrap's pid-namespace init first (the kernel then kills
        every process of the namespace, and bwrap exits once they are gone), then ``pid`` and
        its process group."""
        if self.used.kind == "bubblewrap":
            inner = _child_pid(info_read)
            if inner is not None and _parent_of(inner) == pid:  # never a pid the program wrote there
                with contextlib.suppress(OSError):
                    os.kill(inner, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)

    # ------------------------------------------------------------------ scoring
    def _score(self, job: Job, run: Finished, tests: list[CodeTest]) -> RewardResult:
        if run.limit is not None:
            return self._result(run.limit, tests, [], run.seconds, f"hit the {run.limit} limit")
        report = job.read(run.report)
        if report is None:
            signum = _signal_of(run.returncode, self.used.kind)
            if signum == signal.SIGXCPU:
                return self._result("cpu_time", tests, [], run.seconds, "hit the CPU time limit")
            if b"MemoryError" in run.stderr:
                return self._result("memory", tests, [], run.seconds, "hit the memory limit")
            tail = run.stderr.decode(errors="replace").strip().splitlines()[-1:] or [f"exit {run.returncode}"]
            return self._result("crashed", tests, [], run.seconds, f"ended before its tests ran: {tail[0][:200]}")
        load = report.get("load")
        if load is not None:
            name, text = (list(load) + ["", ""])[:2]
            outcome = LIMIT_ERRORS.get(str(name), "syntax_error" if name == "SyntaxError" else "error")
            return self._result(outcome, tests, [], run.seconds, f"{name}: {text}"[:300])
        reports = report["tests"]
        for entry in reports:
            name = str(entry[1]).split(":", 1)[0] if isinstance(entry, list) and entry and entry[0] == "error" else ""
            if name in LIMIT_ERRORS:
                return self._result(LIMIT_ERRORS[name], tests, [], run.seconds, str(entry[1])[:300])
        results = [passed(t, r) for t, r in zip(tests, reports)]
        outcome = "passed" if all(results) else "failed_tests"
        return self._result(outcome, tests, results, run.seconds, _first_failure(tests, results, reports))

    def _result(
        self, outcome: str, tests: list[CodeTest], results: list[bool], seconds: float, why: str
    ) -> RewardResult:
        n_passed = sum(results)
        if outcome in LIMIT_OUTCOMES or not tests:
            reward = 0.0
        elif self.scoring == "all":
            reward = float(n_passed == len(tests))
        else:
            reward = n_passed / len(tests)
        info = {"outcome": outcome, "passed": n_passed, "tests": len(tests), "seconds": round(seconds, 4)}
        return RewardResult(reward, info, feedback=None if outcome == "passed" else why)


async def _drain(stream: asyncio.StreamReader | None, buf: bytearray, budget: list[int], over: asyncio.Event) -> None:
    """Read ``stream`` into ``buf`` until EOF. Past the output budget (shared by stdout and
    stderr) keep what fits, set ``over`` (the caller kills the sandbox) and read on, dropping
    the rest: a pipe nobody reads would never report its end, nor the process its exit."""
    assert stream is not None
    while chunk := await stream.read(1 << 16):
        take = min(len(chunk), budget[0])
        buf += chunk[:take]
        budget[0] -= take
        if take < len(chunk):
            over.set()


def _child_pid(info_read: int) -> int | None:
    """bubblewrap's ``child-pid`` from its ``--info-fd`` (written right after it starts)."""
    import json

    os.set_blocking(info_read, False)
    try:
        data = os.read(info_read, 1 << 16)
    except OSError as exc:
        if exc.errno == errno.EAGAIN:
            return None
        raise
    with contextlib.suppress(ValueError, AttributeError):
        pid = json.loads(data).get("child-pid")
        return pid if isinstance(pid, int) and pid > 1 else None
    return None


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return int(f.read().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _signal_of(returncode: int | None, kind: str) -> int | None:
    """The signal that ended the program: negative return codes from Python, ``128 + n`` from
    bubblewrap (which exits with its child's status)."""
    if returncode is None:
        return None
    if returncode < 0:
        return -returncode
    return returncode - 128 if kind == "bubblewrap" and returncode > 128 else None


def _first_failure(tests: list[CodeTest], results: list[bool], reports: list[Any]) -> str:
    for test, ok, report in zip(tests, results, reports):
        if not ok:
            got = report[1] if isinstance(report, list) and len(report) == 2 else report
            return f"failed: {test.source} (got {str(got)[:120]})"
    return ""
