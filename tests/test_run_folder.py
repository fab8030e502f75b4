"""The run folder keeps its promises: ``--fresh`` starts over, a resumed run logs every step
once, checkpoints come mid-stage by default and are pruned, one live run per folder, and a
stage can stop the run cleanly. Each test reproduces one reported failure.

The SIGKILL test runs this file as a script in a child process (see the bottom)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tempering.apps import cli
from tempering.errors import ConfigError, TemperingError
from tempering.registry import get_registry
from tempering.runs import runfolder
from tempering.runs.runfolder import LOCK_FILE, RunFolderWarning, RunLock, RunLockedError
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe, RunStopped, StopRun, read_progress
from tempering.training.stage import Stage
from tempering.types import AdamParams

TIMING = ("time", "step_time", "tokens_per_s")


def timing(key: str) -> bool:
    """A wall-clock metric (never equal across two runs): the step's, ``time/*``, an eval's ``eval/seconds``."""
    return key in TIMING or key.startswith("time/") or key.endswith("/seconds")


# --------------------------------------------------------------------------- a stage without a model
@dataclass
class Counting(Stage):
    """Each step is one optimizer step of the fake backend; its loss is a function of the
    backend's step count, so a resume from the wrong state logs different numbers. ``crash_at``
    raises an error at that step (a crash), ``stop_at`` raises :class:`StopRun`, and
    ``minutes_per_step`` advances a fake wall clock."""

    steps: int = 4
    crash_at: int | None = None
    stop_at: int | None = None
    minutes_per_step: float = 0.0

    def validate(self, ctx: Any) -> None:
        pass

    def setup(self, ctx: Any, state: Any) -> None:
        if self.minutes_per_step:
            start = ctx.clock()
            self.clock = [start]
            ctx.clock = lambda: self.clock[0]

    def train_step(self, ctx: Any, step: int) -> dict[str, Any]:
        if step == self.crash_at:
            raise RuntimeError("simulated crash")
        if step == self.stop_at:
            raise StopRun("too many failed samples (9 of 16)")
        ctx.backend.optim_step(AdamParams()).result()
        if self.minutes_per_step:
            self.clock[0] += 60 * self.minutes_per_step
        return {"loss": 1.0 / ctx.backend.step}


def counting(out: Path, stages: tuple[dict, ...] = ({}, {}), **top: Any) -> Recipe:
    return Recipe(name="count", output_dir=str(out), loggers=["jsonl"], stages=[Counting(**s) for s in stages], **top)


def rows(out: Path) -> list[dict[str, Any]]:
    """metrics.jsonl without the wall-clock columns."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not timing(k)} for line in lines]


def checkpoint_dirs(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict[str, Any]]:
    """What one uninterrupted two-stage run of 4 + 4 steps logs."""
    out = tmp_path_factory.mktemp("reference")
    counting(out).run(backend=FakeBackend())
    return rows(out)


# --------------------------------------------------------------------------- --fresh
def test_fresh_starts_over_and_moves_the_old_run_aside(tmp_path, reference):
    """Reported: a --fresh run inherited the old ``completed`` list; after it crashed in
    stage 1, the rerun skipped stage 1 and said 'Done.'. Its metrics appended to the old ones."""
    out = tmp_path / "run"
    counting(out).run(backend=FakeBackend())
    fresh_warning = pytest.warns(RunFolderWarning, match=r"starting fresh .* moved to .*run\.prev-")
    with fresh_warning, pytest.raises(RuntimeError, match="simulated crash"):
        counting(out, ({}, {"crash_at": 2}), resume=False).run(backend=FakeBackend())
    progress = read_progress(str(out))
    assert progress["completed"] == ["0"] and progress["global_step"] == 4
    result = counting(out).run(backend=FakeBackend())
    assert set(result.stages) == {"1"}  # stage 1 ran again
    assert rows(out) == reference  # one run's rows, none of the first run's
    (moved,) = [p for p in tmp_path.iterdir() if p.name.startswith("run.prev-")]
    assert rows(moved) == reference and read_progress(str(moved))["completed"] == ["0", "1"]
    assert sorted(os.listdir(moved)) == ["checkpoints", "metrics.jsonl", "progress.json", "run.json"]


def test_fresh_into_an_empty_folder_moves_nothing(tmp_path, recwarn):
    counting(tmp_path / "new", resume=False).run(backend=FakeBackend())
    assert not [w for w in recwarn if issubclass(w.category, RunFolderWarning)]
    assert [p.name for p in tmp_path.iterdir()] == ["new"]


