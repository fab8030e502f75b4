"""Under CI=1 a skipped test fails the run unless it belongs to an extra run elsewhere or is
named in TEMPERING_CI_ALLOW_SKIPS (issue: a broken import or a missing dependency turned tests
into silent skips and CI still passed)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import unexpected_skip


def report(nodeid: str, *markers: str, skipped: bool = True) -> pytest.TestReport:
    outcome = "skipped" if skipped else "passed"
    longrepr = ("x.py", 1, "Skipped: tinker is not installed") if skipped else None
    return pytest.TestReport(
        nodeid, ("x.py", 1, "t"), {m: 1 for m in (nodeid.split("::")[-1], *markers)}, outcome, longrepr, "setup"
    )


def test_a_skip_under_ci_is_unexpected_unless_its_extra_runs_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "1")
    monkeypatch.delenv("TEMPERING_CI_ALLOW_SKIPS", raising=False)
    assert (
        unexpected_skip(report("tests/test_a.py::test_x"))
        == "tests/test_a.py::test_x: Skipped: tinker is not installed"
    )
    assert unexpected_skip(report("tests/test_a.py::test_x", "vllm")) is None
    assert unexpected_skip(report("tests/test_a.py::test_x", "extras")) is None
    assert unexpected_skip(report("tests/test_a.py::test_x", skipped=False)) is None
    monkeypatch.setenv("TEMPERING_CI_ALLOW_SKIPS", "other, test_x")
    assert unexpected_skip(report("tests/test_a.py::test_x")) is None
    monkeypatch.delenv("CI")
    monkeypatch.delenv("TEMPERING_CI_ALLOW_SKIPS")
    assert unexpected_skip(report("tests/test_a.py::test_x")) is None  # a developer's run: skips are fine


def test_the_guard_fails_a_real_pytest_run(tmp_path: Path) -> None:
    """The hooks as pytest runs them: a skip fails the session under CI=1 and not without it."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(
        (Path(__file__).parent / "conftest.py").read_text(encoding="utf-8"), encoding="utf-8"
    )
    (tests / "test_skips.py").write_text(
        textwrap.dedent("""
        import pytest

        def test_runs():
            pass

        def test_skipped():
            pytest.skip("a dependency is missing")
    """),
        encoding="utf-8",
    )

    def run(ci: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "CI": ci, "TEMPERING_PROGRESS": "0"}
        return subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tests)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    failing, fine = run("1"), run("")
    assert failing.returncode == 1, failing.stdout
    assert "test_skips.py::test_skipped: Skipped: a dependency is missing" in failing.stdout
    assert fine.returncode == 0, fine.stdout
