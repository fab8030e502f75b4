"""No silent failures, no corrupted runs: failed samples are counted by cause and shown, too
many stop the run (checkpointed), reward values are strict, and every value the config can
get wrong fails before anything trains -- one line with the key's path."""

from __future__ import annotations

import json
import math
import re
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tempering.errors import ConfigError, TemperingError
from tempering.interfaces import RewardResult
from tempering.rollouts.environment import Environment, StepResult
from tempering.rollouts.scoring import RewardRunner, reward_number
from tempering.runs.failures import FailureWatch, failure_cause, failure_metrics
from tempering.training.recipe import Recipe, read_progress
from tempering.types import Completion, Sample

MODEL = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
TINY = {"name": "local", "model": "tiny_llama", "num_threads": 1, "model_kwargs": MODEL}


def backend(chat: bool = False) -> Any:
    from tempering.plugins.backends.local.backend import LocalBackend

    kwargs = {**MODEL, "chat": True, "max_position_embeddings": 128} if chat else MODEL
    return LocalBackend(model="tiny_llama", model_kwargs=kwargs, num_threads=1)


def weights(b: Any) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in b.model.parameters()])


def rl(**over: Any) -> dict[str, Any]:
    return {
        "id": "rl",
        "name": "grpo",
        "steps": 4,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 2,
        "dataset": {"name": "arithmetic", "size": 16},
        "optimizer": {"learning_rate": 1e-2},
        **over,
    }


def run(out: Path, *stages: dict[str, Any], b: Any = None) -> Any:
    recipe = Recipe.from_dict(
        {"name": "t", "output_dir": str(out), "loggers": ["jsonl"], "backend": TINY, "stages": list(stages)}
    )
    return recipe.run(backend=b)


