"""One call's files: a private host folder holding the harness, the program and the job (the
test expressions, the limits, the markers), and the harness's report read back from its pipe.

The folder is readable by the sandbox user (an unprivileged uid may have to read it) and holds
nothing secret: the model's program and the test *expressions*; the expected values stay in
the host's memory. It is removed when the call ends.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any

from tempering.plugins.rewards.sandbox import harness


@dataclass(frozen=True)
class Limits:
    """What the harness sets inside the sandbox (see :func:`.harness.set_limits`)."""

    cpu_seconds: int
    memory_bytes: int
    max_processes: int
    file_bytes: int


class Job:
    """``with Job(program, expressions, limits) as job:`` -- ``job.folder`` holds the files;
    :meth:`read` finds the harness's report in what the sandbox printed, :meth:`started` whether
    the harness came up at all (its first line on stderr, written before the program runs)."""

    def __init__(self, program: str, expressions: list[str], limits: Limits) -> None:
        self.program, self.expressions, self.limits = program, expressions, limits
        self.marker = f"@@tempering-sandbox-{secrets.token_hex(8)}@@"
        self.started_line = f"@@tempering-sandbox-started-{secrets.token_hex(8)}@@"
        self.folder = ""

    def __enter__(self) -> Job:
        self.folder = tempfile.mkdtemp(prefix="tempering-sandbox-")
        os.chmod(self.folder, 0o755)
        job = {"limits": asdict(self.limits), "tests": self.expressions, "marker": self.marker}
        job["started"] = self.started_line
        shutil.copyfile(harness.__file__, os.path.join(self.folder, "harness.py"))
        for name, text in (("job.json", json.dumps(job)), ("program.py", self.program)):
            with open(os.path.join(self.folder, name), "w", encoding="utf-8") as f:
                f.write(text)
        for name in ("harness.py", "job.json", "program.py"):
            os.chmod(os.path.join(self.folder, name), 0o644)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def report_bytes(self) -> int:
        """The most the report pipe takes: the report, whose values are each cut at
        :data:`.harness.REPR_CAP` characters (JSON may escape each into 6 bytes)."""
        return 1024 + len(self.marker) + len(self.expressions) * (6 * harness.REPR_CAP + 64)

    def started(self, stderr: bytes) -> bool:
        return self.started_line.encode() in stderr

    def read(self, written: bytes) -> dict[str, Any] | None:
        """The harness's report in what was ``written`` on its pipe: the JSON after the last
        marker, with one test entry per expression; ``None`` when there is none or it is
        malformed (the program ended the process first, or wrote a marker of its own that does
        not parse: the pipe is inherited, and the marker is in the job file it can read)."""
        at = written.rfind(self.marker.encode())
        if at < 0:
            return None
        line = written[at + len(self.marker) :].split(b"\n", 1)[0]
        try:
            report = json.loads(line)
        except ValueError:
            return None
        ok = isinstance(report, dict) and isinstance(report.get("tests"), list)
        if not ok or (report.get("load") is None and len(report["tests"]) != len(self.expressions)):
            return None
        return report
