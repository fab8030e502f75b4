"""Staged recipes with the preference and distillation stages: DPO then GRPO (and SFT then
SDFT) share one backend, checkpoint, stop on ``max_total_steps`` and resume -- between stages
and in the middle of one -- to exactly the weights of an uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tempering.registry import get_registry
from tempering.training.recipe import Recipe, read_progress

TINY = {
    "name": "local",
    "model": "tiny_llama",
    "num_threads": 1,
    "model_kwargs": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
}
DPO_STEPS, RL_STEPS = 4, 3


def partial_credit(completion: str, example: dict) -> float:
    """Share of answer characters right in place, plus a little for length: an untrained
    model already gets spread within groups, so GRPO really updates."""
    want = example["answer"]
    return sum(a == b for a, b in zip(completion, want)) / len(want) + 0.1 * len(completion)


def _dpo_then_rl(out: Path, dpo: dict | None = None, **top) -> Recipe:
    stages = [
        {
            "id": "pref",
            "name": "dpo",
            "steps": DPO_STEPS,
            "batch_size": 8,
            "optimizer": {"learning_rate": 1e-2},
            "loss": {"name": "dpo", "loss_type": "sigmoid_sft", "beta": 0.1},
            "dataset": {"name": "synthetic_preferences", "size": 32},
            **(dpo or {}),
        },
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
        },
    ]
    return Recipe.from_dict(
        {
            "name": "dpo_rl",
            "seed": 3,
            "output_dir": str(out),
            "backend": TINY,
            "loggers": ["jsonl"],
            "stages": stages,
            **top,
        }
    )


def _final_weights(out: Path) -> torch.Tensor:
    backend = get_registry().build("backend", TINY)
    backend.load(read_progress(str(out))["checkpoint"])
    return torch.cat([p.detach().flatten() for p in backend.model.parameters()])


def _losses(history: list[dict], stage: str) -> list[float]:
    return [r["loss"] for r in history if r["stage"] == stage and "loss" in r]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict:
    """One uninterrupted DPO -> GRPO run, the reference for every resumed one."""
    out = tmp_path_factory.mktemp("straight")
    result = _dpo_then_rl(out).run()
    return {"out": out, "result": result, "weights": _final_weights(out)}


def test_dpo_then_grpo_runs_and_logs_both_stages(straight):
    out, result = straight["out"], straight["result"]
    progress = read_progress(str(out))
    assert progress["completed"] == ["pref", "rl"] and progress["current"] is None
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    pref = [r for r in rows if r["stage"] == "pref" and "loss" in r]
    rl = [r for r in rows if r["stage"] == "rl" and "loss" in r]
    assert [r["step"] for r in pref] == [1, 2, 3, 4] and [r["step"] for r in rl] == [5, 6, 7]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "sft/nll", "grad_norm"):
        assert key in pref[0], key
    assert pref[-1]["rewards/margins"] > pref[0]["rewards/margins"]
    assert all(r["advantage/abs_mean"] > 0 for r in rl)  # GRPO really moved the weights
    assert set(result.stages) == {"pref", "rl"}
    run = json.loads((out / "run.json").read_text())
    assert run["components"]["algorithm:dpo"].startswith("tempering ")


def test_stopping_after_stage_one_resumes_into_stage_two_identically(tmp_path, straight):
    _dpo_then_rl(tmp_path, max_total_steps=DPO_STEPS).run()
    progress = read_progress(str(tmp_path))
    assert progress["completed"] == ["pref"] and progress["current"] is None and progress["global_step"] == DPO_STEPS
    resumed = _dpo_then_rl(tmp_path).run()
    assert set(resumed.stages) == {"rl"}  # stage 1 was not run again
    diff = (_final_weights(tmp_path) - straight["weights"]).abs().max().item()
    print(f"stop after DPO, resume into GRPO: max |weight diff| vs uninterrupted = {diff:.1e}")
    assert diff <= 1e-6
    assert _losses(resumed.history, "rl") == pytest.approx(_losses(straight["result"].history, "rl"), abs=1e-6)


@pytest.mark.parametrize(
    "stop, dpo",
    [
        (2, {}),  # mid-DPO, live stage-start reference: the snapshot comes back from the checkpoint
        (2, {"reference": "precomputed"}),  # mid-DPO, the precomputed reference comes back from its cache
        (DPO_STEPS + 1, {}),  # mid-GRPO
    ],
    ids=["mid_dpo_live", "mid_dpo_precomputed", "mid_grpo"],
)
def test_stages_resume_mid_stage_to_the_uninterrupted_weights(tmp_path, straight, stop, dpo):
    _dpo_then_rl(tmp_path, dpo, max_total_steps=stop, checkpoint_every=1).run()
    progress = read_progress(str(tmp_path))
    assert progress["current"] == ("pref" if stop < DPO_STEPS else "rl") and progress["global_step"] == stop
    resumed = _dpo_then_rl(tmp_path, dpo, checkpoint_every=1).run()
    diff = (_final_weights(tmp_path) - straight["weights"]).abs().max().item()
    print(f"stop at step {stop} {dpo}: max |weight diff| vs uninterrupted = {diff:.1e}")
    assert diff <= 1e-6
    if stop < DPO_STEPS:
        assert _losses(resumed.history, "pref") == pytest.approx(
            _losses(straight["result"].history, "pref")[stop:], abs=1e-6
        )


def test_precomputed_reference_matches_live_reference_in_a_staged_run(tmp_path, straight):
    pre = _dpo_then_rl(tmp_path, {"reference": "precomputed"}).run()
    assert _losses(pre.history, "pref") == pytest.approx(_losses(straight["result"].history, "pref"), abs=1e-6)


def _sft_then_sdft(out: Path, **top) -> Recipe:
    rows = [
        {"prompt": f"{a}+{b}=", "demonstration": str(a + b), "answer": str(a + b)} for a in range(10) for b in range(10)
    ]
    stages = [
        {
            "id": "warmup",
            "name": "sft",
            "steps": 3,
            "batch_size": 8,
            "optimizer": {"learning_rate": 1e-2},
            "dataset": {"name": "arithmetic", "size": 64},
        },
        {
            "id": "distill",
            "name": "sdft",
            "steps": 4,
            "prompts_per_step": 4,
            "max_tokens": 4,
            "dataset": rows,
            "teacher": "ema",
            "ema_rate": 0.3,
            "teacher_template": "{demonstration} {prompt}",
            "loss": {"name": "sdft", "mode": "topk_logits", "topk": 5},
            "optimizer": {"learning_rate": 1e-2},
        },
    ]
    return Recipe.from_dict(
        {"name": "sft_sdft", "seed": 1, "output_dir": str(out), "backend": TINY, "loggers": [], "stages": stages, **top}
    )


def test_sdft_with_an_ema_teacher_resumes_mid_stage_identically(tmp_path):
    straight = _sft_then_sdft(tmp_path / "a").run()
    _sft_then_sdft(tmp_path / "b", max_total_steps=5, checkpoint_every=1).run()  # 3 SFT + 2 SDFT steps
    assert read_progress(str(tmp_path / "b"))["current"] == "distill"
    resumed = _sft_then_sdft(tmp_path / "b", checkpoint_every=1).run()
    diff = (_final_weights(tmp_path / "a") - _final_weights(tmp_path / "b")).abs().max().item()
    print(f"SFT -> SDFT (EMA teacher) stopped mid-SDFT: max |weight diff| vs uninterrupted = {diff:.1e}")
    assert diff <= 1e-6
    assert _losses(resumed.history, "distill") == pytest.approx(_losses(straight.history, "distill")[2:], abs=1e-6)
    assert len({round(x, 6) for x in _losses(straight.history, "distill")}) > 1  # it trained