# --------------------------------------------------------------------------- resume: each step once
def test_a_crash_after_a_checkpoint_does_not_duplicate_steps(tmp_path, reference):
    """Reported: after a kill and a rerun, the steps between the last checkpoint and the kill
    were in metrics.jsonl twice."""
    with pytest.raises(RuntimeError, match="simulated crash"):
        counting(tmp_path, ({}, {"crash_at": 3}), checkpoint_every=3).run(backend=FakeBackend())
    assert [r["step"] for r in rows(tmp_path)][-3:] == [5, 6, 7]  # logged up to step 7 ...
    assert read_progress(str(tmp_path))["global_step"] == 6  # ... checkpointed at step 6
    counting(tmp_path, checkpoint_every=3).run(backend=FakeBackend())
    assert rows(tmp_path) == reference


def test_a_killed_half_line_and_a_half_saved_checkpoint_are_cleaned_up(tmp_path, reference):
    with pytest.raises(RuntimeError):
        counting(tmp_path, ({}, {"crash_at": 3}), checkpoint_every=3).run(backend=FakeBackend())
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"stage": "1", "st')  # the kill landed inside a write
    (tmp_path / "checkpoints" / "step000009").mkdir()  # ... or inside a save
    counting(tmp_path, checkpoint_every=3).run(backend=FakeBackend())
    assert rows(tmp_path) == reference
    assert "step000009" not in checkpoint_dirs(tmp_path)


def test_a_run_killed_before_its_first_checkpoint_starts_its_log_over(tmp_path, reference):
    with pytest.raises(RuntimeError):
        counting(tmp_path, ({"crash_at": 2}, {})).run(backend=FakeBackend())
    assert read_progress(str(tmp_path)) is None and len(rows(tmp_path)) == 2
    counting(tmp_path).run(backend=FakeBackend())
    assert rows(tmp_path) == reference


# --------------------------------------------------------------------------- checkpoints by default
def test_stages_checkpoint_mid_stage_by_time_by_default(tmp_path):
    """Reported: with the default ``checkpoint_every: 0`` a kill lost the whole stage. By
    default a stage now checkpoints once 5 minutes passed since the last checkpoint."""
    stage = {"steps": 10, "minutes_per_step": 2, "crash_at": 8}
    with pytest.raises(RuntimeError):
        counting(tmp_path, (stage,)).run(backend=FakeBackend())
    progress = read_progress(str(tmp_path))
    # 2 minutes a step: due after steps 3 (6 min) and 6 (6 min after the one at step 3)
    assert [e["global_step"] for e in progress["checkpoints"]] == [3, 6]
    assert progress["current"] == "0" and progress["global_step"] == 6
    backend = FakeBackend()
    result = counting(tmp_path, ({"steps": 10, "minutes_per_step": 2},)).run(backend=backend)
    assert backend.step == 10 and [r["step"] for r in result.history] == [7, 8, 9, 10]


def test_checkpoint_every_still_counts_steps_and_keep_checkpoints_prunes(tmp_path):
    """Reported: checkpoints were never pruned. The newest ``keep_checkpoints`` periodic ones
    stay, and every stage end."""
    counting(tmp_path, checkpoint_every=1, keep_checkpoints=2).run(backend=FakeBackend())
    progress = read_progress(str(tmp_path))
    listed = [(e["global_step"], e["stage_end"]) for e in progress["checkpoints"]]
    assert listed == [(4, True), (7, False), (8, False), (8, True)]
    assert checkpoint_dirs(tmp_path) == ["step000004-2", "step000007", "step000008", "step000008-2"]
    assert progress["checkpoint"].endswith("step000008-2") and progress["current"] is None


def test_keep_checkpoints_null_keeps_all(tmp_path):
    counting(tmp_path, checkpoint_every=1, keep_checkpoints=None).run(backend=FakeBackend())
    assert len(checkpoint_dirs(tmp_path)) == 8 + 2  # every step, and both stage ends


@pytest.mark.parametrize(
    "top, key",
    [
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
        ({"checkpoint_minutes": -1}, "checkpoint_minutes"),
        ({"checkpoint_every": "often"}, "checkpoint_every"),
    ],
)
def test_bad_checkpoint_keys_fail_before_anything_runs(tmp_path, top, key):
    with pytest.raises(ConfigError, match=rf"^{key}: must be"):
        counting(tmp_path / "run", **top).run(backend=FakeBackend())
    assert not (tmp_path / "run").exists()


