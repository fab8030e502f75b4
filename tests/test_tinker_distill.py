"""On-policy distillation on the Tinker backend: the real SDK against the local Tinker server
(tests/fake_tinker.py, serving ``tiny_llama``). The teacher is a ``tinker://`` sampler-weights
path -- the cookbook's ``teacher_checkpoint`` -- scored by a sampling client of those weights
(``weights=path``); the sampled-token advantages train Tinker's built-in ``importance_sampling``."""

from __future__ import annotations

import math
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


def _rows(tok) -> list[Datum]:
    rows = []
    for r in ROWS[::10]:
        ids = tok(r["prompt"] + "7")["input_ids"] + [tok.eos_token_id]
        n = len(tok(r["prompt"])["input_ids"])
        rows.append(Datum(ids[:-1], ids[1:], [0.0] * (n - 1) + [0.1] * (len(ids) - n)))
    return rows


def _teacher(server, trained: bool):
    """A backend whose weights are saved on the service as sampler weights: a fresh adapter
    (seed 0: the student's own start) or one trained a few steps to answer 7; and their path."""
    b = make_backend(server, seed=0)
    if trained:
        for _ in range(20):
            b.forward_backward(Batch(_rows(b.tokenizer)), CrossEntropyLoss()).result()
            b.optim_step(AdamParams(learning_rate=1e-1)).result()
    b.snapshot("teacher").result()
    return b, b.snapshots.path(b.snapshots.current()[0])


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
                "prompts_per_step": 4,
                "group_size": 4,
                "max_tokens": 4,
                "optimizer": {"learning_rate": 1e-2},
            }
        ],
    ).run()
    return [r for r in result.history if "loss" in r]


def test_weights_by_path_score_with_those_weights(server, fresh_registry):
    """``logprobs(batch, weights="tinker://...")`` on another backend scores with the weights
    saved at that path: what the trained backend's own forward gives, not the fresh adapter's."""
    trained, path = _teacher(server, trained=True)
    student = make_backend(server, seed=0)
    batch = Batch(_rows(student.tokenizer))
    by_path = student.logprobs(batch, weights=path).result()
    own = trained.logprobs(batch).result()
    fresh = student.logprobs(batch).result()
    close = max(abs(a - b) for x, y in zip(by_path, own) for a, b in zip(x, y))
    apart = max(abs(a - b) for x, y in zip(by_path, fresh) for a, b in zip(x, y))
    print(f"by path vs the trained forward: {close:.1e}; vs the fresh adapter: {apart:.3f}")
    assert close < 1e-4 and apart > 10 * max(close, 1e-6)


def test_a_tinker_path_teacher_is_scored_by_its_own_sampling_client(server, tmp_path, fresh_registry):
    """The distill stage on Tinker with a ``tinker://`` teacher: the student's own starting
    weights as the teacher give a KL of exactly 0 on its first samples; each step is one
    built-in ``importance_sampling`` call."""
    _, start = _teacher(server, trained=False)
    _, trained = _teacher(server, trained=True)
    assert start.startswith("tinker://") and trained.startswith("tinker://")
    n_fb = len(sent(server, "ForwardBackward"))
    same = _distill(tmp_path, "same", start)
    other = _distill(tmp_path, "other", trained)
    assert len(same) == len(other) == 2
    assert same[0]["distill/teacher_kl"] == pytest.approx(0.0, abs=1e-4)
    assert all(math.isfinite(r["distill/teacher_kl"]) and r["distill/teacher_kl"] != 0.0 for r in other)
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
