"""The ``sandbox`` reward's scoring, its keys and errors, and its calls running side by side.
(The escape attempts are in test_sandbox_escapes.py.)"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import pytest
from sandbox_support import SHORT, call, make_sandbox

from tempering.errors import ConfigError
from tempering.plugins.rewards.sandbox import isolation as isolation_module
from tempering.plugins.rewards.sandbox.program import extract_program, parse_test, parse_tests, passed
from tempering.plugins.rewards.sandbox.reward import Sandbox
from tempering.registry import get_registry
from tempering.rollouts.scoring import RewardRunner
from tempering.runs.outcomes import outcome_metrics
from tempering.types import Completion, Sample

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return make_sandbox()


# ----------------------------------------------------------------------------- the host's side
def test_extract_program_takes_the_python_block() -> None:
    text = "Here:\n```python\ndef f():\n    return 1\n```\nUsage:\n```\nf()\n```"
    assert extract_program(text) == "def f():\n    return 1\n"
    assert extract_program("```\nx = 1\n```") == "x = 1\n"
    assert extract_program("```python\ndef f(): return 2") == "def f(): return 2"  # cut at max_tokens
    assert extract_program("def f(): return 3") == "def f(): return 3"  # auto: the whole completion
    assert extract_program("def f(): return 3", "fenced") is None
    assert extract_program("```python\nx\n```", "raw") == "```python\nx\n```"


def test_parse_test_keeps_the_expected_value_on_the_host() -> None:
    test = parse_test("assert add(2, 3) == [5, {'a': (1,)}]")
    assert (test.expression, test.expected) == ("add(2, 3)", [5, {"a": (1,)}])
    assert parse_test("assert 'x' == up('X')").expression == "up('X')"
    other = parse_test("assert is_even(4)")
    assert (other.expression, other.expected) == ("bool(is_even(4))", True)
    assert parse_test("assert f(x) == sorted(x)").expression == "bool(f(x) == sorted(x))"


def test_passed_compares_literals() -> None:
    test = parse_test("assert f() == (1, 2)")
    assert passed(test, ["ok", "(1, 2)"]) and not passed(test, ["ok", "[1, 2]"])
    assert not passed(test, ["ok", "Anything()"]) and not passed(test, ["error", "ZeroDivisionError: x"])
    assert not passed(test, ["ok", "(" * 5000 + ")" * 5000])  # deep nesting: not read, failed
    assert passed(parse_test("assert f() == 0.5"), ["ok", "0.5"])


def test_bad_tests_get_one_line() -> None:
    with pytest.raises(ValueError, match=r"^test 'add\(1\)' is not one assert statement \(write e\.g\."):
        parse_test("add(1)")
    with pytest.raises(ValueError, match=r"^the example's 'tests' must be a non-empty list of assert strings"):
        parse_tests([], "tests")
    assert [t.expression for t in parse_tests("assert f() == 1\n\nassert g() == 2\n", "tests")] == ["f()", "g()"]


# ----------------------------------------------------------------------------- scoring
def test_correct_program_passes(sandbox: Sandbox) -> None:
    result = call(sandbox, "def add(a, b):\n    return a + b", ADD_TESTS)
    assert (result.reward, result.info["outcome"], result.info["passed"]) == (1.0, "passed", 3)
    assert result.feedback is None


def test_wrong_program_scores_its_share(sandbox: Sandbox) -> None:
    result = call(sandbox, "def add(a, b):\n    return a + b + (a == 0)", ADD_TESTS)
    assert result.reward == pytest.approx(2 / 3)
    assert result.info["outcome"] == "failed_tests"
    assert result.feedback == "failed: assert add(0, 0) == 0 (got 1)"
    all_or_nothing = make_sandbox(scoring="all")
    assert call(all_or_nothing, "def add(a, b):\n    return a + b + (a == 0)", ADD_TESTS).reward == 0.0


@pytest.mark.parametrize(
    ("program", "outcome"),
    [
        ("def add(a, b)\n    return a + b", "syntax_error"),
        ("raise RuntimeError('boom')\ndef add(a, b):\n    return a + b", "error"),
        ("import sys\nsys.exit(0)", "error"),
        ("def plus(a, b):\n    return a + b", "failed_tests"),  # NameError in every test
        ("import os\nos._exit(3)", "crashed"),
    ],
)
def test_broken_programs_score_zero(sandbox: Sandbox, program: str, outcome: str) -> None:
    result = call(sandbox, program, ADD_TESTS)
    assert (result.reward, result.info["outcome"]) == (0.0, outcome), result


def test_no_code_block(sandbox: Sandbox) -> None:
    import asyncio

    fenced = make_sandbox(extract="fenced")
    result = asyncio.run(fenced("I would add them.", {"tests": ADD_TESTS}))
    assert (result.reward, result.info["outcome"]) == (0.0, "no_code")


# ----------------------------------------------------------------------------- running
def samples(texts: list[str]) -> list[Sample]:
    return [Sample(example={"tests": ADD_TESTS}, completion=Completion([], [], [], text=t)) for t in texts]


def test_calls_run_side_by_side_and_outcomes_are_counted() -> None:
    """Two programs that sleep past the wall clock and two correct ones, four workers: the batch
    takes one wall-clock limit, not two, and every outcome is counted."""
    sandbox = make_sandbox(workers=4)
    batch = samples(["import time\ntime.sleep(60)"] * 2 + ["def add(a, b):\n    return a + b"] * 2)
    t0 = time.monotonic()
    stats = RewardRunner(sandbox).score(batch)
    assert time.monotonic() - t0 < 2 * SHORT["wall_seconds"]
    assert (stats.scored, stats.failed) == (4, 0)
    assert [s.reward for s in batch] == [0.0, 0.0, 1.0, 1.0]
    assert outcome_metrics(batch) == {"outcome/passed": 2.0, "outcome/timeout": 2.0}


def test_a_sandbox_that_does_not_start_is_a_counted_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = make_sandbox()
    monkeypatch.setattr(sandbox, "used", dataclasses.replace(sandbox.used, bwrap="/bin/false"))  # exits 1 at once
    batch = samples(["def add(a, b):\n    return a + b"])
    stats = RewardRunner(sandbox).score(batch)
    assert (stats.scored, stats.failed) == (0, 1)
    assert batch[0].reward_info["failure"] == "raised:SandboxError"
    assert batch[0].error is not None and batch[0].error.startswith("SandboxError: the sandbox did not start (")


def test_missing_tests_key_is_a_counted_failure(sandbox: Sandbox) -> None:
    batch = [Sample(example={"prompt": "x"}, completion=Completion([], [], [], text="x = 1"))]
    RewardRunner(sandbox).score(batch)
    assert batch[0].failed and batch[0].reward_info["failure"] == "raised:KeyError"
    assert "the example has no 'tests' key (keys: ['prompt']); set reward.tests_key" in (batch[0].error or "")


def test_rlimits_isolation_runs_and_kills() -> None:
    weak = make_sandbox(isolation="rlimits")
    assert weak.used.kind == "rlimits" and "weaker" in weak.used.describe()
    assert call(weak, "def add(a, b):\n    return a + b", ADD_TESTS).reward == 1.0
    t0 = time.monotonic()
    result = call(weak, "import time\ntime.sleep(60)", ADD_TESTS)
    assert (result.reward, result.info["outcome"]) == (0.0, "timeout")
    assert time.monotonic() - t0 < SHORT["wall_seconds"] + 5


# ----------------------------------------------------------------------------- keys
def test_registered_and_built_by_name(sandbox: Sandbox) -> None:
    built = get_registry().build("reward", {"name": "sandbox", "cpu_seconds": 1}, "stages[0].reward")
    assert isinstance(built, Sandbox) and built.used == sandbox.used


@pytest.mark.parametrize(
    ("keys", "line"),
    [
        ({"scoring": "fractoin"}, "stages[0].reward.scoring: use one of fraction, all. Did you mean 'fraction'?"),
        ({"cpu_seconds": 0}, "stages[0].reward.cpu_seconds: must be a number > 0, got 0"),
        (
            {"memory_mb": 16},
            "stages[0].reward.memory_mb: must be at least 64 (the interpreter alone needs ~20 MB), got 16",
        ),
        ({"uid": 0}, "stages[0].reward.uid: must be an unprivileged host uid > 0 (e.g. 65534, nobody), got 0"),
        ({"python": "/nope/python"}, "stages[0].reward.python: /nope/python is not an executable interpreter; "),
    ],
)
def test_bad_keys_get_one_line(keys: dict, line: str) -> None:
    with pytest.raises(ConfigError) as caught:
        get_registry().build("reward", {"name": "sandbox", **keys}, "stages[0].reward")
    assert str(caught.value).startswith(line) and "\n" not in str(caught.value)


def refusal(monkeypatch: pytest.MonkeyPatch, bwrap: str | None) -> str:
    """The one-line error building a default sandbox reward gives when ``shutil.which`` finds
    ``bwrap`` (None: not installed); the isolation probe's cache is cleared around it."""
    monkeypatch.setattr(isolation_module.shutil, "which", lambda name: bwrap)
    isolation_module.detect.cache_clear()
    try:
        with pytest.raises(ConfigError) as caught:
            get_registry().build("reward", {"name": "sandbox"}, "stages[0].reward")
    finally:
        isolation_module.detect.cache_clear()
    return str(caught.value)