def rows(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def sample() -> Sample:
    return Sample({"prompt": "1+1=", "answer": "2"}, Completion([1], [2], [0.0], "stop", text="2"))


# --------------------------------------------------------------------------- strict reward values
@pytest.mark.parametrize(
    "value, cause, text",
    [
        ("1.0", "not_a_number", "reward returned '1.0' of type str, not a real number"),
        (None, "not_a_number", "reward returned None of type NoneType, not a real number"),
        ([1.0], "not_a_number", "reward returned [1.0] of type list, not a real number"),
        (torch.tensor(1.0), "not_a_number", "of type Tensor, not a real number"),
        (RewardResult("1"), "not_a_number", "reward returned '1' of type str"),
        ({"reward": "1"}, "not_a_number", "reward returned '1' of type str"),
        (float("nan"), "not_finite", "reward returned nan (not a finite number)"),
        (-math.inf, "not_finite", "reward returned -inf (not a finite number)"),
    ],
)
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_anything_but_a_finite_real_number_is_a_failure_naming_its_type(value, cause, text, kind):
    def sync(c: str, e: dict) -> Any:
        return value

    async def asynchronous(c: str, e: dict) -> Any:
        return value

    s = sample()
    stats = RewardRunner(sync if kind == "sync" else asynchronous).score([s])
    assert (stats.failed, s.failed, s.reward, failure_cause(s)) == (1, True, 0.0, cause)
    assert text in s.error


@pytest.mark.parametrize(
    "value, expected",
    [
        (True, 1.0),
        (False, 0.0),
        (3, 3.0),
        (np.float32(0.5), 0.5),
        (np.int64(2), 2.0),
        (Fraction(1, 4), 0.25),
        (-0.0, 0.0),
    ],
)
def test_real_numbers_and_bools_are_rewards(value, expected):
    assert reward_number(value) == expected and type(reward_number(value)) is float
    s = sample()
    assert RewardRunner(lambda c, e: value).score([s]).scored == 1 and (s.reward, s.failed) == (expected, False)


def test_a_combined_reward_is_as_strict():
    from tempering.plugins.rewards.combine import weighted

    s = sample()
    RewardRunner(weighted([(lambda c, e: "1.0", 1.0)])).score([s])
    assert (
        s.failed
        and s.error == "RewardError: weighted: component '<lambda>' returned '1.0' of type str, not a real number"
    )


def test_raised_and_timed_out_rewards_have_their_causes():
    import asyncio

    async def slow(c: str, e: dict) -> float:
        await asyncio.sleep(5)
        return 1.0

    a, b = sample(), sample()
    RewardRunner(lambda c, e: e["nope"]).score([a])
    RewardRunner(slow, timeout=0.05).score([b])
    assert (failure_cause(a), a.error) == ("raised:KeyError", "KeyError: 'nope'")
    assert failure_cause(b) == "timeout" and b.reward_info["timeout"] is True
    assert failure_metrics([a, b, sample()]) == {
        "failed/raised:KeyError": 1.0,
        "failed/timeout": 1.0,
        "first_error/raised:KeyError": "KeyError: 'nope'",
        "first_error/timeout": b.error,
    }


# --------------------------------------------------------------------------- the stop rule
def watched(watch: FailureWatch, failed: int, n: int = 4, cause: str = "raised:RuntimeError") -> dict[str, Any]:
    row: dict[str, Any] = {"rollout/samples": float(n)}
    if failed:
        row.update({f"failed/{cause}": float(failed), f"first_error/{cause}": f"RuntimeError: {cause}"})
    watch.observe(row)
    return row


def test_the_window_tolerates_a_bad_step_and_stops_a_bad_run(capsys):
    from tempering.training.recipe import StopRun

    watch = FailureWatch("rl", "stages[1]", max_failed_fraction=0.5, window=3)
    first = watched(watch, 4)
    watch.check()  # the window is not full yet
    second = watched(watch, 4)
    watch.check()
    assert "first_error/raised:RuntimeError" in first and "first_error/raised:RuntimeError" not in second
    assert capsys.readouterr().err.count("RuntimeError: raised:RuntimeError") == 1  # printed once
    watched(watch, 0)
    with pytest.raises(
        StopRun,
        match=r"^stages\[1\]: 8 of 12 samples failed in the last 3 steps .*cause "
        r"raised:RuntimeError \(8x\): RuntimeError: raised:RuntimeError\. Fix",
    ):
        watch.check()

    watch = FailureWatch("rl", "stages[1]", max_failed_fraction=0.5, window=3)
    for failed in (4, 0, 0, 2):  # one bad step in three, then a half-failed one: never more than half
        watched(watch, failed)
        watch.check()
    watch = FailureWatch("rl", "stages[1]", max_failed_fraction=0.5, window=3)
    watched(watch, 3)
    with pytest.raises(StopRun):  # a stage shorter than the window is judged at its last step
        watch.check(last=True)
    watch = FailureWatch("rl", "stages[1]", max_failed_fraction=1.0, window=1)
    watched(watch, 4)
    watch.check(last=True)  # 1 never stops


# --------------------------------------------------------------------------- runs that fail
def boom(c: str, e: dict) -> float:
    raise RuntimeError("boom")


def text_reward(c: str, e: dict) -> str:
    return "1.0"


@pytest.mark.parametrize(
    "reward, cause, text",
    [
        (boom, "raised:RuntimeError", "RuntimeError: boom"),
        (lambda c, e: float("nan"), "not_finite", "reward returned nan (not a finite number)"),
        (lambda c, e: None, "not_a_number", "reward returned None of type NoneType, not a real number"),
        (text_reward, "not_a_number", "reward returned '1.0' of type str, not a real number"),
        (
            {"name": "remote", "url": "http://127.0.0.1:9", "retries": 0, "timeout": 2.0},
            "raised:HTTPRewardError",
            "ConnectError",
        ),
    ],
    ids=["raises", "nan", "none", "str", "server_down"],
)
def test_a_run_whose_every_reward_fails_stops_with_a_checkpoint_and_one_line(tmp_path, capsys, reward, cause, text):
    b = backend()
    before = weights(b)
    with pytest.raises(TemperingError) as err:
        run(tmp_path, rl(reward=reward, steps=10), b=b)
    message = str(err.value)
    assert "\n" not in message
    assert re.match(
        rf"stage 'rl' stopped the run: stages\[0\]: 12 of 12 samples failed in the last 3 steps "
        rf"\(more than max_failed_fraction=0\.5\); cause {re.escape(cause)} \(12x\): ",
        message,
    ), message
    assert text in message
    progress = read_progress(str(tmp_path))
    assert progress["current"] == "rl" and progress["global_step"] == 3 and progress["checkpoint"]
    logged = [r for r in rows(tmp_path) if r["stage"] == "rl"]
    assert [r["step"] for r in logged] == [1, 2, 3]
    for i, r in enumerate(logged):
        assert r["failed/" + cause] == 4.0 and r["rollout/samples"] == 4.0 and r["skipped"] == 1.0
        assert "reward/mean" not in r and "accuracy" not in r and "loss" not in r  # no 0 posing as a reward
        assert (f"first_error/{cause}" in r) == (i == 0) and text in r.get(f"first_error/{cause}", text)
    assert torch.equal(weights(b), before)  # nothing trained
    err_out = capsys.readouterr().err
    assert err_out.count(f"tempering: rl step 1: 4 samples failed [{cause}]: ") == 1 and text in err_out


def test_off_policy_rl_stops_the_same_way(tmp_path):
    with pytest.raises(
        TemperingError, match=r"12 of 12 samples failed in the last 3 steps .*cause raised:RuntimeError"
    ):
        run(tmp_path, rl(name="offpolicy", reward=boom, steps=8))
    assert read_progress(str(tmp_path))["current"] == "rl"


def test_a_short_stage_that_fails_throughout_stops_at_its_end(tmp_path):
    with pytest.raises(TemperingError, match=r"2 of 2 samples failed in the last 1 step \(") as err:
        run(tmp_path, rl(reward=boom, steps=1, prompts_per_step=1))
    assert "cause raised:RuntimeError" in str(err.value)


def test_a_bad_step_is_skipped_but_the_run_goes_on(tmp_path):
    """One step whose rewards all fail (a judge's hiccup) among good ones: that batch trains on
    nothing and reports no reward, the others train, and the run finishes."""
    calls = {"n": 0}

    def hiccup(c: str, e: dict) -> float:
        calls["n"] += 1
        if calls["n"] <= 4:
            raise ConnectionError("judge restarting")
        return float(len(c)) + (c[:1] == e["answer"][:1])

    result = run(tmp_path, rl(reward=hiccup, steps=3))
    logged = [r for r in rows(tmp_path) if r["stage"] == "rl" and "rollout/samples" in r]
    assert [r["skipped"] for r in logged] == [1.0, 0.0, 0.0]
    assert "reward/mean" not in logged[0] and all("reward/mean" in r for r in logged[1:])
    assert logged[0]["failed/raised:ConnectionError"] == 4.0
    assert read_progress(str(tmp_path))["completed"] == ["rl"] and "reward/mean" in result.stages["rl"]


def test_max_failed_fraction_1_never_stops_and_never_trains_on_failures(tmp_path, capsys):
    b = backend()
    before = weights(b)
    run(tmp_path, rl(reward=boom, steps=4, max_failed_fraction=1.0), b=b)
    assert read_progress(str(tmp_path))["completed"] == ["rl"]
    assert torch.equal(weights(b), before)
    assert capsys.readouterr().err.count("samples failed [raised:RuntimeError]: RuntimeError: boom") == 1


def test_evaluation_failures_are_logged_by_cause_and_printed_once(tmp_path, capsys):
    def eval_boom(c: str, e: dict) -> float:
        raise ValueError("eval judge down")

    stage = rl(
        reward=lambda c, e: float(len(c)),
        steps=2,
        eval={"dataset": [{"prompt": "1+1=", "answer": "2"}] * 3, "reward": eval_boom, "every": 1},
    )
    run(tmp_path, stage)
    evals = [r for r in rows(tmp_path) if "eval/n" in r]
    assert len(evals) >= 2 and all(r["eval/failed/raised:ValueError"] == 3.0 for r in evals)
    assert ["eval/first_error/raised:ValueError" in r for r in evals] == [True] + [False] * (len(evals) - 1)
    assert (
        capsys.readouterr().err.count("3 evaluation samples failed [raised:ValueError]: ValueError: eval judge down")
        == 1
    )


def test_evaluation_gives_the_reward_the_stages_timeout(tmp_path):
    """A reward that needs longer than the 60 s default (the monitor's whole batch) is given the
    stage's ``reward_timeout`` in evaluation as in training: here 0.3 s fails an evaluation
    that 5 s lets through, with the same slow reward."""
    import asyncio

    async def slow(c: str, e: dict) -> float:
        await asyncio.sleep(0.6)
        return 1.0

    for timeout, failed in ((0.3, 2.0), (5.0, 0.0)):
        out = tmp_path / str(timeout)
        stage = rl(reward=slow, steps=1, reward_timeout=timeout, max_failed_fraction=1.0)
        stage["eval"] = {"dataset": [{"prompt": "1+1=", "answer": "2"}] * 2, "every": 1}
        run(out, stage)
        evals = [r for r in rows(out) if "eval/n" in r]
        assert evals and all(r.get("eval/failed", 0.0) == failed for r in evals), (timeout, evals)


class Broken(Environment):
    """An environment whose reset raises: every episode fails."""

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        raise RuntimeError("no sandbox")

    async def step(self, response: Any) -> StepResult:  # pragma: no cover - never reached
        return StepResult(reward=1.0, done=True)


def test_environment_episode_errors_stop_the_run_too(tmp_path):
    stage = {
        "id": "rl",
        "name": "grpo",
        "steps": 5,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 4,
        "dataset": [{"q": "1+2?", "answer": "3"}],
        "sampler": {"name": "environment", "environment": Broken},
    }
    with pytest.raises(TemperingError, match=r"cause episode_error \(12x\): episode: RuntimeError: no sandbox"):
        Recipe.from_dict({"name": "env", "output_dir": str(tmp_path), "loggers": ["jsonl"], "stages": [stage]}).run(
            backend=backend(chat=True)
        )


# --------------------------------------------------------------------------- validation before anything trains
WARMUP = {"id": "warmup", "name": "sft", "steps": 2, "batch_size": 2, "dataset": {"name": "arithmetic", "size": 8}}


def _jsonl(tmp_path: Path, name: str, lines: list[dict[str, Any]]) -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"optimizer": {"learning_rate": -1e-3}}, r"^stages\[1\]\.optimizer\.learning_rate: must be > 0, got -0\.001"),
        ({"optimizer": {"schedule": "cosin"}}, r"^stages\[1\]\.optimizer\.schedule: .*Did you mean 'cosine'\?"),
        ({"group_size": 1}, r"^stages\[1\]\.group_size: must be >= 2 with advantage 'group_norm', got 1"),
        ({"group_size": 1, "advantage": "rloo"}, r"^stages\[1\]\.group_size: must be >= 2 with advantage 'rloo'"),
        ({"group_size": 0}, r"^stages\[1\]\.group_size: must be >= 1, got 0"),
        ({"max_tokens": 0}, r"^stages\[1\]\.max_tokens: must be >= 1, got 0"),
        (
            {"eval": {"dataset": {"name": "arithmetic", "size": 4}, "max_tokens": 0}},
            r"^stages\[1\]\.eval\.max_tokens: must be >= 1",
        ),
        ({"steps": 0}, r"^stages\[1\]\.steps: must be >= 1, got 0"),
        ({"steps": -2}, r"^stages\[1\]\.steps: must be >= 1, got -2"),
        (
            {"loss": {"name": "grpo", "loss_type": "dpao"}},
            r"^stages\[1\]\.loss\.loss_type: GRPOLoss\.loss_type must be one of .*got 'dpao'\. Did you mean 'dapo'\?$",
        ),
        ({"max_failed_fraction": 1.5}, r"^stages\[1\]\.max_failed_fraction: must be in \[0, 1\]"),
        (
            {"reward": {"name": "process_pool", "reward": "no_such_module_xyz:score"}},
            r"^stages\[1\]\.reward\.reward: cannot import module 'no_such_module_xyz'",
        ),
        (
            {"dataset": [{"prompt": "1+1=", "solution": "2"}]},
            r"^stages\[1\]\.reward\.answer_key: rows have no 'answer' \(row 0 has keys: \['prompt', 'solution'\]\); "
            r"set reward\.answer_key",
        ),
        (
            {"dataset": "QUESTIONS"},
            r"^stages\[1\]\.dataset: rows have no 'prompt' or 'messages' \(row 0 has keys: \['answer', 'question'\]\); "
            r"rename a column \(e\.g\. rename: \{your_column: prompt\}\)$",
        ),
        (  # a built-in dataset has no rename key: the fix must not offer one
            {"dataset": {"name": "tool_use", "split": "train"}},
            r"^stages\[1\]\.dataset: rows have no 'prompt' or 'messages' \(row 0 has keys: \['answer', 'calls', "
            r"'question'\]\); this dataset is made for another kind of stage: choose one whose rows have it, or load "
            r"yours with jsonl or hf, whose rename maps a column onto prompt$",
        ),
        ({"dataset": "EMPTY"}, r"^stages\[1\]\.dataset: the dataset is empty \(0 rows\)"),
        ({"dataset": {"name": "arithmetic", "size": 0}}, r"^stages\[1\]\.dataset: the dataset is empty"),
        (
            {"dataset": "MISSING"},
            r"^stages\[1\]\.dataset: the dataset does not load: FileNotFoundError: jsonl dataset: no file at",
        ),
        ({"eval": {"dataset": [{"prompt": "1+1="}]}}, r"^stages\[1\]\.eval\.reward\.answer_key: rows have no 'answer'"),
    ],
    ids=[
        "negative_lr",
        "schedule",
        "group_size_1",
        "group_size_1_rloo",
        "group_size_0",
        "max_tokens_0",
        "eval_max_tokens_0",
        "steps_0",
        "steps_negative",
        "loss_type",
        "max_failed_fraction",
        "process_pool_target",
        "no_answer_column",
        "no_prompt_column",
        "no_prompt_column_builtin",
        "empty_file",
        "empty_dataset",
        "missing_file",
        "eval_no_answer",
    ],
)
def test_a_value_that_cannot_work_fails_before_the_first_stage_trains(tmp_path, over, match):
    files = {
        "QUESTIONS": {"name": "jsonl", "path": _jsonl(tmp_path, "q.jsonl", [{"question": "1+1=", "answer": "2"}])},
        "EMPTY": {"name": "jsonl", "path": _jsonl(tmp_path, "empty.jsonl", [])},
        "MISSING": {"name": "jsonl", "path": str(tmp_path / "nope.jsonl")},
    }
    if isinstance(over.get("dataset"), str):
        over = {**over, "dataset": files[over["dataset"]]}
    with pytest.raises(ConfigError, match=match) as err:
        run(tmp_path / "out", WARMUP, rl(**over))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out" / "checkpoints").exists() and rows(tmp_path / "out") == []  # nothing trained


