"""rollouts.jsonl: every RL step and evaluation writes its sampled rollouts in the documented
format -- the share the stage asks for plus every failure, with the advantage it trained on --
multi-turn episodes as whole transcripts, and a resumed run cuts the file back with metrics.jsonl.

The single-turn tests run GRPO on ``tempering.testing.FakeBackend`` (sample ``i`` of a group
says ``str(i)``), so every reward and advantage is known in advance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from observability_run import GROUP, PROMPTS, RL_STEPS, SFT_STEPS, small_run

from tempering.errors import ConfigError
from tempering.registry import get_registry
from tempering.runs import rollout_log
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe

QUESTIONS = [{"prompt": f"q{i}", "answer": "3"} for i in range(7)] + [{"prompt": "boom", "answer": "3"}]


def graded(completion: str, example: dict[str, Any]) -> float:
    """Sample i of a group earns i/3 (so a group of 4 spans 0..1); the 'boom' row's reward raises."""
    if example["prompt"] == "boom":
        raise KeyError("no column 'grade'")
    return float(completion) / 3


def grpo(out: Path, top: dict[str, Any] | None = None, **keys: Any) -> Recipe:
    stage = {
        "id": "rl",
        "name": "grpo",
        "steps": 3,
        "prompts_per_step": 4,
        "group_size": 4,
        "log_rollouts": 2,
        "dataset": QUESTIONS,
        "reward": graded,
        "max_failed_fraction": 1.0,
        **keys,
    }
    return Recipe.from_dict(
        {"name": "r", "output_dir": str(out), "loggers": ["jsonl"], "stages": [stage], **(top or {})}
    )


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_rl_step_writes_its_share_with_failures_and_the_advantages_it_trained_on(tmp_path: Path) -> None:
    evaluation = {"dataset": QUESTIONS, "reward": graded, "every": 2}
    grpo(tmp_path, eval=evaluation).run(backend=FakeBackend())
    records = lines(tmp_path / "rollouts.jsonl")
    metrics = lines(tmp_path / "metrics.jsonl")
    assert all(tuple(r) == rollout_log.FIELDS for r in records)  # every field, in the documented order
    for r in records:  # each record points at the metrics row of its step
        assert r["v"] == 3 and metrics[r["row"]]["step"] == r["step"] and metrics[r["row"]]["stage"] == "rl"

    group_norm = get_registry().build("advantage", "group_norm", "advantage")
    expected = group_norm(torch.tensor([0.0, 1 / 3, 2 / 3, 1.0]), torch.zeros(4, dtype=torch.long)).tolist()
    train = [r for r in records if r["kind"] == "train"]
    for step in (1, 2, 3):
        at = [r for r in train if r["step"] == step]
        first_two = {4 * (step - 1), 4 * (step - 1) + 1}
        failed = {r["group"] for r in at if r["failed"]}
        assert {r["group"] for r in at} == first_two | failed  # the share asked for, plus every failure
        for gid in {r["group"] for r in at}:
            group = sorted((r for r in at if r["group"] == gid), key=lambda r: r["sample"])
            assert [r["completion"] for r in group] == ["0", "1", "2", "3"]
            assert all(r["policy_version"] == step - 1 and r["staleness"] == 0 for r in group)
            if gid in failed:  # the reward raised: cause, text, no reward and no advantage
                assert all(r["failure"] == "raised:KeyError" and "no column 'grade'" in r["error"] for r in group)
                assert all(r["reward"] == 0.0 and r["advantage"] is None for r in group)
            else:
                assert [r["reward"] for r in group] == pytest.approx([0, 1 / 3, 2 / 3, 1])
                assert [r["advantage"] for r in group] == pytest.approx(expected, abs=1e-6)
                assert group[0]["prompt"] == group[0]["example"]["prompt"] and group[0]["messages"] is None
    assert any(r["failed"] for r in train), "the 'boom' row was drawn: its group must be logged"

    evals = [r for r in records if r["kind"] == "eval"]
    assert sorted({r["step"] for r in evals}) == [0, 2, 3]  # at the start, every 2 steps, at the end
    for step in (0, 2, 3):
        at = [r for r in evals if r["step"] == step]
        assert {r["group"] for r in at} == {0, 1, 7}  # the first two examples, and the one that failed
        assert all(r["advantage"] is None and r["completion"] == "0" for r in at)


