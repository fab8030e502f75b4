"""A collapsed run says so (issue 35 item 11): with a reward that never varies within a group,
``groups/zero_variance_frac`` is 1 every step; after ``collapse_steps`` such steps the run prints
one line (step, what to try) once, the summary after "Done." carries ``collapsed_at_step``, and
``stop_on_collapse`` / ``--stop-on-collapse`` stops the run there with a checkpoint. The
summary holds the last step's values, not the first's (``kl_ref`` was step 1's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tempering.apps import cli
from tempering.errors import ConfigError, RunStopped
from tempering.training.recipe import Recipe, read_progress

TINY = {"name": "local", "model": "tiny_llama", "model_kwargs": {"hidden_size": 32, "num_layers": 1, "num_heads": 2}}


def same_answer(completion: str, example: dict) -> float:
    return 1.0  # every sample of every prompt scores the same: no spread, no signal


def char_sum(completion: str, example: dict) -> float:
    return (sum(map(ord, completion)) % 5) / 4  # varies with the text: a spread, a signal


def grpo(out: Path, **stage: Any) -> Recipe:
    spec = {
        "id": "rl",
        "name": "grpo",
        "steps": 4,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 2,
        "reward": same_answer,
        "collapse_steps": 3,
        **stage,
    }
    return Recipe.from_dict(
        {"name": "c", "output_dir": str(out), "backend": TINY, "loggers": ["jsonl"], "stages": [spec]}
    )


def rows(out: Path) -> list[dict[str, Any]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "groups/zero_variance_frac" in r]


def test_a_collapsed_stage_warns_once_and_says_so_in_its_summary(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    result = grpo(tmp_path).run()
    assert [r["groups/zero_variance_frac"] for r in rows(tmp_path)] == [1.0] * 4
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "collapsed" in line]
    assert len(lines) == 1, err  # once, at the third step, not again at the fourth
    line = lines[0]
    assert "stage 'rl' has collapsed at step 3" in line
    for hint in ("temperature", "KL", "learning rate", "data", "stages[0].stop_on_collapse", "--stop-on-collapse"):
        assert hint in line, hint
    assert result.stages["rl"]["collapsed_at_step"] == 3


def test_collapse_steps_0_turns_the_watch_off(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    result = grpo(tmp_path, collapse_steps=0).run()  # 0 = off
    assert "collapsed" not in capsys.readouterr().err and "collapsed_at_step" not in result.stages["rl"]


def test_stop_on_collapse_stops_with_a_checkpoint(tmp_path):
    with pytest.raises(RunStopped, match=r"collapsed at step 3.*temperature.*checkpointed at step 3"):
        grpo(tmp_path, stop_on_collapse=True).run()
    progress = read_progress(str(tmp_path))
    assert progress["global_step"] == 3 and progress["current"] == "rl" and progress["completed"] == []
    assert len(rows(tmp_path)) == 3


def test_the_cli_flag_stops_on_collapse_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    monkeypatch.delenv("TEMPERING_STOP_ON_COLLAPSE", raising=False)
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: r\nbackend: {name: local, model: tiny_llama, model_kwargs: {hidden_size: 32, num_layers: 1}}\n"
        "loggers: [jsonl]\nstages:\n  - {name: grpo, steps: 4, prompts_per_step: 2, group_size: 2, max_tokens: 2,\n"
        "     collapse_steps: 2}\n"  # exact_match: an untrained model is never right, every reward 0
    )
    out = tmp_path / "run"
    code = cli.main(["run", str(path), f"--output-dir={out}", "--stop-on-collapse"])
    monkeypatch.delenv("TEMPERING_STOP_ON_COLLAPSE", raising=False)
    err = capsys.readouterr().err
    assert code == 2 and "collapsed at step 2" in err and "Traceback" not in err
    assert read_progress(str(out))["global_step"] == 2


def test_collapse_steps_below_zero_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"stages\[0\]\.collapse_steps: must be a number of steps >= 0"):
        grpo(tmp_path, collapse_steps=-1).run()


def test_the_summary_holds_the_last_steps_values(tmp_path):
    """kl_ref is logged every kl_every steps: the summary showed step 1's (0: the policy is its
    own reference there). It now shows the last step's, which logs it too."""
    result = grpo(tmp_path, reward=char_sum, steps=3, kl_every=10, optimizer={"learning_rate": 0.05}).run()
    logged = rows(tmp_path)
    assert "kl_ref" in logged[0] and "kl_ref" not in logged[1] and "kl_ref" in logged[-1]
    summary = result.stages["rl"]
    assert summary["kl_ref"] == logged[-1]["kl_ref"] and summary["kl_ref"] != logged[0]["kl_ref"]
    assert summary["loss"] == logged[-1]["loss"]
