"""Progress shows the phase and estimates from training steps only (issue 35 item 12): the
model load says so before any bar exists, an evaluation shows ``[eval i/n]`` on the stage's
bar, and its time is taken out of the bar's clock, so the remaining-time estimate is the
training steps' (before: a 100 s evaluation between two 1 s steps made each step look 51 s)."""

from __future__ import annotations

import io
from typing import Any

from tempering.training.progress import paused
from tempering.training.recipe import Recipe


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def bar_with(clock: Clock, total: int) -> Any:
    from tqdm import tqdm

    out = io.StringIO()
    bar = tqdm(total=total, file=out, mininterval=0, miniters=1, smoothing=0)
    bar._time = clock
    bar.start_t = bar.last_print_t = clock()
    return bar, out


def test_an_evaluation_is_left_out_of_the_estimate_and_shows_its_phase():
    clock = Clock()
    bar, out = bar_with(clock, total=10)
    clock.t += 1.0
    bar.update(1)  # a 1 s training step
    with paused(bar, "eval") as report:
        report(0, 200)
        assert bar.desc.endswith("[eval 0/200]")
        clock.t += 60.0
        report(128, 200)
        assert bar.desc.endswith("[eval 128/200]")
        clock.t += 40.0
    assert "[eval" not in bar.desc
    clock.t += 1.0
    bar.update(1)  # the next 1 s step
    stats = bar.format_dict
    assert stats["elapsed"] == 2.0  # the evaluation's 100 s are not in it
    remaining = (stats["total"] - stats["n"]) * stats["elapsed"] / stats["n"]
    assert remaining == 8.0  # 8 steps of 1 s, not 8 x 51 s
    assert "eval 128/200" in out.getvalue()
    bar.close()


def test_a_disabled_bar_is_left_alone():
    with paused(None, "eval") as report:
        report(1, 2)


def test_a_run_shows_loading_and_eval_phases(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEMPERING_PROGRESS", "1")
    stage = {
        "name": "grpo",
        "steps": 2,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 2,
        "eval": {"dataset": {"name": "arithmetic", "split": "test", "size": 4}, "max_tokens": 2},
    }
    backend = {"name": "local", "model": "tiny_llama", "model_kwargs": {"hidden_size": 32, "num_layers": 1}}
    Recipe.from_dict(
        {"name": "p", "output_dir": str(tmp_path), "backend": backend, "loggers": ["jsonl"], "stages": [stage]}
    ).run()
    err = capsys.readouterr().err
    assert "tempering: loading the model: tiny_llama on the local backend" in err
    assert "[eval 0/4]" in err and "[eval 4/4]" in err
