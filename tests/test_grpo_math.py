"""GRPO maths: advantages against hand-computed numbers, the loss against hand-computed numbers
and against TRL 1.16's ``GRPOTrainer._compute_loss`` (the oracle) on a tiny in-memory Llama."""

from __future__ import annotations

import math

import pytest
import torch

from tempering.algorithms.grpo.loss import GRPOLoss, aggregate, k3_kl
from tempering.interfaces import AdvantageEstimator, Loss
from tempering.rlmath.advantages import (
    GroupNormAdvantage,
    MeanOnlyAdvantage,
    RLOOAdvantage,
    zero_variance_groups,
)

# --------------------------------------------------------------------------- advantages
# Four groups with arbitrary, interleaved ids and unequal sizes:
#   id 7  : rewards 1, 0, 0.5     mean 0.5, unbiased std 0.5
#   id 40 : rewards 3, 1, 0, 0    mean 1,   unbiased std sqrt(6/3) = sqrt(2)
#   id -2 : rewards 2, 2          zero variance
#   id 5  : reward 4              singleton
GROUP_IDS = torch.tensor([7, 40, -2, 7, 40, 5, 40, -2, 7, 40])
REWARDS = torch.tensor([1.0, 3.0, 2.0, 0.0, 1.0, 4.0, 0.0, 2.0, 0.5, 0.0])

# scale="group": (r - mean_g) / (std_g + 1e-4)
#   0.5 / 0.5001 = 0.99980004, 2 / (1.41421356 + 1e-4) = 1.41411357, -1 / 1.41431356 = -0.70705678
EXPECTED_GROUP = [0.99980004, 1.41411357, 0.0, -0.99980004, 0.0, 0.0, -0.70705678, 0.0, 0.0, -0.70705678]
# scale="batch": batch mean 1.35, sum of squared deviations 17.025, unbiased std sqrt(17.025 / 9) = 1.37537874;
#   (r - mean_g) / 1.37547874: 0.5 -> 0.36350980, 2 -> 1.45403920, 1 -> 0.72701960
EXPECTED_BATCH = [0.36350980, 1.45403920, 0.0, -0.36350980, 0.0, 0.0, -0.72701960, 0.0, 0.0, -0.72701960]
# scale="none" (Dr. GRPO): r - mean_g
EXPECTED_NONE = [0.5, 2.0, 0.0, -0.5, 0.0, 0.0, -1.0, 0.0, 0.0, -1.0]
# RLOO: r_i - mean of the others in the group; group 7: 1 - 0.25, 0 - 0.75, 0.5 - 0.5;
#   group 40: 3 - 1/3, 1 - 3/3, 0 - 4/3; zero-variance group: 0; singleton: 0
EXPECTED_RLOO = [0.75, 2.66666667, 0.0, -0.75, 0.0, 0.0, -1.33333333, 0.0, 0.0, -1.33333333]


@pytest.mark.parametrize(
    ("estimator", "expected"),
    [
        (GroupNormAdvantage(), EXPECTED_GROUP),
        (GroupNormAdvantage(scale="group", eps=1e-4), EXPECTED_GROUP),
        (GroupNormAdvantage(scale="batch"), EXPECTED_BATCH),
        (GroupNormAdvantage(scale="none"), EXPECTED_NONE),
        (MeanOnlyAdvantage(), EXPECTED_NONE),
        (RLOOAdvantage(), EXPECTED_RLOO),
    ],
    ids=["group-default", "group", "batch", "none", "mean-only", "rloo"],
)
def test_advantages_hand_computed(estimator, expected):
    assert isinstance(estimator, AdvantageEstimator)
    adv = estimator(REWARDS, GROUP_IDS)
    assert adv.shape == REWARDS.shape and adv.dtype == REWARDS.dtype
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-6, rtol=0)


def test_advantages_eps_is_added_to_std():
    # eps = 0.5 on group 7 (std 0.5): 0.5 / 1.0 = 0.5 exactly; a sqrt(var + eps) convention gives 0.5 / 0.866
    adv = GroupNormAdvantage(eps=0.5)(torch.tensor([1.0, 0.0, 0.5]), torch.tensor([3, 3, 3]))
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0]))


