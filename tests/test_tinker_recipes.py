"""The bundled recipes, shortened, end to end on the Tinker backend: ``backend.name=tinker``
and nothing else changed in the recipe's backend block, the real SDK talking to the local
Tinker server (tests/fake_tinker.py), which serves ``tiny_llama``.

Each run must finish every stage, log every step with a finite loss and its evaluations, send
each stage's loss as the built-in (or custom loss) it maps to, and close the session as a
success. Learning is not asserted: a few steps of a tiny model say nothing (the local tests of
these recipes do that); what is checked is that every code path of the recipes works on Tinker.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import CHAT_KWARGS, sent, serve  # noqa: E402

from tempering.plugins.backends.tinker.local_service import ServedModel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path)


def run(recipe: Path, out: Path, overrides: list[str]) -> dict[str, list[dict]]:
    """Run ``recipe`` on Tinker into ``out``; the metric rows of each stage."""
    from tempering.recipe import Recipe

    with pytest.warns(UserWarning, match="backend 'tinker' ignores local-backend keys"):
        Recipe.from_yaml(str(recipe), [f"output_dir={out}", "backend.name=tinker", "loggers=[jsonl]", *overrides]).run()
    rows: dict[str, list[dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["stage"], []).append(row)
    return rows


def steps(rows: list[dict]) -> list[int]:
    """The stage's training steps, counted from 1 (the logged ``step`` is the run's)."""
    logged = [r["step"] for r in rows if "loss" in r]
    return [s - logged[0] + 1 for s in logged] if logged else []


def check_run(out: Path, rows: dict[str, list[dict]], expected: dict[str, int]) -> None:
    from tempering.recipe import read_progress

    assert read_progress(str(out))["completed"] == list(expected)
    for stage, n in expected.items():
        assert steps(rows[stage]) == list(range(1, n + 1)), stage
        assert all(math.isfinite(r["loss"]) for r in rows[stage] if "loss" in r)
        assert any(k.startswith("eval/") or k == "accuracy" for r in rows[stage] for k in r), f"{stage}: no evaluation logged"


def loss_fns(server) -> list[str]:
    return [r.loss_fn for r in sent(server, "ForwardBackward")]


def test_arithmetic_on_tinker(server, tmp_path, fresh_registry):
    out = tmp_path / "arithmetic"
    rows = run(REPO / "core" / "recipes" / "arithmetic.yaml", out, [
        "stages.warmup.steps=3", "stages.warmup.batch_size=8", "stages.warmup.eval.every=3",
        "stages.warmup.eval.dataset.size=6",
        "stages.rl.steps=2", "stages.rl.prompts_per_step=2", "stages.rl.group_size=2", "stages.rl.eval.every=2",
        "stages.rl.eval.dataset.size=6"])  # fmt: skip
    check_run(out, rows, {"warmup": 3, "rl": 2})
    assert loss_fns(server) == ["cross_entropy"] * 3 + ["ppo"] * 2  # SFT, then GRPO (dapo) as Tinker's ppo
    assert [r["reason"]["type"] for r in sent(server, "FinishSession")] == ["success"]


def test_dpo_then_rl_on_tinker(server, tmp_path, fresh_registry):
    out = tmp_path / "dpo_then_rl"
    rows = run(REPO / "examples" / "dpo_then_rl" / "recipe.yaml", out, [
        "stages.pref.steps=2", "stages.pref.batch_size=4", "stages.pref.dataset.size=16", "stages.pref.eval.every=2", "stages.pref.eval.dataset.size=6",
        "stages.rl.steps=2", "stages.rl.prompts_per_step=2", "stages.rl.group_size=2", "stages.rl.eval.every=2",
        "stages.rl.eval.dataset.size=6"])  # fmt: skip
    check_run(out, rows, {"pref": 2, "rl": 2})
    # DPO is a custom loss: per step, the SDK's forward pass then a linear cross_entropy backward
    assert loss_fns(server) == ["cross_entropy"] * 2 + ["ppo"] * 2
    assert len([r for r in sent(server, "Forward") if r.loss_fn == "cross_entropy"]) >= 2
    assert all(math.isfinite(r["loss"]) and r.get("tinker/custom_loss") == 1.0 for r in rows["pref"] if "loss" in r)


@pytest.fixture
def chat_server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path, {"tiny_llama": ServedModel("tiny_llama", CHAT_KWARGS)})


def test_tool_use_on_tinker(chat_server, tmp_path, fresh_registry):
    out = tmp_path / "tool_use"
    rows = run(REPO / "core" / "recipes" / "tool_use.yaml", out, [
        "stages.warmup.steps=3", "stages.warmup.batch_size=4", "stages.warmup.dataset.size=16", "stages.warmup.eval.every=3",
        "stages.warmup.eval.dataset.size=3",
        "stages.rl.steps=2", "stages.rl.prompts_per_step=2", "stages.rl.group_size=2", "stages.rl.eval.every=2",
        "stages.rl.eval.dataset.size=3"])  # fmt: skip
    check_run(out, rows, {"warmup": 3, "rl": 2})
    assert loss_fns(chat_server) == ["cross_entropy"] * 3 + ["ppo"] * 2
    assert all("env/turns_mean" in r for r in rows["rl"] if "loss" in r)  # whole episodes, through the calculator
    eos = chat_server.service.base("tiny_llama").tokenizer.eos_token_id
    assert all(eos in r.sampling_params.stop for r in sent(chat_server, "Sample") if not r.prompt_logprobs)
