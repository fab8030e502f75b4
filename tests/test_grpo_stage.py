"""The GRPO stage end to end on the tiny model: metrics, failure handling, resume."""

from __future__ import annotations

import json
import math
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


def partial_credit(completion: str, example: dict) -> float:
    """Share of answer characters right in place: unlike exact match, an untrained model
    already gets spread within groups, so GRPO really updates (zero spread = no update)."""
    want = example["answer"]
    return sum(a == b for a, b in zip(completion, want)) / len(want) + 0.1 * len(completion)


def _recipe(out: Path, **over) -> Recipe:
    stages = [
        {"id": "warmup", "name": "sft", "steps": 3, "batch_size": 8, "optimizer": {"learning_rate": 1e-2}},
        {
            "id": "rl",
            "name": "grpo",
            "steps": 3,
            "prompts_per_step": 4,
            "group_size": 4,
            "max_tokens": 4,
            "optimizer": {"learning_rate": 1e-2},
            "reward": over.pop("reward", partial_credit),
            "kl_every": over.pop("kl_every", 10),
            **over.pop("rl", {}),
            "eval": {"dataset": {"name": "arithmetic", "split": "test", "size": 8}, "max_tokens": 4},
        },
    ]
    return Recipe.from_dict(
        {"name": "t", "output_dir": str(out), "backend": TINY, "loggers": ["jsonl", "plot"], "stages": stages, **over}
    )


def _weights(backend) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in backend.model.parameters()])


def test_grpo_stage_logs_the_promised_metrics(tmp_path: Path) -> None:
    result = _recipe(tmp_path, kl_every=1).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["stage"] == "rl" and "reward/mean" in r]
    assert len(rl) == 3
    for key in (
        "reward/mean",
        "accuracy",
        "loss",
        "kl_ref",
        "step_time",
        "tokens_per_s",
        "time/sample",
        "time/reward",
        "time/train",
        "grad_norm",
        "clip_ratio/region_mean",
        "reward/failed",
        "completion/mean_len",
    ):
        assert key in rl[0], key
    assert all(math.isfinite(r["loss"]) for r in rl)
    assert rl[0]["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # the reference is the stage's start
    assert rl[-1]["kl_ref"] > 0.0  # and the policy moves away from it
    assert [r["step"] for r in rl] == [4, 5, 6]  # global steps continue after the 3 SFT steps
    assert "first_error" not in rl[0] and rl[0]["reward/failed"] == 0.0
    assert (tmp_path / "reward_curve.png").stat().st_size > 1000
    assert "eval/accuracy" in result.stages["rl"]
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["components"]["algorithm:grpo"].startswith("tempering ")


def test_kl_is_logged_every_kl_every_steps_by_default(tmp_path: Path) -> None:
    """The default cadence (``kl_every: 10``) pays one reference forward every 10 steps."""
    _recipe(tmp_path, kl_every=2).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["stage"] == "rl" and "reward/mean" in r]
    assert ["kl_ref" in r for r in rl] == [True, False, True]


def test_tempered_sampling_takes_old_logprobs_from_the_training_forward(tmp_path: Path, monkeypatch) -> None:
    """At temperature 0.7 the sampler's logprobs are not the policy's, so the ratio's "old"
    logprobs are the policy's. On the local backend ``auto`` takes them from the training forward
    itself (detached) instead of a second forward pass: the same weights as ``always`` (which pays
    that pass every step), and a logprobs call only on the step that logs the KL."""
    from tempering.plugins.backends.local.backend import LocalBackend

    calls: list[str] = []
    real = LocalBackend.logprobs

    def counted(self, batch, **kwargs):
        calls.append("reference" if kwargs else "policy")
        return real(self, batch, **kwargs)

    monkeypatch.setattr(LocalBackend, "logprobs", counted)
    weights, rows = {}, {}
    for mode in ("always", "auto"):
        calls.clear()
        backend = get_registry().build("backend", TINY)
        _recipe(tmp_path / mode, rl={"temperature": 0.7, "recompute_logprobs": mode}).run(backend=backend)
        weights[mode] = _weights(backend)
        lines = (tmp_path / mode / "metrics.jsonl").read_text().splitlines()
        rows[mode] = [r for r in map(json.loads, lines) if r["stage"] == "rl" and "reward/mean" in r]
        # 3 RL steps, the KL logged at the first (kl_every 10) and the last (the summary's value):
        # always = 3 forwards + 2 references; auto = a forward only with each reference
        always = ["policy", "reference", "policy", "policy", "reference"]
        assert calls == (always if mode == "always" else ["policy", "reference", "policy", "reference"])
    assert all(r["advantage/abs_mean"] > 0 for r in rows["auto"])  # the steps really trained
    assert [r["loss"] for r in rows["auto"]] == pytest.approx([r["loss"] for r in rows["always"]], abs=1e-6)
    assert torch.allclose(weights["auto"], weights["always"], atol=1e-6)


def test_failing_reward_is_counted_and_masked_not_fatal(tmp_path: Path) -> None:
    """A third of the rewards fail: below the default ``max_failed_fraction`` (0.5), so the
    run goes on (tests/test_failures.py covers the stop)."""
    calls = {"n": 0}

    def flaky(completion: str, example: dict) -> float:
        calls["n"] += 1
        if calls["n"] % 6 == 0:
            raise RuntimeError("judge unreachable")
        if calls["n"] % 6 == 1:
            return float("nan")
        return 1.0

    _recipe(tmp_path, reward=flaky).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["stage"] == "rl" and "reward/failed" in r]
    assert len(rl) == 3
    assert sum(r["reward/failed"] for r in rl) == 1 / 3 * 3 * 16
    assert {r["first_error"] for r in rl} <= {
        "RuntimeError: judge unreachable",
        "reward returned nan (not a finite number)",
    }


def test_interrupted_staged_run_resumes_to_the_same_weights(tmp_path: Path) -> None:
    straight = _recipe(tmp_path / "a")
    res_a = straight.run()
    backend_a = get_registry().build("backend", TINY)
    backend_a.load(read_progress(str(tmp_path / "a"))["checkpoint"])

    # Stop mid-GRPO (after 3 SFT + 1 GRPO steps, checkpointing every step), then run again.
    _recipe(tmp_path / "b", max_total_steps=4, checkpoint_every=1).run()
    progress = read_progress(str(tmp_path / "b"))
    assert progress["completed"] == ["warmup"] and progress["current"] == "rl"
    res_b = _recipe(tmp_path / "b", checkpoint_every=1).run()
    backend_b = get_registry().build("backend", TINY)
    backend_b.load(read_progress(str(tmp_path / "b"))["checkpoint"])

    assert torch.allclose(_weights(backend_a), _weights(backend_b), atol=1e-6)
    assert all(r["advantage/abs_mean"] > 0 for r in res_a.history if r["stage"] == "rl" and "loss" in r)
    assert res_b.stages["rl"]["loss"] == pytest.approx(res_a.stages["rl"]["loss"], abs=1e-6)


def test_missing_dataset_column_is_a_config_error_with_its_path(tmp_path: Path) -> None:
    from tempering.errors import ConfigError

    recipe = Recipe.from_dict(
        {
            "name": "t",
            "output_dir": str(tmp_path),
            "backend": TINY,
            "loggers": [],
            "stages": [{"name": "sft", "steps": 1, "completion_key": "solution"}],
        }
    )
    with pytest.raises(ConfigError, match=r"^stages\[0\]\.completion_key: rows have no 'solution'"):
        recipe.run()
