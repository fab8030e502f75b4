"""On-policy distillation on the Tinker backend: the real SDK against the local Tinker server
(tests/fake_tinker.py, serving ``tiny_llama``). The teacher is a ``tinker://`` sampler-weights
path -- the cookbook's ``teacher_checkpoint`` -- scored by a sampling client of those weights
(``weights=path``); the sampled-token advantages train Tinker's built-in ``importance_sampling``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import tinker  # noqa: F401 - a dev dependency: missing is a failure, not a skip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import make_backend, sent, serve

from tempering.algorithms.sft.loss import CrossEntropyLoss
from tempering.types import AdamParams, Batch, Datum

pytestmark = pytest.mark.timeout(120)
ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path)


def _teacher_path(server, trained: bool) -> str:
    """Sampler weights saved on the service: a fresh adapter (seed 0: the student's own start)
    or one trained a few steps to answer 7."""
    b = make_backend(server, seed=0)
    if trained:
        tok = b.tokenizer
        rows = []
        for r in ROWS[::10]:
            ids = tok(r["prompt"] + "7")["input_ids"] + [tok.eos_token_id]
            n = len(tok(r["prompt"])["input_ids"])
            rows.append(Datum(ids[:-1], ids[1:], [0.0] * (n - 1) + [0.1] * (len(ids) - n)))
        for _ in range(20):
            b.forward_backward(Batch(rows), CrossEntropyLoss()).result()
            b.optim_step(AdamParams(learning_rate=1e-1)).result()
    b.snapshot("teacher").result()
    return b.snapshots.path(b.snapshots.current()[0])


def _distill(tmp_path: Path, name: str, teacher: str) -> list[dict]:
    from tempering.training.recipe import Recipe

    result = Recipe(
        name=name,
        output_dir=str(tmp_path / name),
        loggers=[],
        backend={"name": "tinker", "base_model": "tiny_llama", "seed": 0, "retry_backoff": 0.0},
        stages=[
            {
                "name": "distill",
                "teacher": teacher,
                "dataset": ROWS,
                "steps": 2,
                "prompts_per_step": 2,
                "group_size": 2,
                "max_tokens": 3,
                "optimizer": {"learning_rate": 1e-2},
            }
        ],
    ).run()
    return [r for r in result.history if "loss" in r]


def test_a_tinker_path_teacher_is_scored_by_its_own_sampling_client(server, tmp_path, fresh_registry):
    start = _teacher_path(server, trained=False)
    trained = _teacher_path(server, trained=True)
    assert start.startswith("tinker://") and trained.startswith("tinker://")
    n_fb = len(sent(server, "ForwardBackward"))
    same = _distill(tmp_path, "same", start)
    other = _distill(tmp_path, "other", trained)
    assert len(same) == len(other) == 2
    # the student's own starting weights: no divergence on its first samples; a trained teacher: some
    kl_same, kl_other = same[0]["distill/teacher_kl"], other[0]["distill/teacher_kl"]
    print(f"teacher_kl at step 1: own start {kl_same:.2e}, trained {kl_other:.3f}")
    assert same[0]["distill/teacher_kl"] == pytest.approx(0.0, abs=1e-4)
    assert abs(other[0]["distill/teacher_kl"]) > 0.02  # measured 0.076
    # the advantages train Tinker's built-in importance_sampling, one call per step
    assert [c.loss_fn for c in sent(server, "ForwardBackward")[n_fb:]] == ["importance_sampling"] * 4


def test_a_logit_estimator_is_refused_on_tinker_in_one_line(server, tmp_path, fresh_registry):
    from tempering.errors import ConfigError
    from tempering.training.recipe import Recipe

    with pytest.raises(ConfigError) as info:
        Recipe(
            name="bad",
            output_dir=str(tmp_path / "bad"),
            loggers=[],
            backend={"name": "tinker", "base_model": "tiny_llama"},
            stages=[{"name": "distill", "teacher": "tinker://x/sampler_weights/y", "kl": "full", "dataset": ROWS}],
        ).run()
    assert str(info.value).startswith("stages[0].kl.estimator: 'full' trains on the student's logits")
