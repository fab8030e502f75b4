"""Run-folder edges a user hit (issue 24 items 7, 8, 14): half-written checkpoint folders left by
a kill are removed on resume; ``output_dir`` naming a file is one line; re-running a finished
recipe says so and how to start over instead of a bare "Done"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tempering.apps import cli
from tempering.errors import ConfigError
from tempering.runs import runfolder
from tempering.runs.runfolder import RunAlreadyComplete
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe, read_progress
from tempering.training.stage import Stage
from tempering.types import AdamParams


@dataclass
class Steps(Stage):
    steps: int = 3
    crash_at: int | None = None

    def validate(self, ctx: Any) -> None:
        pass

    def train_step(self, ctx: Any, step: int) -> dict[str, Any]:
        if step == self.crash_at:
            raise RuntimeError("simulated crash")
        ctx.backend.optim_step(AdamParams()).result()
        return {"loss": 1.0 / ctx.backend.step}


def recipe(out: Path, stages: tuple[dict, ...] = ({}, {}), **top: Any) -> Recipe:
    return Recipe(name="edges", output_dir=str(out), loggers=["jsonl"], stages=[Steps(**s) for s in stages], **top)


# --------------------------------------------------------------------------- item 7
def test_half_written_checkpoint_folders_are_removed_on_resume(tmp_path):
    with pytest.raises(RuntimeError):
        recipe(tmp_path, ({}, {"crash_at": 2}), checkpoint_every=2).run(backend=FakeBackend())
    ckpts = tmp_path / "checkpoints"
    listed = {Path(e["path"]).name for e in read_progress(str(tmp_path))["checkpoints"]}
    # what a kill inside a backend's atomic save leaves: the temporary sibling (of a new name or
    # of a suffixed one), and the previous copy moved aside while the new one is swapped in
    leftovers = ["step000006.tmp-4242", "step000004-2.tmp-17", f"{sorted(listed)[-1]}.old-99"]
    for name in leftovers:
        (ckpts / name).mkdir()
        (ckpts / name / "weights.bin").write_bytes(b"half")
    (ckpts / "notes.tmp-1").mkdir()  # not a checkpoint's: left alone
    recipe(tmp_path, checkpoint_every=2).run(backend=FakeBackend())
    names = sorted(p.name for p in ckpts.iterdir())
    assert not [n for n in names if ".tmp-" in n and n.startswith("step")], names
    assert not [n for n in names if ".old-" in n], names
    assert "notes.tmp-1" in names


def test_a_moved_aside_checkpoint_that_is_the_only_copy_is_kept(tmp_path):
    """A kill between a backend's two renames leaves the listed checkpoint only as ``.old-PID``:
    that one is not garbage."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir(parents=True)
    (ckpts / "step000002.old-5").mkdir()
    (ckpts / "step000004.old-5").mkdir()
    (ckpts / "step000004").mkdir()
    ledger = [{"path": str(ckpts / "step000002")}, {"path": str(ckpts / "step000004")}]
    gone = runfolder.remove_unlisted_checkpoints(str(tmp_path), ledger)
    assert gone == ["step000004.old-5"]
    assert sorted(p.name for p in ckpts.iterdir()) == ["step000002.old-5", "step000004"]


# --------------------------------------------------------------------------- item 8
def test_output_dir_naming_a_file_is_one_line(tmp_path, monkeypatch, capsys):
    target = tmp_path / "results.txt"
    target.write_text("not a folder")
    with pytest.raises(ConfigError, match=r"^output_dir: .*results\.txt' is a file, not a folder"):
        recipe(target).run(backend=FakeBackend())
    assert target.read_text() == "not a folder"
    inside = target / "run"  # a folder under a file
    with pytest.raises(ConfigError, match=r"^output_dir: cannot create"):
        recipe(inside).run(backend=FakeBackend())

    import tempering.training.recipe

    monkeypatch.setattr(tempering.training.recipe, "find_recipe", lambda name, overrides: recipe(target))
    monkeypatch.setattr(Recipe, "run", lambda self: tempering.training.recipe.run_recipe(self, backend=FakeBackend()))
    assert cli.main(["run", "anything"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tempering: error: output_dir: ") and "Traceback" not in err


# --------------------------------------------------------------------------- item 14
def test_rerunning_a_finished_recipe_says_it_is_complete_and_how_to_start_over(tmp_path, monkeypatch, capsys):
    first = recipe(tmp_path).run(backend=FakeBackend())
    assert set(first.stages) == {"0", "1"} and not first.already_complete
    metrics = (tmp_path / "metrics.jsonl").read_text()
    with pytest.warns(RunAlreadyComplete, match=r"^tempering: .* is already complete .*nothing was run.*--fresh"):
        again = recipe(tmp_path).run(backend=FakeBackend())
    assert again.already_complete and again.stages == {}
    assert (tmp_path / "metrics.jsonl").read_text() == metrics

    import tempering.training.recipe

    monkeypatch.setattr(tempering.training.recipe, "find_recipe", lambda name, overrides: recipe(tmp_path))
    monkeypatch.setattr(Recipe, "run", lambda self: tempering.training.recipe.run_recipe(self, backend=FakeBackend()))
    assert cli.main(["run", "anything"]) == 0
    out, err = capsys.readouterr()
    assert "Done." not in out
    assert "already complete" in out and "--fresh" in out and str(tmp_path) in out
    assert "already complete" not in err  # said once
