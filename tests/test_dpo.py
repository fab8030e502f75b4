"""DPO: the loss by hand, against TRL 1.16's ``DPOTrainer`` (the oracle) on the same tiny model
and batch, the reference options of the stage, and a short learning run."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from tempering.algorithms.dpo.algorithm import DPO
from tempering.algorithms.dpo.loss import DPOLoss, pair_sequence_logprobs
from tempering.errors import ConfigError
from tempering.interfaces import Loss
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.plugins.datasets.arithmetic import arithmetic
from tempering.plugins.datasets.synthetic_preferences import synthetic_preferences
from tempering.plugins.models.tiny import tiny_llama
from tempering.training.recipe import Recipe
from tempering.types import AdamParams

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
LORA = {"rank": 4, "alpha": 8}
LN2 = math.log(2.0)


def backend_spec(**kw):
    return {"name": "local", "model": "tiny_llama", "model_kwargs": SMALL, "num_threads": 1, **kw}


# --------------------------------------------------------------------------- loss by hand
def hand_batch():
    """Two pairs over T = 4 target positions; rows 0/1 = pair 0 (chosen, rejected), 2/3 = pair 1.
    Masked positions hold junk (9, 5, -7) that must not matter. Sums over the masked positions:
      pair 0: chosen -3.0 (2 tokens, ref -3.5), rejected -4.0 (2 tokens, ref -3.0)
      pair 1: chosen -1.0 (1 token,  ref -2.0), rejected -6.0 (3 tokens, ref -5.0)
    """
    lp = torch.tensor(
        [
            [9.0, -1.0, -2.0, 0.0],
            [9.0, -1.5, -2.5, 0.0],
            [9.0, 9.0, 9.0, -1.0],
            [9.0, -2.0, -2.0, -2.0],
        ]
    )
    w = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 0], [0, 0, 0, 1], [0, 1, 1, 1]], dtype=torch.float32)
    ref = torch.tensor(
        [
            [-7.0, -1.5, -2.0, 5.0],
            [-7.0, -1.0, -2.0, 5.0],
            [-7.0, -7.0, -7.0, -2.0],
            [-7.0, -1.0, -2.0, -2.0],
        ]
    )
    return lp, {"weights": w, "ref_logprobs": ref}


# logratios: pair 0 chosen -3 - -3.5 = 0.5, rejected -4 - -3 = -1 -> delta 1.5
#            pair 1 chosen -1 - -2 = 1,     rejected -6 - -5 = -1 -> delta 2
def logsig(x):
    return -math.log1p(math.exp(-x))


def test_sequence_sums_ignore_masked_values():
    lp, b = hand_batch()
    s_c, s_r, n_c, n_r = pair_sequence_logprobs(lp, b["weights"])
    assert s_c.tolist() == [-3.0, -1.0] and s_r.tolist() == [-4.0, -6.0]
    assert n_c.tolist() == [2.0, 1.0] and n_r.tolist() == [2.0, 3.0]
    lp2 = torch.where(b["weights"] == 0, torch.full_like(lp, float("nan")), lp)  # NaN on masked slots
    assert torch.isfinite(DPOLoss()(lp2, b).loss)


@pytest.mark.parametrize(
    "kw, expected",
    [
        ({"beta": 0.1}, -(logsig(0.15) + logsig(0.2)) / 2),
        (
            {"beta": 0.5, "label_smoothing": 0.2},
            sum(-0.8 * logsig(0.5 * d) - 0.2 * logsig(-0.5 * d) for d in (1.5, 2)) / 2,
        ),
        (
            {"beta": 0.5, "loss_type": "robust", "label_smoothing": 0.2},
            sum((0.8 * -logsig(0.5 * d) + 0.2 * logsig(-0.5 * d)) / 0.6 for d in (1.5, 2)) / 2,
        ),
        # IPO: per-token log-ratios: pair 0: 0.5/2 - (-1)/2 = 0.75; pair 1: 1/1 - (-1)/3 = 4/3; 1/(2 beta) = 5
        ({"beta": 0.1, "loss_type": "ipo"}, ((0.75 - 5) ** 2 + (4 / 3 - 5) ** 2) / 2),
        # + SFT: token mean NLL over the chosen tokens of the batch: (3 + 1) / 3
        ({"beta": 0.1, "loss_type": "sigmoid_sft"}, -(logsig(0.15) + logsig(0.2)) / 2 + 4 / 3),
        ({"beta": 0.1, "loss_type": "sigmoid_sft", "sft_weight": 0.25}, -(logsig(0.15) + logsig(0.2)) / 2 + 1 / 3),
        ({"beta": 0.1, "loss_type": "ipo", "sft_weight": 1.0}, ((0.75 - 5) ** 2 + (4 / 3 - 5) ** 2) / 2 + 4 / 3),
    ],
    ids=["sigmoid", "cdpo", "robust", "ipo", "sigmoid_sft", "sft_weight", "ipo_sft"],
)
def test_loss_hand_computed(kw, expected):
    lp, b = hand_batch()
    out = DPOLoss(**kw)(lp, b)
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)
    beta = kw["beta"]
    m = out.metrics
    assert m["rewards/chosen"] == pytest.approx(beta * 0.75, abs=1e-6)
    assert m["rewards/rejected"] == pytest.approx(-beta, abs=1e-6)
    assert m["rewards/margins"] == pytest.approx(beta * 1.75, abs=1e-6)
    assert m["rewards/accuracies"] == 1.0
    assert m["logps/chosen"] == pytest.approx(-2.0) and m["logps/rejected"] == pytest.approx(-5.0)


def test_loss_gradient_by_hand_and_reference_gets_none():
    lp, b = hand_batch()
    lp.requires_grad_(True)
    b["ref_logprobs"].requires_grad_(True)
    DPOLoss(beta=0.1)(lp, b).loss.backward()
    # d/d lp_chosen of -log sig(beta d) / N = -beta sig(-beta d) / N on the chosen tokens, + for rejected
    g0 = -0.1 * (1 - 1 / (1 + math.exp(-0.15))) / 2
    g1 = -0.1 * (1 - 1 / (1 + math.exp(-0.2))) / 2
    expected = torch.tensor([[0, g0, g0, 0], [0, -g0, -g0, 0], [0, 0, 0, g1], [0, -g1, -g1, -g1]])
    torch.testing.assert_close(lp.grad, expected.float(), atol=1e-7, rtol=0)
    assert b["ref_logprobs"].grad is None


def test_loss_config_and_layout_errors():
    assert isinstance(DPOLoss(), Loss)
    for bad in (
        {"loss_type": "hinge"},
        {"beta": 0.0},
        {"label_smoothing": 0.5},
        {"loss_type": "ipo", "label_smoothing": 0.1},
    ):
        with pytest.raises(ValueError):
            DPOLoss(**bad)
    lp, b = hand_batch()
    with pytest.raises(ValueError, match="interleaved"):
        DPOLoss()(lp[:3], {k: v[:3] for k, v in b.items()})
    with pytest.raises(KeyError, match="ref_logprobs"):
        DPOLoss()(lp, {"weights": b["weights"]})


# --------------------------------------------------------------------------- synthetic data
def test_synthetic_preferences_split_and_kinds():
    train = synthetic_preferences(split="train", size=200)
    test = synthetic_preferences(split="test")
    assert train == synthetic_preferences(split="train", size=200)  # deterministic
    assert [r["prompt"] for r in test] == [r["prompt"] for r in arithmetic(split="test")]
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    for r in train:
        assert r["chosen"] == r["answer"] == str(eval(r["prompt"][:-1]))
        assert r["rejected"] != r["chosen"]
    wrong = synthetic_preferences(size=50, rejected="wrong")
    assert all(r["rejected"].isdigit() and abs(int(r["rejected"]) - int(r["chosen"])) <= 10 for r in wrong)
    bad = synthetic_preferences(size=50, rejected="malformed")
    assert all(r["chosen"] in r["rejected"] or r["chosen"].startswith(r["rejected"]) for r in bad)
    with pytest.raises(ValueError):
        synthetic_preferences(rejected="nope")


# --------------------------------------------------------------------------- oracle: TRL DPOTrainer
@pytest.fixture(scope="module")
def trl():
    import trl  # a hard dependency: a missing oracle is a failure, not a skip

    assert trl.__version__.startswith("1.16"), trl.__version__
    return trl


ORACLE_CASES = {
    "sigmoid": ({"loss_type": ["sigmoid"], "beta": 0.1}, {"loss_type": "sigmoid", "beta": 0.1}),
    "ipo": ({"loss_type": ["ipo"], "beta": 0.3}, {"loss_type": "ipo", "beta": 0.3}),
    "robust": (
        {"loss_type": ["robust"], "beta": 0.2, "label_smoothing": 0.1},
        {"loss_type": "robust", "beta": 0.2, "label_smoothing": 0.1},
    ),
    "sigmoid_sft": (
        {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5], "beta": 0.1},
        {"loss_type": "sigmoid_sft", "beta": 0.1, "sft_weight": 0.5},
    ),
}
METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


def _trl_loss(trl, tmp_path, model, ref_model, tokenizer, rows, trl_kwargs, peft_config=None, adapter=None):
    """TRL's loss, metrics, gradients and tokenisation for ``rows`` as one batch. With
    ``peft_config`` TRL wraps ``model`` in a *new* adapter (so its reference is the adapter
    disabled), into which ``adapter`` (our trained LoRA tensors) is then loaded."""
    from datasets import Dataset

    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=len(rows),
        **trl_kwargs,
    )
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=ref_model,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    if adapter is not None:
        params = dict(trainer.model.named_parameters())
        assert set(adapter) <= set(params), sorted(set(adapter) - set(params))[:3]
        with torch.no_grad():
            for name, value in adapter.items():
                params[name].copy_(value)
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    ds = trainer.train_dataset
    inputs = trainer.data_collator([ds[i] for i in range(len(rows))])
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    tokens = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in ds]
    return float(loss.detach()), metrics, grads, tokens


def _policy_moved(backend: LocalBackend, rows) -> None:
    """A few SFT-ish steps on the rejected answers, so that policy != reference."""
    from tempering.algorithms.sft.loss import CrossEntropyLoss

    batch = DPO().build_batch(backend.tokenizer, rows)
    for _ in range(3):
        backend.forward_backward(batch, CrossEntropyLoss()).result()
        backend.optim_step(AdamParams(learning_rate=2e-2)).result()


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
@pytest.mark.parametrize("case", sorted(ORACLE_CASES))
def test_loss_matches_trl_dpo_trainer(trl, tmp_path, case, lora):
    trl_kwargs, our_kwargs = ORACLE_CASES[case]
    rows = synthetic_preferences(size=6, rejected="mixed")  # unequal chosen/rejected lengths
    ours = LocalBackend(model="tiny_llama", model_kwargs=SMALL, lora=lora, num_threads=1, threaded=False)
    _policy_moved(ours, rows)
    batch = DPO().build_batch(ours.tokenizer, rows)
    for d, lp in zip(batch.data, ours.logprobs(batch, reference=True).result()):
        d.extra["ref_logprobs"] = lp
    ours.model.zero_grad(set_to_none=True)
    out = ours.forward_backward(batch, DPOLoss(**our_kwargs)).result()
    our_grads = {n: p.grad.detach().clone() for n, p in ours.model.named_parameters() if p.grad is not None}

    # TRL sees the very same weights: the moved policy, and as reference the initial model.
    # Full FT: a copy of the policy, ref_model= the initial model. LoRA: the base model with a
    # *new* adapter (peft_config) holding our adapter's values and ref_model=None, so TRL's
    # reference is the adapter disabled. (Handing TRL a PeftModel instead would make it copy
    # the trained adapter as a "ref" adapter: a reference equal to the policy.)
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(
            r=LORA["rank"],
            lora_alpha=LORA["alpha"],
            lora_dropout=0.0,
            target_modules="all-linear",
            task_type="CAUSAL_LM",
        )
        adapter = {n: p.detach().clone() for n, p in ours.model.named_parameters() if p.requires_grad}
        policy, ref_model = tiny_llama(**SMALL, seed=0)[0], None
    else:
        peft_config, adapter = None, None
        policy, ref_model = copy.deepcopy(ours.model), tiny_llama(**SMALL, seed=0)[0]
    trl_loss, trl_metrics, trl_grads, trl_tokens = _trl_loss(
        trl, tmp_path, policy, ref_model, ours.tokenizer, rows, trl_kwargs, peft_config, adapter
    )

    our_tokens = [DPO().encode(ours.tokenizer, r) for r in rows]
    assert [tuple(map(list, t)) for t in our_tokens] == [tuple(map(list, t)) for t in trl_tokens]
    diffs = {"loss": abs(out["loss"] - trl_loss)} | {k: abs(out[k] - trl_metrics[k]) for k in METRICS}
    grad_diff = max((our_grads[n] - trl_grads[n]).abs().max().item() for n in trl_grads)
    print(
        f"{case}/{'lora' if lora else 'full'}: loss {out['loss']:.8f} vs TRL {trl_loss:.8f}; max |diff| "
        f"loss/metrics {max(diffs.values()):.1e}, grads {grad_diff:.1e}"
    )
    assert set(our_grads) == set(trl_grads)
    assert abs(out["rewards/chosen"]) > 1e-3 and abs(out["rewards/rejected"]) > 1e-3  # policy != reference
    assert max(diffs.values()) < 1e-5, diffs
    assert grad_diff < 1e-5


def test_first_loss_is_ln2_at_init_like_trl(trl, tmp_path):
    rows = synthetic_preferences(size=8)
    model, tok = tiny_llama(**SMALL, seed=0)
    trl_loss, _trl_metrics, _, _ = _trl_loss(
        trl, tmp_path, model, tiny_llama(**SMALL, seed=0)[0], tok, rows, {"loss_type": ["sigmoid"]}
    )
    assert trl_loss == pytest.approx(LN2, abs=1e-6)
    for reference in ("live", "precomputed"):
        res = Recipe(
            name="ln2",
            output_dir=str(tmp_path / reference),
            loggers=[],
            backend=backend_spec(),
            stages=[
                {
                    "name": "dpo",
                    "steps": 1,
                    "batch_size": 8,
                    "reference": reference,
                    "dataset": {"name": "synthetic_preferences", "size": 8},
                }
            ],
        ).run()
        first = res.history[0]
        assert first["loss"] == pytest.approx(LN2, abs=1e-6), reference
        assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6)


# --------------------------------------------------------------------------- the stage's references
def _dpo_recipe(tmp_path, name, dpo_kwargs, warmup_steps=0, steps=4, **top):
    stages = []
    if warmup_steps:
        stages.append(
            {
                "id": "warmup",
                "name": "sft",
                "steps": warmup_steps,
                "batch_size": 16,
                "optimizer": {"learning_rate": 1e-2},
                "dataset": {"name": "arithmetic", "size": 64},
            }
        )
    stages.append(
        {
            "id": "pref",
            "name": "dpo",
            "steps": steps,
            "batch_size": 8,
            "optimizer": {"learning_rate": 1e-2},
            "dataset": {"name": "synthetic_preferences", "size": 32},
            **dpo_kwargs,
        }
    )
    return Recipe(name=name, output_dir=str(tmp_path / name), loggers=[], backend=backend_spec(), stages=stages, **top)


def _losses(res, stage="pref"):
    return [r["loss"] for r in res.history if r["stage"] == stage and "loss" in r]


def test_precomputed_reference_equals_live(tmp_path):
    live = _losses(_dpo_recipe(tmp_path, "live", {"reference": "live"}).run())
    pre = _losses(_dpo_recipe(tmp_path, "pre", {"reference": "precomputed"}).run())
    assert len(live) == 4 and live[-1] < live[0]
    assert pre == pytest.approx(live, abs=1e-6)
    cache = json.loads((tmp_path / "pre" / "dpo" / "pref_reference.json").read_text())
    assert len(cache) == 32 and len(cache[0]) == 2  # (chosen, rejected) per example


@pytest.mark.parametrize("reference", ["live", "precomputed"])
def test_stage_start_reference_after_an_sft_stage(tmp_path, reference):
    """After SFT the backend's base reference is the untrained model, so DPO starts far from
    ln 2; with ``reference_model: stage_start`` (the default) the reference is the SFT model:
    exactly ln 2."""
    start = _dpo_recipe(
        tmp_path,
        f"start_{reference}",
        {"reference": reference, "reference_model": "stage_start"},
        warmup_steps=5,
        steps=3,
    ).run()
    base = _dpo_recipe(
        tmp_path, f"base_{reference}", {"reference": reference, "reference_model": "base"}, warmup_steps=5, steps=1
    ).run()
    s, b = _losses(start), _losses(base)
    assert s[0] == pytest.approx(LN2, abs=1e-6)
    assert abs(b[0] - LN2) > 1e-3
    assert s[-1] < s[0]


def test_stage_config_errors_name_the_key(tmp_path):
    for bad, match in (
        ({"reference": "cached"}, r"stages\[0\].reference"),
        ({"reference_model": "x"}, "reference_model"),
        ({"batch_size": 0}, "batch_size"),
        ({"loss": {"name": "dpo", "bta": 0.1}}, r"stages\[0\].loss.bta"),
    ):
        with pytest.raises(ConfigError, match=match):
            _dpo_recipe(tmp_path, "bad", bad).run()
    # checked before an earlier stage trains
    with pytest.raises(ConfigError, match=r"stages\[1\].reference"):
        _dpo_recipe(tmp_path, "bad1", {"reference": "cached"}, warmup_steps=50).run()
    assert not (tmp_path / "bad1" / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"stages\[0\].chosen_key: rows have no .preferred."):
        _dpo_recipe(tmp_path, "bad2", {"chosen_key": "preferred"}).run()


# --------------------------------------------------------------------------- learning
def held_out_metrics(backend: LocalBackend, rows, beta: float) -> dict[str, float]:
    batch = DPO().build_batch(backend.tokenizer, rows)
    for d, lp in zip(batch.data, backend.logprobs(batch, reference=True).result()):
        d.extra["ref_logprobs"] = lp
    tensors = batch.to_tensors(backend.pad_token_id)
    policy = torch.tensor(
        [lp + [0.0] * (tensors["weights"].shape[1] - len(lp)) for lp in backend.logprobs(batch).result()]
    )
    return DPOLoss(beta=beta)(policy, tensors).metrics


@pytest.mark.slow
def test_margin_grows_on_a_tiny_preference_task(tmp_path):
    backend = LocalBackend(model="tiny_llama", model_kwargs=SMALL, num_threads=1)
    test_rows = synthetic_preferences(split="test", size=200)
    before = held_out_metrics(backend, test_rows, 0.1)
    res = Recipe(
        name="margin",
        output_dir=str(tmp_path / "margin"),
        loggers=[],
        stages=[
            {
                "name": "dpo",
                "steps": 60,
                "batch_size": 16,
                "optimizer": {"learning_rate": 3e-3},
                "loss": {"name": "dpo", "beta": 0.1},
                "dataset": {"name": "synthetic_preferences", "size": 256},
            }
        ],
    ).run(backend=backend)
    after = held_out_metrics(backend, test_rows, 0.1)
    rows = [r for r in res.history if "rewards/margins" in r]
    first, last = rows[0], rows[-10:]
    margin = sum(r["rewards/margins"] for r in last) / len(last)
    acc = sum(r["rewards/accuracies"] for r in last) / len(last)
    loss = sum(r["loss"] for r in last) / len(last)
    print(
        f"DPO 60 steps: train margin {first['rewards/margins']:.3f} -> {margin:.3f}, accuracy -> {acc:.2f}, "
        f"loss {first['loss']:.4f} -> {loss:.4f}; held-out margin {before['rewards/margins']:.3f} -> "
        f"{after['rewards/margins']:.3f}, "
        f"accuracy {before['rewards/accuracies']:.2f} -> {after['rewards/accuracies']:.2f}"
    )
    assert first["rewards/margins"] == pytest.approx(0.0, abs=1e-6) and first["loss"] == pytest.approx(LN2, abs=1e-6)
    assert before["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    assert margin > 0.2 and acc > 0.6 and loss < LN2 - 0.1
    assert after["rewards/margins"] > 0.2 and after["rewards/accuracies"] > 0.6