def test_advantages_float64_and_permutation_invariant():
    perm = torch.tensor([9, 3, 0, 5, 1, 8, 2, 7, 4, 6])
    for est in (GroupNormAdvantage(), GroupNormAdvantage(scale="batch"), RLOOAdvantage()):
        full = est(REWARDS.double(), GROUP_IDS)
        assert full.dtype == torch.float64
        torch.testing.assert_close(est(REWARDS.double()[perm], GROUP_IDS[perm]), full[perm])


def test_advantages_nan_rewards_are_ignored_and_get_zero():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 2.0, 2.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    # group 0's valid rewards are 1 and 0: mean 0.5, unbiased std 0.70710678 -> +-0.5 / 0.70720678
    torch.testing.assert_close(
        GroupNormAdvantage()(rewards, ids), torch.tensor([0.70700680, 0.0, -0.70700680, 0.0, 0.0])
    )
    torch.testing.assert_close(RLOOAdvantage()(rewards, ids), torch.tensor([1.0, 0.0, -1.0, 0.0, 0.0]))
    assert zero_variance_groups(rewards, ids).tolist() == [False, False, False, True, True]


def test_zero_variance_groups():
    mask = zero_variance_groups(REWARDS, GROUP_IDS)
    assert mask.dtype == torch.bool
    # True exactly on the members of group -2 (all equal) and 5 (singleton)
    assert mask.tolist() == [False, False, True, False, False, True, False, True, False, False]


def test_advantages_reject_bad_config_and_shapes():
    with pytest.raises(ValueError, match="scale"):
        GroupNormAdvantage(scale="groups")
    with pytest.raises(ValueError):
        GroupNormAdvantage()(REWARDS, GROUP_IDS[:-1])


# --------------------------------------------------------------------------- loss: by hand
# Ratios r = exp(lp - old) set directly (old = 0), eps 0.2/0.2:
#   row 0, A = +1, r = 1.5, 0.9, 1.0       -> -min(r, clip r) = -1.2, -0.9, -1.0     (1.5 high-clipped)
#   row 1, A = -1, r = 0.5, 2.0, [7.0 pad] ->  max(r, clip r) =  0.8,  2.0          (0.5 low-clipped)
HAND_R = torch.tensor([[1.5, 0.9, 1.0], [0.5, 2.0, 7.0]])
HAND_MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
HAND_ADV = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])


def hand_batch(**extra):
    return {
        "weights": HAND_MASK,
        "sampler_logprobs": torch.zeros(2, 3),
        "advantages": HAND_ADV,
        **extra,
    }


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"loss_type": "grpo"}, 0.18333333),  # (-3.1 / 3 + 2.8 / 2) / 2
        ({"loss_type": "bnpo"}, -0.06),  # -0.3 / 5
        ({"loss_type": "dapo"}, -0.06),  # -0.3 / 5
        ({"loss_type": "dr_grpo", "max_completion_length": 4}, -0.0375),  # -0.3 / (2 * 4)
        ({"loss_type": "dr_grpo"}, -0.05),  # -0.3 / (2 * T), T = 3
        ({"loss_type": "dapo", "delta": 1.5}, -0.16),  # r = 2.0 capped at 1.5 for A < 0: (-3.1 + 2.3) / 5
        ({"loss_type": "dapo", "epsilon_high": 1.0}, -0.12),  # 1.5 no longer clipped: (-3.4 + 2.8) / 5
    ],
    ids=["grpo", "bnpo", "dapo", "dr_grpo-L4", "dr_grpo-default-T", "delta", "eps-high"],
)
def test_loss_hand_computed(kwargs, expected):
    loss = GRPOLoss(**kwargs)
    assert isinstance(loss, Loss) and loss.needs_logits is False and loss.tinker_builtin is None
    out = loss(HAND_R.log(), hand_batch())
    assert out.loss.item() == pytest.approx(expected, abs=1e-6)


