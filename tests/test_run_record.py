"""The run folder keeps a true record (issue 35 items 9, 10, 14): a rerun of a finished recipe
with a changed recipe leaves ``run.json`` as it ran and names the changed keys; a resumed run
with changes records them; ``--fresh`` checks the data and the model before it moves the old
run aside; a ``progress.json.tmp-PID`` left by a kill is removed on resume."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tempering.apps import cli
from tempering.errors import ConfigError
from tempering.runs.runfolder import RecipeChanged, RunAlreadyComplete
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe
from tempering.training.stage import CHECK_DATA, Stage
from tempering.types import AdamParams


@dataclass
class Steps(Stage):
    steps: int = 2
    data_ok: bool = True
    stop_after: int | None = None

    def validate(self, ctx: Any) -> None:
        if CHECK_DATA.get() and not self.data_ok:  # the data check: only once config checks passed
            raise ConfigError("no such file 'missing.jsonl'", f"{ctx.path}.dataset")

    def train_step(self, ctx: Any, step: int) -> dict[str, Any]:
        ctx.backend.optim_step(AdamParams()).result()
        if self.stop_after is not None and step + 1 >= self.stop_after:
            ctx.max_total_steps = ctx.global_step + 1
        return {"loss": 1.0}


def recipe(out: Path, lr: float = 1e-4, **stage: Any) -> Recipe:
    return Recipe(
        name="record",
        output_dir=str(out),
        loggers=["jsonl"],
        stages=[Steps(optimizer={"learning_rate": lr}, **stage)],
    )


def run_json(out: Path) -> dict[str, Any]:
    return json.loads((out / "run.json").read_text())


# --------------------------------------------------------------------------- item 9
def test_a_noop_rerun_with_a_changed_recipe_keeps_run_json_and_names_the_keys(tmp_path):
    recipe(tmp_path, lr=1e-4).run(backend=FakeBackend())
    before = (tmp_path / "run.json").read_text()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = recipe(tmp_path, lr=5e-3).run(backend=FakeBackend())
    assert result.already_complete
    assert (tmp_path / "run.json").read_text() == before  # the rate it trained with, not the new one
    assert run_json(tmp_path)["recipe"]["stages"][0]["optimizer"]["learning_rate"] == 1e-4
    changed = [w for w in caught if issubclass(w.category, RecipeChanged)]
    assert len(changed) == 1, [str(w.message) for w in caught]
    text = str(changed[0].message)
    assert "stages[0].optimizer.learning_rate" in text and "0.0001 -> 0.005" in text and "--fresh" in text
    assert [w for w in caught if issubclass(w.category, RunAlreadyComplete)]


def test_the_same_recipe_rerun_says_nothing_about_changes(tmp_path):
    recipe(tmp_path).run(backend=FakeBackend())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recipe(tmp_path).run(backend=FakeBackend())
    assert not [w for w in caught if issubclass(w.category, RecipeChanged)]


def test_a_resumed_run_with_a_changed_recipe_records_the_change(tmp_path):
    recipe(tmp_path, stop_after=1).run(backend=FakeBackend())  # stops after step 1 of 2: resumable
    assert run_json(tmp_path)["recipe"]["stages"][0]["optimizer"]["learning_rate"] == 1e-4
    with pytest.warns(RecipeChanged, match=r"stages\[0\]\.optimizer\.learning_rate \(0\.0001 -> 0\.005\)"):
        recipe(tmp_path, lr=5e-3, stop_after=1).run(backend=FakeBackend())
    record = run_json(tmp_path)
    assert record["recipe"]["stages"][0]["optimizer"]["learning_rate"] == 5e-3
    assert record["recipe_changes"] == [
        {"global_step": 1, "changed": {"stages[0].optimizer.learning_rate": [1e-4, 5e-3]}}
    ]


def test_the_cli_says_a_noop_rerun_changed_keys(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    path = tmp_path / "r.yaml"
    path.write_text(
        "name: r\nbackend: {name: local, model: tiny_llama}\nloggers: [jsonl]\n"
        "stages:\n  - {name: sft, steps: 1, dataset: {name: arithmetic, size: 4}, batch_size: 2}\n"
    )
    out = tmp_path / "run"
    assert cli.main(["run", str(path), f"--output-dir={out}"]) == 0
    capsys.readouterr()
    assert cli.main(["run", str(path), f"--output-dir={out}", "stages.0.optimizer.learning_rate=0.5"]) == 0
    err = capsys.readouterr().err
    assert "stages[0].optimizer.learning_rate" in err and "-> 0.5" in err and "run.json" in err
    assert json.loads((out / "run.json").read_text())["recipe"]["stages"][0].get("optimizer") is None


# --------------------------------------------------------------------------- item 10
def test_fresh_checks_the_data_before_it_moves_the_old_run_aside(tmp_path):
    out = tmp_path / "run"
    recipe(out).run(backend=FakeBackend())
    with pytest.raises(ConfigError, match=r"missing\.jsonl"):
        Recipe(**{**recipe(out, data_ok=False).__dict__, "resume": False}).run(backend=FakeBackend())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # no .prev-* folder
    assert (out / "progress.json").exists() and (out / "run.json").exists()  # the old run is where it was


def test_fresh_builds_the_model_before_it_moves_the_old_run_aside(tmp_path):
    out = tmp_path / "run"
    backend = {"name": "local", "model": "tiny_llama", "model_kwargs": {"hidden_size": 32}}
    stage = {"name": "sft", "steps": 1, "dataset": {"name": "arithmetic", "size": 4}, "batch_size": 2}
    data = {"name": "r", "output_dir": str(out), "backend": backend, "loggers": ["jsonl"], "stages": [stage]}
    Recipe.from_dict(data).run()
    bad = {**data, "backend": {**backend, "model_kwargs": {"hidden_size": -32}}, "resume": False}
    with pytest.raises(ConfigError, match=r"backend\.model_kwargs\.hidden_size"):
        Recipe.from_dict(bad).run()  # refused when the model is built
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
    assert (out / "progress.json").exists()


# --------------------------------------------------------------------------- item 14
def test_a_progress_tmp_file_left_by_a_kill_is_removed_on_resume(tmp_path):
    recipe(tmp_path, stop_after=1).run(backend=FakeBackend())
    leftover = tmp_path / "progress.json.tmp-4242"
    leftover.write_text('{"half')
    other = tmp_path / "notes.json.tmp-1"
    other.write_text("mine")
    recipe(tmp_path).run(backend=FakeBackend())
    assert not leftover.exists() and other.exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith("run.json.tmp-")]
