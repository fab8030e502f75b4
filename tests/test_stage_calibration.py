"""A stage's held-out evaluation of probability answers (issue 36 item 3): Brier, Brier skill
and ECE logged with the evaluation, a reliability diagram PNG per evaluation in the run folder,
and ``tempering view`` listing and serving it (the Plots tab)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from tempering.apps.view.server import RunViewer, ViewServer, make_handler
from tempering.plugins.datasets.forecast_questions import forecast_questions
from tempering.runs.calibration import calibration, reliability_path
from tempering.runs.serving import Call
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe
from tempering.training.rundata import RunDir


def text_rows(split: str, size: int) -> list[dict[str, Any]]:
    """forecast_questions as text prompts (FakeBackend's character tokenizer has no chat format)."""
    return [
        {"prompt": r["question"], **{k: r[k] for k in ("outcome", "rate")}} for r in forecast_questions(split, size)
    ]


def states_the_rate(prompt: str, i: int) -> str:
    """A forecaster that answers each question's stated rate, except that every fifth question
    (by count 3) gets no number at all: an unreadable answer."""
    count, total = map(int, re.search(r"(\d+) of (?:the|their) last (\d+)", prompt).groups())  # type: ignore[union-attr]
    return "no idea" if count == 3 else f"{count / total:.2f}"


def run(tmp_path: Path, reward: str, train: list[dict[str, Any]], test: list[dict[str, Any]]) -> list[dict[str, Any]]:
    recipe = Recipe(
        name="forecast",
        output_dir=str(tmp_path),
        loggers=["jsonl"],
        seed=0,
        backend={"name": "local", "model": "tiny_llama"},  # replaced by the FakeBackend
        stages=[
            {
                "id": "rl",
                "name": "grpo",
                "dataset": train,
                "reward": reward,
                "steps": 1,
                "prompts_per_step": 2,
                "group_size": 2,
                "max_tokens": 8,
                "max_failed_fraction": 1.0,
                "eval": {"dataset": test, "at_start": True, "every": 1},
            }
        ],
    )
    return [h for h in recipe.run(backend=FakeBackend(complete=states_the_rate)).history if "eval/n" in h]


def test_the_stage_logs_calibration_and_draws_a_reliability_diagram(tmp_path: Path) -> None:
    test = text_rows("test", 40)
    read = [r for r in test if round(r["rate"] * 10) != 3]
    assert 0 < len(read) < len(test)
    expected = calibration([r["rate"] for r in read], [float(r["outcome"]) for r in read])
    evals = run(tmp_path, "brier", text_rows("train", 16), test)
    assert [e["step"] for e in evals] == [0, 1]  # before and after training
    for e in evals:
        assert e["eval/forecasts"] == len(read) and e["eval/failed"] == len(test) - len(read)
        assert e["eval/brier"] == pytest.approx(expected.brier)
        assert e["eval/brier_skill"] == pytest.approx(expected.brier_skill)
        assert e["eval/ece"] == pytest.approx(expected.ece)
        assert e["eval/base_rate"] == pytest.approx(expected.base_rate)
    pngs = [reliability_path(str(tmp_path), "rl", step) for step in (0, 1)]
    assert all(os.path.getsize(p) > 5_000 for p in pngs)

    viewer = RunViewer(RunDir.open(str(tmp_path)))
    assert viewer.route("/api/plots", "") == (200, ["reliability/rl-step000000.png", "reliability/rl-step000001.png"])
    answer = make_handler(viewer)

    def get(path: str) -> Any:
        return answer(Call("GET", path, "", {}, b""))

    reply = get("/plots/reliability/rl-step000001.png")
    assert reply.status == 200 and reply.content_type == "image/png"
    assert reply.content == Path(pngs[1]).read_bytes() and reply.content[:8] == b"\x89PNG\r\n\x1a\n"
    for outside in ("/plots/run.json", "/plots/reliability/../run.json", "/plots/../metrics.jsonl", "/plots/x.png"):
        assert get(outside).status == 404, outside


def test_the_plots_tab_shows_the_reliability_diagrams_in_a_real_browser(tmp_path: Path) -> None:
    from test_view import page_at

    run(tmp_path, "brier", text_rows("train", 16), text_rows("test", 20))
    with ViewServer(str(tmp_path), port=0) as server, page_at(server.url + "#plots") as (page, errors):
        page.wait_for_selector("#tab-plots.active figure.plot img")
        page.wait_for_function(
            "[...document.querySelectorAll('#plots img')].every(i => i.complete && i.naturalWidth > 300)"
        )
        captions = page.locator("#plots figcaption").all_inner_texts()
        assert captions == ["reliability/rl-step000000.png", "reliability/rl-step000001.png"]
    assert errors == []


def test_other_rewards_log_no_calibration(tmp_path: Path) -> None:
    rows = [{"prompt": "It rained on 4 of the last 10 days.", "answer": "0.40"}]
    evals = run(tmp_path, "exact_match", rows * 4, rows)
    assert evals and not any("eval/brier" in e or "eval/ece" in e for e in evals)
    assert not (tmp_path / "reliability").exists()
    assert RunViewer(RunDir.open(str(tmp_path))).plots() == []