@pytest.mark.parametrize(
    "stage, match",
    [
        ({"name": "sft", "completion_key": "solution"}, r"^stages\[1\]\.completion_key: rows have no 'solution'"),
        (
            {"name": "dpo", "dataset": [{"prompt": "a", "chosen": "b"}]},
            r"^stages\[1\]\.rejected_key: rows have no 'rejected'",
        ),
        (
            {"name": "sdft", "dataset": [{"prompt": "a"}]},
            r"^stages\[1\]\.demonstration_key: rows have no 'demonstration'",
        ),
        ({"name": "sft", "batch_size": 0}, r"^stages\[1\]\.batch_size: must be >= 1"),
    ],
    ids=["sft", "dpo", "sdft", "sft_batch_size"],
)
def test_every_stage_checks_the_columns_it_reads_before_anything_trains(tmp_path, stage, match):
    with pytest.raises(ConfigError, match=match):
        run(tmp_path, WARMUP, {"id": "later", "steps": 1, **stage})
    assert not (tmp_path / "checkpoints").exists()


def test_a_jsonl_dataset_is_checked_from_its_first_rows_and_hub_datasets_are_not_loaded(tmp_path):
    from tempering.plugins.datasets.files import PEEK_ROWS, hf, jsonl

    path = _jsonl(tmp_path, "big.jsonl", [{"prompt": str(i), "answer": str(i)} for i in range(50)])
    with open(path, "a", encoding="utf-8") as fh:
        fh.write("not json\n")  # past the peeked rows: found when the stage loads the file
    assert len(jsonl.peek(path)) == PEEK_ROWS and jsonl.peek(path, size=3, rename={"answer": "a"})[0] == {
        "prompt": "0",
        "a": "0",
    }
    assert hf.peek("openai/gsm8k", name="main") is None  # no download to validate
    assert hf.peek("json", data_files=path)[0] == {"prompt": "0", "answer": "0"}
    with pytest.raises(FileNotFoundError, match="no file matches"):
        hf.peek("json", data_files=str(tmp_path / "none*.jsonl"))


def test_config_only_validation_skips_the_data(tmp_path):
    from tempering.registry import get_registry
    from tempering.training.recipe import RunContext
    from tempering.training.stage import config_only

    reg = get_registry()
    spec = {k: v for k, v in rl(dataset={"name": "jsonl", "path": "-"}).items() if k != "id"}
    stage = reg.build("algorithm", spec, "stages[0]")
    ctx = RunContext(reg, None, {}, "", [], 0, stage_index=0, stage_id="rl")
    with config_only():
        stage.validate(ctx)
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.dataset: the dataset does not load"):
        stage.validate(ctx)


def test_rows_past_the_peeked_ones_are_checked_when_the_rl_stage_loads_them(tmp_path):
    from tempering.plugins.datasets.files import PEEK_ROWS

    lines = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(PEEK_ROWS)] + [{"prompt": "9+9=", "ans": "18"}]
    stage = rl(dataset={"name": "jsonl", "path": _jsonl(tmp_path, "late.jsonl", lines)})
    with pytest.raises(
        ConfigError, match=rf"^stages\[0\]\.reward\.answer_key: rows have no 'answer' \(row {PEEK_ROWS} has keys"
    ):
        run(tmp_path / "out", stage)
    assert rows(tmp_path / "out") == []