def test_no_isolation_tool_is_refused_naming_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    text = refusal(monkeypatch, None)
    assert text.startswith("stages[0].reward.isolation: bubblewrap (bwrap) is not installed; install bubblewrap")
    assert "set isolation: rlimits to accept weaker isolation" in text and "\n" not in text


def test_an_older_bubblewrap_runs_without_its_newer_options(sandbox: Sandbox) -> None:
    """bwrap before 0.8 has no --disable-userns (Ubuntu 22.04: 0.6): it is left out, and said."""
    old = dataclasses.replace(sandbox.used, options=frozenset({"--size"}))
    argv = old.argv("/tmp/job", 1 << 20, 3)
    assert "--disable-userns" not in argv and argv[argv.index("--size") + 1] == str(1 << 20)
    assert old.describe().endswith("; no --disable-userns (bwrap too old)")
    assert "--disable-userns" in sandbox.used.argv("/tmp/job", 1 << 20, 3)


def test_no_user_namespaces_is_refused_with_bwraps_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bwrap that cannot create its namespaces (as on a kernel without unprivileged user
    namespaces) fails the probe: one line with bwrap's own reason and the key to accept less."""
    folder = tempfile.mkdtemp(prefix="tempering-fake-bwrap-")  # readable by the sandbox's uid
    fake = os.path.join(folder, "bwrap")
    with open(fake, "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    os.chmod(folder, 0o755)
    os.chmod(fake, 0o755)
    try:
        text = refusal(monkeypatch, fake)
    finally:
        shutil.rmtree(folder)
    assert text.startswith(
        "stages[0].reward.isolation: bubblewrap could not run a test program: "
        "bwrap: No permissions to creating new namespace; install bubblewrap"
    )
    assert "set isolation: rlimits" in text and "\n" not in text


def test_large_right_values_are_not_an_output_flood(sandbox: Sandbox) -> None:
    """The report of four 9000-character values (36 KB, over a 16 KB output limit) is the
    harness's, not the program's output: the program passes."""
    small = make_sandbox(max_output_kb=16)
    tests = [f"assert block({i}) == {'x' * 9000!r}" for i in range(4)]
    result = call(small, "def block(i):\n    return 'x' * 9000", tests)
    assert (result.reward, result.info["outcome"]) == (1.0, "passed"), result
    assert (
        call(small, "print('y' * 20_000)\ndef block(i):\n    return 'x' * 9000", tests).info["outcome"]
        == "output_limit"
    )
