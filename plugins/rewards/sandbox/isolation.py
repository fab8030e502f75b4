"""Which isolation the sandbox uses, found out once per process, and the command line that
runs the harness under it.

``bubblewrap`` (Debian's ``bwrap``, the tool Flatpak sandboxes apps with): new user, pid,
network, mount, IPC, UTS and cgroup namespaces, no capabilities, no nested user namespaces, a
fresh session (no terminal injection), killed with its parent; a filesystem of its own: the
host's ``/usr`` read-only, a fresh ``/proc`` and ``/dev``, a size-limited ``/tmp`` (tmpfs) and
the program in a read-only ``/sandbox`` -- nothing else of the host (no home, no run folder,
no ``/etc``). Run by root, it is started as ``uid`` (65534, nobody), so the program's processes
belong to an unprivileged host user; run by anyone else, as that user.

``rlimits`` is the weaker fallback, taken only when asked for: the harness's resource limits,
a process group of its own that is killed as a whole, an empty working folder and, run by root,
the unprivileged ``uid``; but the program sees the host's filesystem (as that user) and network.

The probe runs the real harness once under the chosen isolation (a one-line program), so what
it reports is what a call will get: a bubblewrap that cannot create namespaces, an interpreter
the sandbox user cannot read, are found here, not at the first sample.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

ISOLATIONS = ("auto", "bubblewrap", "rlimits")
#: Where the program, its tests and the harness appear inside a bubblewrap sandbox.
INSIDE = "/sandbox"
#: Top-level folders the interpreter may need besides ``/usr``: links into it on merged-/usr
#: systems (Debian 12), else bound read-only when they exist.
SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib64", "/lib32")
#: bubblewrap options used when this bwrap has them: no user namespaces inside the sandbox
#: (less kernel surface), a size for its /tmp.
OPTIONAL = ("--disable-userns", "--size")
#: Environment of the sandboxed program (nothing of the host's is passed on).
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}


class IsolationUnavailable(RuntimeError):
    """The isolation asked for cannot run here; the message says why in one line."""


@dataclass(frozen=True)
class Isolation:
    """How calls run: ``kind`` (``bubblewrap`` or ``rlimits``), the host ``uid`` they run as
    (``None``: this process's own), the ``python`` inside, ``bwrap``'s path and the optional
    options this bwrap has (``--disable-userns`` from 0.8, ``--size`` from 0.5: an older one
    runs without them, and :meth:`describe` says so)."""

    kind: str
    uid: int | None
    python: str
    bwrap: str | None = None
    options: frozenset[str] = frozenset()

    def describe(self) -> str:
        """One line: what isolates a program here."""
        who = f"host uid {self.uid}" if self.uid is not None else f"this process's uid {os.getuid()} (not root)"
        if self.kind == "bubblewrap":
            missing = [f"no {o} (bwrap too old)" for o in OPTIONAL if o not in self.options]
            return (
                f"sandbox: bubblewrap ({self.bwrap}): user, pid, net, mount, ipc, uts namespaces, no capabilities, "
                f"private /tmp, read-only /usr only, {who}; rlimits on CPU, memory, processes, files"
                + "".join(f"; {m}" for m in missing)
            )
        return (
            f"sandbox: rlimits only (weaker: the program sees the host's files as {who} and its network); "
            "rlimits on CPU, memory, processes, files; its process group is killed at the wall-clock limit"
        )

    def argv(self, folder: str, tmp_bytes: int, report_fd: int) -> list[str]:
        """The command running the harness on the job in ``folder`` (host path), reporting on
        the inherited file descriptor ``report_fd``, with a private ``/tmp`` of ``tmp_bytes``
        under bubblewrap."""
        inside = INSIDE if self.kind == "bubblewrap" else folder
        run = [self.python, "-I", "-S", "-B", f"{inside}/harness.py", f"{inside}/job.json", f"{inside}/program.py"]
        run += [str(report_fd), folder]  # the folder is unused inside: it names the call in the host's process list
        if self.kind != "bubblewrap":
            return run
        assert self.bwrap is not None
        args = [self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent"]
        args += ["--disable-userns"] if "--disable-userns" in self.options else []
        args += ["--new-session", "--cap-drop", "ALL", "--clearenv", "--uid", "65534", "--gid", "65534"]
        args += ["--hostname", "sandbox", "--ro-bind", "/usr", "/usr"]
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(self.python)))
        if not prefix.startswith("/usr"):  # an interpreter installed elsewhere (/opt/python): its tree only
            args += ["--ro-bind", prefix, prefix]
        for name, value in ENV.items():
            args += ["--setenv", name, value]
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--size", str(tmp_bytes)] if "--size" in self.options else []
        args += ["--tmpfs", "/tmp"]
        return args + ["--ro-bind", folder, INSIDE, "--chdir", "/tmp", "--", *run]

    def popen_kwargs(self) -> dict[str, Any]:
        """What the host process needs to start a call: a session of its own, and as root the
        unprivileged uid (``subprocess``'s own ``user``/``group``: no ``preexec_fn``, which is
        unsafe in a process with threads)."""
        kwargs: dict[str, Any] = {"start_new_session": True, "env": dict(ENV)}
        if self.uid is not None:
            kwargs.update(user=self.uid, group=self.uid, extra_groups=[])
        return kwargs


def options_of(bwrap: str) -> frozenset[str]:
    """Which of :data:`OPTIONAL` ``bwrap --help`` lists."""
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(o for o in OPTIONAL if o in text.split())


def default_python() -> str:
    """The interpreter to run programs with: the system's ``/usr/bin/python3`` when there is one
    (readable by an unprivileged user, unlike an interpreter under ``/root``), else this one."""
    return "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else os.path.realpath(sys.executable)


@functools.cache
def detect(isolation: str, uid: int, python: str) -> Isolation:
    """The :class:`Isolation` for the ``isolation`` key (``auto`` = bubblewrap), probed once per
    process; :class:`IsolationUnavailable` with the reason when it cannot run."""
    host_uid = uid if os.getuid() == 0 else None
    if isolation == "rlimits":
        chosen = Isolation("rlimits", host_uid, python)
    else:
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise IsolationUnavailable("bubblewrap (bwrap) is not installed")
        chosen = Isolation("bubblewrap", host_uid, python, bwrap, options_of(bwrap))
    probe(chosen)
    return chosen


def probe(isolation: Isolation) -> None:
    """Run ``print(1)`` through the harness under ``isolation``; raise
    :class:`IsolationUnavailable` with the first line of what went wrong."""
    from tempering.plugins.rewards.sandbox.job import Job, Limits

    limits = Limits(cpu_seconds=5, memory_bytes=256 << 20, max_processes=8, file_bytes=1 << 20)
    with Job("print(1)", ["1 + 1"], limits) as job:
        report_read, report_write = os.pipe()
        try:
            done = subprocess.run(
                isolation.argv(job.folder, 1 << 20, report_write),
                capture_output=True,
                timeout=30,
                stdin=subprocess.DEVNULL,
                pass_fds=(report_write,),
                **isolation.popen_kwargs(),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise IsolationUnavailable(f"{isolation.kind} did not start: {exc}") from None
        finally:
            os.close(report_write)
        with os.fdopen(report_read, "rb") as f:
            report = job.read(f.read())
        if done.returncode != 0 or report is None:
            why = (done.stderr.decode(errors="replace").strip().splitlines() or [f"exit {done.returncode}"])[0]
            raise IsolationUnavailable(f"{isolation.kind} could not run a test program: {why}")