def test_the_checkpoint_keys_are_recipe_keys_with_their_defaults():
    recipe = Recipe.from_dict({"stages": [{"name": "sft"}], "keep_checkpoints": 5})
    assert (recipe.checkpoint_every, recipe.checkpoint_minutes, recipe.keep_checkpoints) == (0, 5.0, 5)
    assert Recipe.from_dict({"stages": [{"name": "sft"}]}).keep_checkpoints == 3


# --------------------------------------------------------------------------- the lock
def test_a_second_live_run_into_the_same_folder_is_refused(tmp_path):
    """Reported: two runs into one folder interleaved their metrics."""
    refused = pytest.raises(RunLockedError, match=rf"another run is writing to this folder \(pid {os.getpid()} on ")
    with RunLock(str(tmp_path)), refused:  # a live run holds the folder
        counting(tmp_path).run(backend=FakeBackend())
    assert not (tmp_path / "metrics.jsonl").exists()  # the refused run touched nothing
    counting(tmp_path).run(backend=FakeBackend())  # released: the next run goes ahead
    assert not (tmp_path / LOCK_FILE).exists()


def test_the_lock_is_released_when_a_run_fails(tmp_path):
    with pytest.raises(RuntimeError):
        counting(tmp_path, ({"crash_at": 1},)).run(backend=FakeBackend())
    assert not (tmp_path / LOCK_FILE).exists()
    with RunLock(str(tmp_path)):
        pass


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path):
    holder = {"pid": _dead_pid(), "host": runfolder.socket.gethostname(), "started": "x"}
    (tmp_path / LOCK_FILE).write_text(json.dumps(holder))
    with pytest.warns(RunFolderWarning, match="taking over a stale lock of pid"):
        counting(tmp_path).run(backend=FakeBackend())
    assert not (tmp_path / LOCK_FILE).exists()


def test_without_file_locks_the_pid_decides(tmp_path, monkeypatch):
    monkeypatch.setattr(runfolder, "_try_flock", lambda fd: None)  # a filesystem without flock
    lock = tmp_path / LOCK_FILE
    host = runfolder.socket.gethostname()
    lock.write_text(json.dumps({"pid": os.getpid(), "host": host, "started": "x"}))
    with pytest.raises(RunLockedError, match="another run is writing"):
        RunLock(str(tmp_path)).acquire()
    lock.write_text(json.dumps({"pid": os.getpid(), "host": "elsewhere", "started": "x"}))
    with pytest.raises(RunLockedError, match=rf"a run on another host .* delete {lock}"):
        RunLock(str(tmp_path)).acquire()
    lock.write_text(json.dumps({"pid": _dead_pid(), "host": host, "started": "x"}))
    with pytest.warns(RunFolderWarning, match="stale"), RunLock(str(tmp_path)):
        assert json.loads(lock.read_text())["pid"] == os.getpid()


# --------------------------------------------------------------------------- StopRun
def test_stop_run_checkpoints_the_stage_and_raises_one_error(tmp_path, reference):
    with pytest.raises(RunStopped) as err:
        counting(tmp_path, ({}, {"stop_at": 2})).run(backend=FakeBackend())
    assert isinstance(err.value, TemperingError)
    assert str(err.value) == (
        "stage '1' stopped the run: too many failed samples (9 of 16). The run is checkpointed "
        "at step 6: fix the cause and run the same recipe again to resume"
    )
    progress = read_progress(str(tmp_path))
    assert progress["current"] == "1" and progress["global_step"] == 6 and progress["completed"] == ["0"]
    assert not (tmp_path / LOCK_FILE).exists()
    counting(tmp_path).run(backend=FakeBackend())
    assert rows(tmp_path) == reference


def test_stop_run_before_a_stage_takes_a_step_resumes_from_the_stage_start(tmp_path, reference):
    with pytest.raises(RunStopped, match=r"\(9 of 16\)\. The run will start this stage over: fix the cause"):
        counting(tmp_path, ({}, {"stop_at": 0})).run(backend=FakeBackend())
    progress = read_progress(str(tmp_path))
    assert progress["completed"] == ["0"] and progress["current"] is None
    counting(tmp_path).run(backend=FakeBackend())
    assert rows(tmp_path) == reference


