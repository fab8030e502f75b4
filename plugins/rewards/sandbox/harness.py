"""The program that runs *inside* the sandbox: it sets the resource limits, runs the model's
program and evaluates each test expression, then writes one report line on the file descriptor
the host gave it (its own pipe: the program's stdout and stderr are the program's, limited by
``max_output_kb``; the report has a budget of its own).

It is copied into the sandbox's read-only ``/sandbox`` folder and run by a bare interpreter
(``python3 -I -S``), so it imports nothing but the standard library. It decides nothing: it
reports each expression's ``repr`` (or the exception it raised), and the host compares them
with the expected values, which never enter the sandbox -- a program that patches ``repr``,
``json`` or the output cannot turn a wrong answer into a right one without knowing the answer.

The limits are set here, after the sandbox's namespaces exist and before the untrusted code
runs: ``RLIMIT_NPROC`` set inside a user namespace counts the processes of that namespace only
(the kernel keeps one count per namespace and user), so a fork bomb meets its limit without
the host's other processes of the same user counting against it.
"""

from __future__ import annotations

import json
import os
import resource
import sys

#: The most characters of one test value's ``repr`` that are reported (the host treats a longer
#: one as a failed test).
REPR_CAP = 10_000


def set_limits(limits: dict[str, int]) -> None:
    """CPU seconds (SIGXCPU at the soft limit, SIGKILL a second later), address space, processes
    and threads, the size of any file written, open files, and no core dumps."""
    cpu = limits["cpu_seconds"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_bytes"], limits["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_processes"], limits["max_processes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_bytes"], limits["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main(job_path: str, program_path: str, report_fd: int) -> None:
    write, dumps, text = os.write, json.dumps, repr  # kept before the program can replace them
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    with open(program_path, encoding="utf-8") as f:
        source = f.read()
    write(2, (job["started"] + "\n").encode())  # the host's sign that the sandbox itself came up
    set_limits(job["limits"])
    result: dict[str, object] = {"load": None, "tests": []}
    namespace: dict[str, object] = {"__name__": "solution"}
    try:
        exec(compile(source, "solution.py", "exec"), namespace)
    except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are the program's too
        result["load"] = [type(exc).__name__, str(exc)[:300]]
    tests: list[list[str]] = []
    if result["load"] is None:
        for expression in job["tests"]:
            try:
                value = eval(expression, namespace)
                tests.append(["ok", text(value)[: REPR_CAP + 1]])
            except BaseException as exc:  # noqa: BLE001
                tests.append(["error", f"{type(exc).__name__}: {str(exc)[:200]}"])
    result["tests"] = tests
    try:
        sys.stdout.flush()
    except BaseException:  # noqa: BLE001 - the program may have closed or replaced stdout
        pass
    write(report_fd, ("\n" + job["marker"] + dumps(result) + "\n").encode())
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
