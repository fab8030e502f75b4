"""Escape attempts against the ``sandbox`` reward: each program tries to break out, is written
so that a *successful* escape would pass its test (score 1), and must score 0 with a counted
reason (``info["outcome"]``) while the host stays unaffected: no secret in any output, no file
written outside, this process and its parent alive, no process left, host memory intact.

They run under the isolation the machine has (bubblewrap; see docs/sandbox.md) and are skipped,
with the reason, on a machine that cannot isolate. Each takes well under the 3 s wall clock
limit but the two that must hit it.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sandbox_support import SHORT, call, leftover_processes, make_sandbox

from tempering.plugins.rewards.sandbox.job import Job
from tempering.plugins.rewards.sandbox.reward import Sandbox


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return make_sandbox()


@pytest.fixture(autouse=True)
def host_unaffected() -> Iterator[None]:
    """After every attempt: this process's parent alive, no sandbox process left (within 2 s)."""
    parent = os.getppid()
    yield
    os.kill(parent, 0)  # raises if the parent is gone
    deadline = time.monotonic() + 2.0
    while leftover_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftover_processes() == []


def mem_available() -> int:
    with open("/proc/meminfo", encoding="utf-8") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


def test_fork_bomb_hits_the_process_limit(sandbox: Sandbox) -> None:
    program = "import os\nwhile True:\n    os.fork()\ndef forked():\n    return True"
    t0 = time.monotonic()
    result = call(sandbox, program, ["assert forked() == True"])
    assert result.reward == 0.0
    assert result.info["outcome"] in ("process_limit", "cpu_time", "timeout"), result
    assert time.monotonic() - t0 < SHORT["wall_seconds"] + 5