def test_loss_hand_gradient_and_metrics():
    lp = HAND_R.log().requires_grad_(True)
    out = GRPOLoss(loss_type="dapo")(lp, hand_batch())
    out.loss.backward()
    # d/d lp of -A r / N is -A r / 5 on unclipped tokens, 0 on clipped and masked ones
    torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -0.18, -0.2], [0.0, 0.4, 0.0]]))
    m = out.metrics
    assert all(isinstance(v, float) for v in m.values())
    assert m["clip_ratio/low_mean"] == pytest.approx(0.2)
    assert m["clip_ratio/high_mean"] == pytest.approx(0.2)
    assert m["clip_ratio/region_mean"] == pytest.approx(0.4)
    assert m["clip_ratio/low_min"] == pytest.approx(0.0)  # row 0 has no low-clipped token
    assert m["clip_ratio/high_max"] == pytest.approx(1 / 3)
    assert m["ratio/mean"] == pytest.approx(1.18)  # (1.5 + 0.9 + 1 + 0.5 + 2) / 5; the masked 7.0 is ignored
    assert m["ratio/max"] == pytest.approx(2.0)
    assert "kl" not in m


def test_k3_kl_and_beta_by_hand():
    # lp = log 0.5, ref = log 0.25: d = log 0.5, k3 = 0.5 - log 0.5 - 1 = 0.19314718
    lp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    assert k3_kl(lp, ref).item() == pytest.approx(0.19314718, abs=1e-7)
    assert k3_kl(lp, lp).item() == 0.0
    batch = {"weights": torch.ones(1, 1), "sampler_logprobs": lp, "advantages": torch.zeros(1, 1), "ref_logprobs": ref}
    out = GRPOLoss(beta=0.5)(lp, batch)  # on-policy: ratio 1, policy term 0
    assert out.loss.item() == pytest.approx(0.5 * 0.19314718, abs=1e-7)
    assert out.metrics["kl"] == pytest.approx(0.19314718, abs=1e-7)
    with pytest.raises(KeyError, match="ref_logprobs"):
        GRPOLoss(beta=0.5)(lp, {k: v for k, v in batch.items() if k != "ref_logprobs"})


def test_masked_positions_cannot_leak():
    # Garbage (huge, inf) on weight-0 positions must not change the loss or make the gradient NaN.
    batch = hand_batch(ref_logprobs=torch.zeros(2, 3))
    clean = GRPOLoss(beta=0.1)(HAND_R.log(), batch).loss
    dirty_batch = dict(batch)
    dirty_batch["sampler_logprobs"] = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, -1e4]])
    dirty_batch["ref_logprobs"] = torch.tensor([[0.0, 0.0, 0.0], [0.0, 0.0, 1e4]])
    lp = HAND_R.log().clone()
    lp[1, 2] = -200.0
    lp.requires_grad_(True)
    dirty = GRPOLoss(beta=0.1)(lp, dirty_batch).loss
    dirty.backward()
    assert dirty.item() == pytest.approx(clean.item(), abs=1e-6)
    assert torch.isfinite(lp.grad).all() and lp.grad[1, 2] == 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_nan_advantage_on_a_masked_position_cannot_leak(loss_type):
    """A failed sample's advantage may be NaN; on weight-0 positions it must change nothing:
    multiplying by the mask would give 0 * NaN = NaN in the loss and in the gradient."""
    clean = GRPOLoss(loss_type=loss_type)(HAND_R.log(), hand_batch()).loss
    adv = HAND_ADV.clone()
    adv[1, 2] = float("nan")
    old = torch.zeros(2, 3)
    old[1, 2] = float("nan")
    lp = HAND_R.log().clone().requires_grad_(True)
    dirty = GRPOLoss(loss_type=loss_type)(lp, hand_batch(advantages=adv, sampler_logprobs=old)).loss
    dirty.backward()
    assert dirty.item() == pytest.approx(clean.item(), abs=1e-6)
    assert torch.isfinite(lp.grad).all() and lp.grad[1, 2] == 0


def test_dapo_num_items_in_batch_makes_microbatches_add_up():
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 5, generator=g)
    batch = {
        "weights": torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0], [1.0, 0, 0, 0, 0]]),
        "sampler_logprobs": lp + 0.3 * torch.randn(4, 5, generator=g),
        "advantages": torch.tensor([1.0, -1.0, 0.5, 2.0]).unsqueeze(1).expand(4, 5),
    }
    full = GRPOLoss(loss_type="dapo")(lp, batch).loss
    n = batch["weights"].sum()
    parts = [
        GRPOLoss(loss_type="dapo")(lp[s], {**{k: v[s] for k, v in batch.items()}, "num_items_in_batch": n}).loss
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-6)
    # without the global count each part is a local token mean and the sum is not the full loss
    local = [
        GRPOLoss(loss_type="dapo")(lp[s], {k: v[s] for k, v in batch.items()}).loss for s in (slice(0, 1), slice(1, 4))
    ]
    assert abs((local[0] + local[1]).item() - full.item()) > 1e-3