def test_the_cli_prints_a_stopped_run_as_one_line(tmp_path, monkeypatch, capsys):
    import tempering.training.recipe

    recipe = counting(tmp_path, ({"stop_at": 1},))
    monkeypatch.setattr(tempering.training.recipe, "find_recipe", lambda name, overrides: recipe)
    monkeypatch.setattr(Recipe, "run", lambda self: tempering.training.recipe.run_recipe(self, backend=FakeBackend()))
    assert cli.main(["run", "anything"]) == 2
    out, err = capsys.readouterr()
    assert "Done." not in out
    assert err.count("\n") == 1 and err.startswith("tempering: error: stage '0' stopped the run: too many failed")


# --------------------------------------------------------------------------- SIGKILL mid-GRPO
TINY = {
    "name": "local",
    "model": "tiny_llama",
    "num_threads": 1,
    "model_kwargs": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
}
RL_STEPS = 8


def partial_credit(completion: str, example: dict) -> float:
    """Spread within groups even for an untrained model, so every GRPO step moves the weights."""
    want = example["answer"]
    return sum(a == b for a, b in zip(completion, want)) / len(want) + 0.1 * len(completion)


def sft_then_grpo(out: Path) -> Recipe:
    stages = [
        {"id": "warmup", "name": "sft", "steps": 2, "batch_size": 8, "optimizer": {"learning_rate": 1e-2}},
        {
            "id": "rl",
            "name": "grpo",
            "steps": RL_STEPS,
            "prompts_per_step": 4,
            "group_size": 4,
            "max_tokens": 4,
            "optimizer": {"learning_rate": 1e-2},
            "reward": partial_credit,
            "dataset": {"name": "arithmetic", "size": 64},
            "eval": {"dataset": {"name": "arithmetic", "split": "test", "size": 4}, "max_tokens": 4, "every": 3},
        },
    ]
    return Recipe.from_dict(
        {
            "name": "kill",
            "seed": 5,
            "output_dir": str(out),
            "backend": TINY,
            "loggers": ["jsonl"],
            "stages": stages,
            "checkpoint_every": 3,
        }
    )


def final_weights(out: Path) -> torch.Tensor:
    backend = get_registry().build("backend", TINY)
    backend.load(read_progress(str(out))["checkpoint"])
    return torch.cat([p.detach().flatten() for p in backend.model.parameters()])


def rl_rows_written(path: Path) -> int:
    if not path.exists():
        return 0
    whole = path.read_text().split("\n")[:-1]  # a line still being written has no newline yet
    return sum(1 for line in whole if '"stage": "rl"' in line and '"loss"' in line)


def test_sigkill_mid_grpo_then_rerun_equals_an_uninterrupted_run(tmp_path):
    """The acceptance test: a run killed (SIGKILL) at a random step of its GRPO stage and run
    again ends with the metrics and weights of a run that was never interrupted."""
    straight = tmp_path / "straight"
    sft_then_grpo(straight).run()

    out = tmp_path / "killed"
    kill_after = random.Random(20240611).randint(1, RL_STEPS - 1)  # GRPO rows logged before the kill
    with open(tmp_path / "child.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, __file__, str(out)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TEMPERING_PROGRESS": "0"},
        )
        deadline = time.monotonic() + 120
        while rl_rows_written(out / "metrics.jsonl") < kill_after:
            assert child.poll() is None, f"the run ended before the kill: {(tmp_path / 'child.log').read_text()}"
            assert time.monotonic() < deadline, "no GRPO rows within 120 s"
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    assert (out / LOCK_FILE).exists()  # the killed run could not clean up
    print(
        f"killed after {kill_after} GRPO rows: {len(rows(out))} rows on disk, "
        f"checkpointed at step {read_progress(str(out))['global_step']}"
    )

    with pytest.warns(RunFolderWarning, match="stale lock"):
        sft_then_grpo(out).run()
    resumed, uninterrupted = rows(out), rows(straight)  # every step once, same numbers
    assert [sorted(r) for r in resumed] == [sorted(r) for r in uninterrupted]
    for a, b in zip(resumed, uninterrupted):
        assert a == pytest.approx(b)
    assert [r["step"] for r in rows(out) if "loss" in r] == list(range(1, 2 + RL_STEPS + 1))
    assert torch.equal(final_weights(out), final_weights(straight))


if __name__ == "__main__":  # the child process of the SIGKILL test
    sft_then_grpo(Path(sys.argv[1])).run()