def test_ten_gigabyte_allocation_hits_the_memory_limit(sandbox: Sandbox) -> None:
    before, rss = mem_available(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = call(sandbox, "x = bytearray(10 * 1024**3)", ["assert len(x) == 10 * 1024**3"])
    assert (result.reward, result.info["outcome"]) == (0.0, "memory"), result
    assert mem_available() > before - (512 << 20)  # the host's memory is not taken
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 << 10  # KiB: this process did not grow


def test_infinite_loop_is_killed_within_the_wall_clock_limit(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    result = call(sandbox, "def f():\n    while True:\n        pass\n", ["assert f() == 1"])
    assert result.reward == 0.0
    assert result.info["outcome"] in ("cpu_time", "timeout"), result
    assert time.monotonic() - t0 < SHORT["wall_seconds"] + 5


def test_sleeping_program_is_killed_at_the_wall_clock_limit(sandbox: Sandbox) -> None:
    """No CPU used, so only the host's wall clock ends it (with its whole pid namespace)."""
    t0 = time.monotonic()
    result = call(
        sandbox, "import os, time\nif os.fork() == 0:\n    time.sleep(600)\ntime.sleep(600)", ["assert 1 == 1"]
    )
    assert (result.reward, result.info["outcome"]) == (0.0, "timeout"), result
    assert SHORT["wall_seconds"] <= time.monotonic() - t0 < SHORT["wall_seconds"] + 5


def test_write_outside_the_sandbox_reaches_nothing(sandbox: Sandbox, tmp_path: Path) -> None:
    run_folder = tmp_path / "runs" / "demo"
    run_folder.mkdir(parents=True)
    host_tmp = Path("/tmp") / f"tempering-escape-{secrets.token_hex(6)}.txt"
    targets = [run_folder / "pwned.txt", host_tmp, Path.cwd() / "pwned.txt", Path("/usr/pwned.txt")]
    program = (
        f"targets = {[str(t) for t in targets]!r}\n"
        "wrote = []\n"
        "for t in targets:\n"
        "    try:\n"
        "        with open(t, 'w') as f:\n"
        "            f.write('pwned')\n"
        "        wrote.append(t)\n"
        "    except OSError:\n"
        "        pass\n"
        "def in_run_folder():\n"
        "    return targets[0] in wrote\n"
    )
    result = call(sandbox, program, ["assert in_run_folder() == True"])
    assert (result.reward, result.info["outcome"]) == (0.0, "failed_tests"), result
    for target in targets:
        assert not target.exists(), f"{target} was written from inside the sandbox"


@pytest.fixture
def home() -> Iterator[Path]:
    """A home folder any host user could read (pytest's tmp_path is private to this user): only
    the sandbox's own filesystem keeps its files out."""
    folder = Path(tempfile.mkdtemp(prefix="tempering-home-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder)


def test_secret_file_is_not_readable(sandbox: Sandbox, home: Path) -> None:
    secret = f"-----BEGIN OPENSSH PRIVATE KEY----- {secrets.token_hex(16)}"
    key = home / ".ssh" / "id_ed25519"
    key.parent.mkdir(mode=0o755)
    key.write_text(secret)
    key.chmod(0o644)
    paths = [str(key), os.path.expanduser("~/.ssh/id_rsa"), "/etc/shadow", "/etc/passwd"]
    program = (
        f"paths = {paths!r}\n"
        "def leak():\n"
        "    for p in paths:\n"
        "        try:\n"
        "            text = open(p).read()\n"
        "            print(text)\n"
        "            return text\n"
        "        except OSError:\n"
        "            pass\n"
        "    return None\n"
    )
    result = call(sandbox, program, [f"assert leak() == {secret!r}"])
    assert (result.reward, result.info["outcome"]) == (0.0, "failed_tests"), result
    assert result.feedback is not None and result.feedback.endswith(
        "(got None)"
    )  # the test's text holds the secret, not the output
    with Job(program + "leak()\n", ["leak()"], sandbox.limits) as job:  # what the sandbox printed
        import asyncio

        finished = asyncio.run(sandbox.run(job))
    assert secret.encode() not in finished.stdout + finished.stderr
    assert b"root:" not in finished.stdout  # not even the host's /etc/passwd


def test_network_is_unreachable(sandbox: Sandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port, connections, stop = server.getsockname()[1], [], threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            connections.append(conn)
            conn.sendall(b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    program = (
        "import socket\n"
        "def reply():\n"
        f"    with socket.create_connection(('127.0.0.1', {port}), timeout=1) as s:\n"
        "        return s.recv(2)\n"
    )
    try:
        result = call(sandbox, program, ["assert reply() == b'ok'"])
        assert socket.create_connection(("127.0.0.1", port), timeout=1).recv(2) == b"ok"  # the server works
    finally:
        stop.set()
        thread.join()
        server.close()
    assert (result.reward, result.info["outcome"]) == (0.0, "failed_tests"), result
    assert "OSError" in (result.feedback or "") or "Error" in (result.feedback or ""), result.feedback
    assert len(connections) == 1  # only the test's own check reached it


def test_killing_the_parent_reaches_nothing_outside(sandbox: Sandbox) -> None:
    program = (
        "import os, signal\n"
        f"host = [{os.getpid()}, {os.getppid()}]\n"
        "for target in [os.getppid(), *host]:\n"
        "    try:\n"
        "        os.kill(target, signal.SIGKILL)\n"
        "    except OSError:\n"
        "        pass\n"
        "try:\n"
        "    os.kill(-1, signal.SIGKILL)\n"
        "except OSError:\n"
        "    pass\n"
        "def parent_gone():\n"
        "    return not os.path.exists(f'/proc/{os.getppid()}')\n"
    )
    result = call(sandbox, program, ["assert parent_gone() == True"])
    assert result.reward == 0.0
    assert result.info["outcome"] in ("failed_tests", "crashed"), result
    os.kill(os.getpid(), 0)  # this process is alive (the fixture checks its parent)


def test_huge_stdout_hits_the_output_limit(sandbox: Sandbox) -> None:
    t0 = time.monotonic()
    result = call(sandbox, "while True:\n    print('x' * 100_000)", ["assert 1 == 1"])
    assert (result.reward, result.info["outcome"]) == (0.0, "output_limit"), result
    assert time.monotonic() - t0 < SHORT["wall_seconds"]  # killed at the limit, not at the clock


def test_output_kept_is_bounded(sandbox: Sandbox) -> None:
    with Job("import sys\nwhile True:\n    sys.stderr.write('y' * 100_000)", ["1"], sandbox.limits) as job:
        import asyncio

        finished = asyncio.run(sandbox.run(job))
    assert finished.limit == "output_limit"
    assert len(finished.stdout) + len(finished.stderr) <= SHORT["max_output_kb"] << 10


def test_equal_to_everything_object_does_not_pass(sandbox: Sandbox) -> None:
    """The expected value never enters the sandbox: an object whose ``__eq__`` says yes to
    everything is compared on the host by its repr, and fails."""
    program = (
        "class Anything:\n"
        "    def __eq__(self, other):\n"
        "        return True\n"
        "    def __repr__(self):\n"
        "        return 'Anything()'\n"
        "def add(a, b):\n"
        "    return Anything()\n"
    )
    result = call(sandbox, program, ["assert add(2, 3) == 5", "assert add(1, 1) == 2"])
    assert (result.reward, result.info["outcome"]) == (0.0, "failed_tests"), result


def test_forged_report_cannot_pass_without_the_answers(sandbox: Sandbox) -> None:
    """A program that writes the harness's report line itself, on the report pipe it inherits
    (the marker is in its job file, the pipe's number in the harness's argv), and exits first
    still has to know the expected values."""
    program = (
        "import json, os, sys\n"
        "job = json.load(open('/sandbox/job.json'))\n"
        "line = job['marker'] + json.dumps({'load': None, 'tests': [['ok', 'True'] for _ in job['tests']]})\n"
        "os.write(int(sys.argv[3]), ('\\n' + line + '\\n').encode())\n"
        "os._exit(0)\n"
    )
    result = call(sandbox, program, ["assert add(2, 3) == 5"])
    assert (result.reward, result.info["outcome"]) == (0.0, "failed_tests"), result  # the forged report was read


def test_daemonized_child_does_not_outlive_the_call(sandbox: Sandbox) -> None:
    """A child that leaves the session and closes its output is still in the sandbox's pid
    namespace: it dies with the call (the autouse check finds no process left)."""
    program = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.close(1)\n"
        "    os.close(2)\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "def f():\n"
        "    return 1\n"
    )
    t0 = time.monotonic()
    result = call(sandbox, program, ["assert f() == 2"])
    assert (result.reward, result.info["outcome"]) == (0.0, "failed_tests"), result
    assert time.monotonic() - t0 < SHORT["wall_seconds"]  # over when the program is, not at the clock


def test_a_cancelled_call_kills_its_sandbox(sandbox: Sandbox) -> None:
    """A caller that gives up first (the reward runner's own ``reward_timeout``, shorter than
    ``wall_seconds``) cancels the call: the sandbox is killed then, not left to its clock."""
    import asyncio

    async def give_up() -> None:
        await asyncio.wait_for(sandbox("import time\ntime.sleep(60)", {"tests": ["assert 1 == 1"]}), 0.5)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(give_up())