def test_aggregate_rejects_unknown_and_config_is_validated():
    with pytest.raises(ValueError):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), "sum")
    with pytest.raises(ValueError, match="loss_type"):
        GRPOLoss(loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        GRPOLoss(importance_sampling_level="seq")


# --------------------------------------------------------------------------- loss: TRL oracle
P, C = 4, 6  # prompt length (no prompt padding), completion width (right-padded)
COMPLETION_LENGTHS = [6, 3, 5, 6, 2, 4]
ROW_ADVANTAGES = [1.3, -0.7, 0.4, -1.6, 0.9, -0.2]
TRL_MAX_COMPLETION_LENGTH = 8  # deliberately != C so that dr_grpo's constant is tested
# old = current + offset: token ratios exp(-offset) of about 0.64 / 0.74 (low-clipped when A < 0), 1.35 / 1.57
# (high-clipped when A > 0) and 0.86 / 1.1 (inside), plus a per-row bias so that sequence-level (GSPO) ratios
# leave the [0.95, 1.05] band too (up for rows 0 and 4 with A > 0, down for rows 1 and 3 with A < 0; rows 2
# and 5 stay inside it).
_BASE_OFFSETS = torch.tensor([0.45, -0.1, -0.45, 0.15, 0.3, -0.3])
OLD_OFFSETS = torch.stack([_BASE_OFFSETS.roll(i) for i in range(6)]) + torch.tensor(
    [-0.15, 0.15, 0.0, 0.1, -0.05, 0.0]
).unsqueeze(1)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """A factory of real TRL 1.16 GRPOTrainers around one saved tiny Llama, plus shared tensors."""
    import trl  # a hard dependency: a missing oracle is a failure, not a skip
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    assert trl.__version__.startswith("1.16"), trl.__version__
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("0123456789+= ")}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    with torch.random.fork_rng():  # a fixed model without touching other tests' global RNG
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)  # beta > 0 makes TRL load a reference from the path
    tokenizer.save_pretrained(path)
    dataset = Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+6="] * 2})

    def make(**kwargs):
        args = trl.GRPOConfig(
            output_dir=str(path / "out"),
            bf16=False,
            use_cpu=True,
            report_to="none",
            per_device_train_batch_size=6,
            num_generations=2,
            gradient_accumulation_steps=1,
            max_completion_length=TRL_MAX_COMPLETION_LENGTH,
            **kwargs,
        )
        trainer = trl.GRPOTrainer(
            model=str(path),
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
        )
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one micro-batch per step
        return trainer

    g = torch.Generator().manual_seed(1)
    B = len(COMPLETION_LENGTHS)
    prompt_ids = torch.randint(2, len(vocab), (B, P), generator=g)
    completion_mask = torch.tensor([[1] * n + [0] * (C - n) for n in COMPLETION_LENGTHS])
    completion_ids = torch.randint(2, len(vocab), (B, C), generator=g) * completion_mask  # pad id 0
    return {
        "make": make,
        "prompt_ids": prompt_ids,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


def our_logprobs(model, full_ids, attention_mask):
    """Per-target-token logprobs in our (B, T = L - 1) layout, in float32."""
    logits = model(input_ids=full_ids[:, :-1], attention_mask=attention_mask[:, :-1]).logits.float()
    return torch.log_softmax(logits, -1).gather(-1, full_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


def to_target_layout(values, completion_mask, pad_value=0.0):
    """(B, C) completion values -> (B, T) target positions; prompt and padding get ``pad_value``."""
    B = values.size(0)
    out = torch.full((B, P + C - 1), pad_value, dtype=torch.float32)
    out[:, P - 1 :] = torch.where(completion_mask.bool(), values.float(), torch.tensor(pad_value))
    return out


ORACLE_CASES = {
    "dapo": ({"loss_type": "dapo", "epsilon_high": 0.28}, {}),
    "grpo": ({"loss_type": "grpo"}, {}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"max_completion_length": TRL_MAX_COMPLETION_LENGTH}),
    "bnpo": ({"loss_type": "bnpo"}, {}),
    "dapo-beta": ({"loss_type": "dapo", "beta": 0.05}, {}),
    "grpo-beta-no-bias-correction": ({"loss_type": "grpo", "beta": 0.05, "use_bias_correction_kl": False}, {}),
    "dr_grpo-beta": ({"loss_type": "dr_grpo", "beta": 0.2}, {"max_completion_length": TRL_MAX_COMPLETION_LENGTH}),
    "dapo-delta": ({"loss_type": "dapo", "delta": 1.25}, {}),
    "grpo-sequence": ({"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05}, {}),
    "grpo-sequence-beta": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05, "beta": 0.1},
        {},
    ),
}


@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_loss_matches_trl_compute_loss(oracle, case):
    trl_kwargs, our_extra = ORACLE_CASES[case]
    trainer = oracle["make"](**trl_kwargs)
    model = trainer.model
    prompt_ids, completion_ids, cmask = oracle["prompt_ids"], oracle["completion_ids"], oracle["completion_mask"]
    B = prompt_ids.size(0)
    full_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention = torch.cat([torch.ones_like(prompt_ids), cmask], 1)

    with torch.no_grad():
        current = our_logprobs(model, full_ids, attention)[:, P - 1 :]  # (B, C) completion logprobs
    old = current + OLD_OFFSETS  # off-policy, so that clipping happens on both sides
    ref = current + 0.5 * torch.randn(current.shape, generator=torch.Generator().manual_seed(2))
    adv = torch.tensor(ROW_ADVANTAGES)

    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": cmask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": cmask.sum(),
    }
    model.zero_grad(set_to_none=True)
    trl_loss = trainer._compute_loss(model, inputs)
    trl_loss.backward()
    trl_grads = [p.grad.detach().clone() for p in model.parameters()]
    trl_metrics = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    # Ours: the same tokens in our layout, with garbage on prompt/padding positions (weight 0).
    batch = {
        "weights": to_target_layout(cmask.float(), cmask),
        "sampler_logprobs": to_target_layout(old, cmask, pad_value=-30.0),
        "advantages": to_target_layout(adv.unsqueeze(1).expand(B, C), cmask, pad_value=5.0),
        "ref_logprobs": to_target_layout(ref, cmask, pad_value=30.0),
    }
    loss_fn = GRPOLoss(
        loss_type=trl_kwargs["loss_type"],
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=trl_kwargs.get("delta"),
        beta=trl_kwargs.get("beta", 0.0),
        importance_sampling_level=trl_kwargs.get("importance_sampling_level", "token"),
        use_bias_correction_kl=trl_kwargs.get("use_bias_correction_kl", True),
        **our_extra,
    )
    model.zero_grad(set_to_none=True)
    out = loss_fn(our_logprobs(model, full_ids, attention), batch)
    out.loss.backward()
    our_grads = [p.grad.detach().clone() for p in model.parameters()]

    loss_diff = abs(out.loss.item() - trl_loss.item())
    grad_diff = max((a - b).abs().max().item() for a, b in zip(our_grads, trl_grads))
    grad_scale = max(b.abs().max().item() for b in trl_grads)
    print(
        f"{case}: loss {out.loss.item():.8f} vs TRL {trl_loss.item():.8f}: |d| {loss_diff:.1e}, grads: "
        f"max|d| {grad_diff:.1e}, max|g| {grad_scale:.1e}"
    )
    assert loss_diff < 1e-5
    assert grad_scale > 1e-3  # a real gradient flows ...
    assert grad_diff < 1e-4 * grad_scale  # ... and it is TRL's, parameter by parameter

    # The test data must exercise clipping (both sides) and both advantage signs.
    assert out.metrics["clip_ratio/low_mean"] > 0 and out.metrics["clip_ratio/high_mean"] > 0
    for key in (
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
    ):
        assert out.metrics[key] == pytest.approx(trl_metrics[key], abs=1e-6), key
    if loss_fn.beta:
        assert out.metrics["kl"] == pytest.approx(trl_metrics["kl"], rel=1e-5)
    if loss_fn.delta is not None:  # the cap must bind somewhere: some A < 0 token with ratio above delta
        ratio = (current - old).exp()
        assert ((ratio > loss_fn.delta) & (adv.unsqueeze(1) < 0) & cmask.bool()).any()