def test_a_rewards_feedback_is_logged_with_its_sample(tmp_path: Path) -> None:
    grpo(tmp_path, steps=1, reward="exact_match", log_rollouts=-1).run(backend=FakeBackend())
    records = [r for r in lines(tmp_path / "rollouts.jsonl") if r["kind"] == "train"]
    assert sorted({r["completion"] for r in records}) == ["0", "1", "2", "3"]  # hits and misses
    for r in records:  # exact_match on a miss says what it expected; a hit says nothing
        assert r["feedback"] == (None if r["completion"] == "3" else f"expected '3', got '{r['completion']}'")
        assert "feedback" not in r["reward_info"]


def test_the_format_is_documented_field_by_field() -> None:
    doc = rollout_log.__doc__ or ""
    page = (Path(__file__).resolve().parents[1] / "docs" / "observability.md").read_text(encoding="utf-8")
    for name in rollout_log.FIELDS:
        assert f"``{name}``" in doc, name
        assert f"`{name}`" in page, name


def test_multi_turn_episodes_are_logged_as_whole_transcripts() -> None:
    out = Path(small_run())
    records = lines(out / "rollouts.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert sorted({r["step"] for r in train}) == [SFT_STEPS + i for i in range(1, RL_STEPS + 1)]
    assert len(train) == RL_STEPS * min(PROMPTS, rollout_log.DEFAULT_GROUPS) * GROUP or any(r["failed"] for r in train)
    for r in train:
        roles = [m["role"] for m in r["messages"]]
        assert roles[0] == "user" and roles[-1] in ("assistant", "tool") and r["prompt"] is None
        assert r["turns"] == roles.count("assistant") and r["stop"] in ("done", "max_turns", "context", "parse_error")
        if r["stop"] == "done" and r["reward"] == 0.0:  # the calculator says what it expected
            assert r["feedback"].startswith(f"expected '{r['example']['answer']}', got ")
        elif r["stop"] == "max_turns":
            assert r["feedback"].endswith("no final answer within max_turns=3 turns")
        assert r["messages"][0]["content"] == r["example"]["question"]
        assert isinstance(r["advantage"], float) and r["tokens"] > 0
    calls = [(m, r) for r in train for i, m in enumerate(r["messages"]) if m.get("tool_calls")]
    assert calls, "the warmed-up model calls the tool"
    for message, record in calls:  # every call is answered by a tool message with its id
        answered = {m.get("tool_call_id") for m in record["messages"] if m["role"] == "tool"}
        assert {c["id"] for c in message["tool_calls"]} <= answered
        assert message["tool_calls"][0]["function"]["name"] == "mul"
    # both stages' evaluations are logged: the SFT stage's final one and the RL stage's
    evals = {(r["stage"], r["step"]) for r in records if r["kind"] == "eval"}
    assert ("warmup", SFT_STEPS) in evals and ("rl", SFT_STEPS + RL_STEPS) in evals


def test_a_resumed_run_cuts_rollouts_back_to_its_checkpoint(tmp_path: Path) -> None:
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    grpo(whole, steps=4).run(backend=FakeBackend())
    grpo(resumed, {"max_total_steps": 2, "checkpoint_every": 1}, steps=4).run(backend=FakeBackend())
    # the run then went on to log step 3 and was killed mid-line, before its next checkpoint
    progress = json.loads((resumed / "progress.json").read_text())
    later = {**lines(resumed / "rollouts.jsonl")[-1], "row": progress["metrics_rows"], "step": 3, "completion": "stale"}
    with open(resumed / "rollouts.jsonl", "a") as fh:
        fh.write(json.dumps(later) + "\n" + json.dumps(later)[:30])
    with open(resumed / "metrics.jsonl", "a") as fh:
        fh.write(json.dumps({"stage": "rl", "step": 3}) + "\n")
    grpo(resumed, steps=4).run(backend=FakeBackend())
    assert (resumed / "rollouts.jsonl").read_text() == (whole / "rollouts.jsonl").read_text()


def test_log_rollouts_zero_writes_nothing_and_bad_values_fail_with_their_path(tmp_path: Path) -> None:
    grpo(tmp_path / "none", log_rollouts=0).run(backend=FakeBackend())
    assert not (tmp_path / "none" / "rollouts.jsonl").exists()
    grpo(tmp_path / "all", log_rollouts=-1, steps=1).run(backend=FakeBackend())
    assert len(lines(tmp_path / "all" / "rollouts.jsonl")) == 4 * 4
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.log_rollouts: must be a number of groups >= 0, or -1"):
        grpo(tmp_path / "bad", log_rollouts=-2).run(backend=FakeBackend())


def test_values_json_cannot_hold_stay_visible() -> None:
    assert rollout_log.jsonable(
        {"x": float("nan"), "t": torch.tensor(0.5), "v": torch.tensor([1, 2]), "o": object}
    ) == {"x": "nan", "t": 0.5, "v": [1, 2], "o": str(object)}
