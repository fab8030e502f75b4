"""``tempering eval``: a checkpoint (or an exported model) evaluated through the components training
uses reproduces the run's own held-out numbers; pass@k is the unbiased estimator; forecasts get
Brier, Brier skill, ECE and a reliability diagram; an inspect_ai task evaluates a run through
the bridge (where inspect_ai is installed: the ``extras`` venv of .ci/run)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from observability_run import RL_STEPS, SFT_STEPS, small_run

from tempering.apps import cli
from tempering.apps.checkpoint_eval import EvalSpec, evaluate_policy, ks_for, pass_at_k, write_report
from tempering.runs.calibration import calibration
from tempering.testing import FakeBackend


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# --------------------------------------------------------------------------- the numbers
def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one() -> None:
    n = 5
    for c in range(n + 1):
        outcomes = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(outcomes, k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(d) for d in draws) / len(draws)), (c, k)
    assert ks_for(8) == [1, 2, 4, 8] and ks_for(6) == [1, 2, 4, 6] and ks_for(1) == [1]
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


FORECASTS, OUTCOMES = [0.95, 0.75, 0.75, 0.25, 0.05], [1.0, 1.0, 0.0, 0.0, 0.0]


def test_calibration_numbers_by_hand(tmp_path: Path) -> None:
    cal = calibration(FORECASTS, OUTCOMES)
    assert cal.brier == pytest.approx((0.05**2 + 0.25**2 + 0.75**2 + 0.25**2 + 0.05**2) / 5)  # 0.1385
    assert cal.base_rate == pytest.approx(0.4) and cal.brier_ref == pytest.approx(0.24)  # always saying 40%
    assert cal.brier_skill == pytest.approx(1 - 0.1385 / 0.24)
    # bins 9, 7 (two forecasts of 75%, one came true), 2 and 0: 0.01 + 0.1 + 0.05 + 0.01
    assert cal.ece == pytest.approx(0.17)
    assert [(b.count, b.frequency) for b in cal.bins if b.count] == [(1, 0.0), (1, 0.0), (2, 0.5), (1, 1.0)]
    assert calibration([0.2, 0.9], [1.0, 1.0]).brier_skill is None  # one outcome only: no reference to beat
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        calibration([1.5], [1.0])


# --------------------------------------------------------------------------- through the sampler
def test_pass_at_k_and_forecasts_through_the_sampler_and_reward(tmp_path: Path) -> None:
    """FakeBackend answers each prompt with a known number of right samples (pass@k) and
    states known probabilities (calibration); the registered rewards score them."""
    right = {"a": 0, "b": 1, "c": 4}
    backend = FakeBackend(complete=lambda prompt, i: "7" if i < right[prompt[-1]] else "0")
    spec = EvalSpec(dataset=[{"prompt": p, "answer": "7"} for p in right], reward="exact_match", samples=4)
    report = evaluate_policy(backend, spec)
    m = report.metrics
    assert m["samples"] == 12 and m["reward/mean"] == pytest.approx(5 / 12)
    assert m["accuracy"] == m["pass@1"] == pytest.approx((0 + 0.25 + 1) / 3)
    assert m["pass@2"] == pytest.approx((0 + 0.5 + 1) / 3) and m["pass@4"] == pytest.approx(2 / 3)
    assert len(report.records) == 12 and {r["kind"] for r in report.records} == {"eval"}
    assert report.calibration is None and "brier" not in m

    said = {f"q{i}": f"{p:.2f}" for i, p in enumerate(FORECASTS)}
    forecaster = FakeBackend(complete=lambda prompt, i: said[prompt[-2:]])
    rows = [{"prompt": q, "outcome": y} for q, y in zip(said, OUTCOMES)]
    spec = EvalSpec(dataset=rows, reward="brier", max_tokens=8)
    report = evaluate_policy(forecaster, spec)
    expected = calibration(FORECASTS, OUTCOMES)
    assert report.metrics["brier"] == pytest.approx(expected.brier)
    assert report.metrics["brier_skill"] == pytest.approx(expected.brier_skill)
    assert report.metrics["ece"] == pytest.approx(expected.ece)
    assert report.metrics["reward/mean"] == pytest.approx(-expected.brier)  # the brier reward is its negation
    write_report(report, spec, {"model": "fake"}, str(tmp_path))
    assert (tmp_path / "reliability.png").stat().st_size > 5_000
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["metrics"]["ece"] == pytest.approx(expected.ece) and saved["spec"]["reward"] == "brier"
    assert len(lines(tmp_path / "rollouts.jsonl")) == 5

    # without a brier reward, --outcome-key reads the probability from the completion
    spec = EvalSpec(dataset=rows, reward=None, outcome_key="outcome", max_tokens=8)
    assert evaluate_policy(forecaster, spec).metrics["brier"] == pytest.approx(expected.brier)


# --------------------------------------------------------------------------- the command
def test_eval_of_a_run_reproduces_its_own_final_evaluation(tmp_path: Path) -> None:
    """No flags: the recipe's last held-out evaluation (8 calculator episodes, greedy) on the
    latest checkpoint gives the numbers the run logged after its last step, sample for sample."""
    run = Path(small_run())
    assert cli.main(["eval", str(run), "--out", str(tmp_path / "ev")]) == 0
    got = json.loads((tmp_path / "ev" / "eval.json").read_text())
    final = [r for r in lines(run / "metrics.jsonl") if r["stage"] == "rl" and "eval/accuracy" in r][-1]
    assert final["step"] == SFT_STEPS + RL_STEPS and got["source"]["global_step"] == final["step"]
    m = got["metrics"]
    assert m["samples"] == final["eval/n"] == 8
    assert m["reward/mean"] == pytest.approx(final["eval/reward"]) and m["accuracy"] == pytest.approx(
        final["eval/accuracy"]
    )
    assert m["env/tool_calls"] == final["eval/tool_calls"]
    logged = {
        r["group"]: r for r in lines(run / "rollouts.jsonl") if r["kind"] == "eval" and r["step"] == final["step"]
    }
    mine = {r["group"]: r for r in lines(tmp_path / "ev" / "rollouts.jsonl")}
    assert logged and all(mine[g]["messages"] == r["messages"] for g, r in logged.items())

    # the exported model, evaluated as a model folder on the same episodes: the same numbers
    assert cli.main(["export", str(run), "--to", str(tmp_path / "hf")]) == 0
    episodes = "{name: environment, environment: calculator, max_turns: 3, max_total_tokens: 96}"
    assert (
        cli.main(
            [
                "eval",
                str(tmp_path / "hf"),
                "--dataset",
                "{name: tool_use, split: test, size: 8}",
                "--sampler",
                episodes,
                "--max-tokens",
                "20",
                "--out",
                str(tmp_path / "ev2"),
            ]
        )
        == 0
    )
    again = json.loads((tmp_path / "ev2" / "eval.json").read_text())["metrics"]
    assert again["reward/mean"] == m["reward/mean"] and again["env/tool_calls"] == m["env/tool_calls"]
    assert [r["messages"] for r in lines(tmp_path / "ev2" / "rollouts.jsonl")] == [
        r["messages"] for r in lines(tmp_path / "ev" / "rollouts.jsonl")
    ]


def test_eval_errors_are_one_line_and_come_before_a_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    run = small_run()
    assert cli.main(["eval", run, "--dataset", "{name: arithmatic}"]) == 2
    assert "tempering: error: --dataset.name: unknown dataset 'arithmatic'. Did you mean 'arithmetic'?" in (
        capsys.readouterr().err
    )
    assert cli.main(["eval", run, "--reward", "{name: exact_match, answr_key: x}"]) == 2
    assert "--reward.answr_key: unknown key 'answr_key'. Did you mean 'answer_key'?" in capsys.readouterr().err
    assert cli.main(["eval", run, "--samples", "0"]) == 2
    assert "tempering: error: --samples: must be >= 1, got 0" in capsys.readouterr().err
    assert cli.main(["eval", run, "--step", "7"]) == 2
    assert (
        f"--step: no checkpoint at step 7 in '{run}'; kept: {SFT_STEPS}, {SFT_STEPS + RL_STEPS}"
        in capsys.readouterr().err
    )


# --------------------------------------------------------------------------- inspect_ai
@pytest.mark.extras
def test_an_inspect_task_evaluates_a_run_through_the_bridge(tmp_path: Path) -> None:
    """inspect_ai finds the ``tempering`` provider through its entry point; the completions it
    scores are exactly what tempering's completion sampler gives for the same chat messages."""
    pytest.importorskip("inspect_ai", reason="inspect_ai is not installed (pip install 'tempering[inspect]')")
    from inspect_ai import Task
    from inspect_ai import eval as inspect_eval
    from inspect_ai.dataset import Sample
    from inspect_ai.scorer import exact
    from inspect_ai.solver import generate

    from tempering.plugins.datasets.tool_use import tool_use
    from tempering.training.rundata import RunDir, run_backend

    run = small_run()
    tasks = tool_use("test", size=4)
    task = Task(
        dataset=[Sample(input=t["question"], target=t["answer"]) for t in tasks], solver=generate(), scorer=exact()
    )
    [log] = inspect_eval(
        task,
        model=f"tempering/{run}",
        model_args={"step": SFT_STEPS},
        log_dir=str(tmp_path),
        display="none",
        max_tokens=20,
        temperature=0.0,
    )
    assert log.status == "success", log.error
    got = {s.input: s.output.completion for s in log.samples}

    with run_backend(RunDir(run), step=SFT_STEPS) as (backend, _):
        spec = EvalSpec(
            dataset=[{"messages": [{"role": "user", "content": t["question"]}]} for t in tasks],
            renderer="tiny_chat",
            max_tokens=20,
        )
        records = evaluate_policy(backend, spec).records
    want = {r["example"]["messages"][0]["content"]: r["completion"] for r in records}
    assert got == want and len(got) == 4
    right = sum(want[t["question"]] == t["answer"] for t in tasks) / len(tasks)
    assert math.isclose(log.results.scores[0].metrics["mean"].value, right)  # exact(): mean of C=1 / I=0
