"""Off-policy RL: the losses against hand computations and Tinker's documented formulas, the
ratio / ESS diagnostics, sampler-matched (tempered) scoring, advantage capping, the local
backend's sampling snapshots, the asynchronous rollout producer (staleness bound, streaming,
re-sampling, errors) and the ``offpolicy`` stage (config checks, metrics, resume).

Everything here is fast (fakes or a ~20k-parameter Llama); the learning comparison is in
``tests/test_offpolicy_learning.py``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.algorithms.offpolicy.loss import CISPOLoss, ClippedISLoss, PPOLoss, TISLoss
from tempering.errors import ConfigError
from tempering.interfaces import Loss, model_renderer
from tempering.rlmath.advantage_cap import AdvantageCap, cap_advantages
from tempering.rlmath.aggregation import fold_normaliser
from tempering.rlmath.diagnostics import ratio_stats
from tempering.rlmath.policy_loss import importance_sampling_loss
from tempering.rollouts.async_rollout import AsyncRollouts, StalenessError, sampler_of
from tempering.rollouts.data import ExampleStream
from tempering.rollouts.scoring import RewardRunner
from tempering.testing import FakeBackend
from tempering.training.evaluate import completion_sampler
from tempering.training.recipe import Recipe, read_progress
from tempering.training.stale import OffPolicyObjective, Staleness, StaleRollouts, sampling_logprobs
from tempering.types import AdamParams, Batch, Datum, SamplingParams

LN = math.log

# --------------------------------------------------------------------------- hand-computed losses
# One row: a prompt position (weight 0, with values that must not matter) and three completion
# tokens with sampler logprobs q = 0, so lp = log(rho) and rho = (1.5, 0.5, 1.1); A = (1, -2, 0.5).
RHO = [1.5, 0.5, 1.1]
ADV = [1.0, -2.0, 0.5]


def hand_batch(prompt_lp: float = 50.0, prompt_adv: float = 7.0):
    lp = torch.tensor([[prompt_lp, LN(1.5), LN(0.5), LN(1.1)]], requires_grad=True)
    batch = {
        "weights": torch.tensor([[0.0, 1.0, 1.0, 1.0]]),
        "sampler_logprobs": torch.zeros(1, 4),
        "advantages": torch.tensor([[prompt_adv, *ADV]]),
    }
    return lp, batch


def loss_and_grad(loss, lp, batch):
    out = loss(lp, batch)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return float(out.loss.detach()), grad[0].tolist(), out.metrics


@pytest.mark.parametrize(
    ("loss", "value", "grad", "clipped"),
    [
        # PPO 0.8/1.2: min(rho A, clip(rho) A) = min(1.5, 1.2) + min(-1.0, -1.6) + min(.55, .55) = 0.15;
        # tokens 1-2 are on the clipped branch (no gradient), token 3: d(-rho A)/d lp = -0.55
        (PPOLoss(), -0.15, [0.0, 0.0, 0.0, -0.55], 2 / 3),
        # the recipe's loss is PPO's formula (its advantage cap is applied by the stage, not here)
        (ClippedISLoss(), -0.15, [0.0, 0.0, 0.0, -0.55], 2 / 3),
        # PPO 0.4/1.6: nothing clipped: -(1.5 - 1.0 + 0.55) = -1.05, gradient -rho A
        (PPOLoss(clip_low_threshold=0.4, clip_high_threshold=1.6), -1.05, [0.0, -1.5, 1.0, -0.55], 0.0),
        # CISPO 0/4: coefficient rho: -(1.5*1*ln1.5 + 0.5*-2*ln0.5 + 1.1*.5*ln1.1) = -1.3537662
        (CISPOLoss(), -(1.5 * LN(1.5) + 1.0 * LN(2.0) + 0.55 * LN(1.1)), [0.0, -1.5, 1.0, -0.55], 0.0),
        # CISPO 0.8/1.2: coefficients (1.2, 0.8, 1.1)
        (
            CISPOLoss(clip_low_threshold=0.8, clip_high_threshold=1.2),
            -(1.2 * LN(1.5) + 1.6 * LN(2.0) + 0.55 * LN(1.1)),
            [0.0, -1.2, 1.6, -0.55],
            2 / 3,
        ),
        # TIS C=1.2: coefficients (1.2, 0.5, 1.1)
        (TISLoss(truncation=1.2), -(1.2 * LN(1.5) + 1.0 * LN(2.0) + 0.55 * LN(1.1)), [0.0, -1.2, 1.0, -0.55], 1 / 3),
    ],
    ids=["ppo", "clipped_is", "ppo-wide", "cispo", "cispo-clipped", "tis"],
)
def test_losses_match_hand_computations(loss, value, grad, clipped):
    assert isinstance(loss, Loss)
    lp, batch = hand_batch()
    got, g, metrics = loss_and_grad(loss, lp, batch)
    assert got == pytest.approx(value, abs=1e-5)
    assert g == pytest.approx(grad, abs=1e-5)  # the weight-0 position gets no gradient
    assert metrics["ratio/clipped_frac"] == pytest.approx(clipped)
    assert metrics["ratio/max"] == pytest.approx(1.5) and metrics["ratio/min"] == pytest.approx(0.5)


def test_importance_sampling_hand_computed_and_same_as_the_registered_one(fresh_registry):
    lp, batch = hand_batch()
    ratio = torch.exp(lp - batch["sampler_logprobs"])
    value = importance_sampling_loss(ratio, batch["advantages"], batch["weights"])
    assert float(value.detach()) == pytest.approx(-1.05, abs=1e-6)  # -(1.5 - 1.0 + 0.55)
    registered = fresh_registry.build("loss", "importance_sampling")  # sdft's, used for the naive runs
    got, g, _ = loss_and_grad(registered, lp, batch)
    assert got == pytest.approx(-1.05, abs=1e-5) and g == pytest.approx([0.0, -1.5, 1.0, -0.55], abs=1e-5)


def test_sequence_level_ratio_hand_computed():
    # rho_seq = exp(mean log rho) = (1.5 * 0.5 * 1.1) ** (1/3) = 0.9378887; inside PPO's clip? no
    # (< 0.8 is false, > 1.2 false), so the loss is -rho_seq * sum(A) = -0.9378887 * -0.5
    lp, batch = hand_batch()
    loss = PPOLoss(level="sequence")
    assert loss.tinker_builtin is None and loss.tinker_loss_fn_config is None  # custom on Tinker
    got, g, _ = loss_and_grad(loss, lp, batch)
    rho_seq = (1.5 * 0.5 * 1.1) ** (1 / 3)
    assert got == pytest.approx(0.5 * rho_seq, abs=1e-6)
    # d/d lp_t of -rho_seq * sum(A) = -rho_seq * sum(A) / 3 for every completion token
    assert g == pytest.approx([0.0] + [0.5 * rho_seq / 3] * 3, abs=1e-6)


def test_builtins_and_their_thresholds():
    assert (PPOLoss().tinker_builtin, PPOLoss().tinker_loss_fn_config) == (
        "ppo",
        {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    )
    assert (CISPOLoss().tinker_builtin, CISPOLoss().tinker_loss_fn_config) == (
        "cispo",
        {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    )
    assert (TISLoss(truncation=3.0).tinker_builtin, TISLoss(truncation=3.0).tinker_loss_fn_config) == (
        "cispo",
        {"clip_low_threshold": 0.0, "clip_high_threshold": 3.0},
    )
    assert ClippedISLoss().tinker_builtin == "ppo" and ClippedISLoss().advantage_cap == 3.0
    assert PPOLoss().advantage_cap is None
    matched = OffPolicyObjective(PPOLoss(), temperature=0.7)
    assert matched.needs_logits and matched.tinker_builtin is None
    plain = OffPolicyObjective(CISPOLoss())
    assert (
        not plain.needs_logits
        and plain.tinker_builtin == "cispo"
        and plain.tinker_loss_fn_config["clip_high_threshold"] == 4.0
    )
    for bad in (
        lambda: PPOLoss(clip_low_threshold=1.1),
        lambda: CISPOLoss(clip_low_threshold=2, clip_high_threshold=1),
        lambda: TISLoss(truncation=0),
        lambda: PPOLoss(level="word"),
        lambda: PPOLoss(advantage_cap=-1),
    ):
        with pytest.raises(ValueError):
            bad()


def tinker_builtin_loss(
    name: str, config: dict, rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Tinker's documented formulas (docs tinker/losses: importance-sampling, ppo, cispo),
    literally, per datum (``target_logprobs``, ``sampling_logprobs``, ``advantages``; no mask),
    summed over the batch."""
    total = 0.0
    for target_logprobs, sampling_logprobs_, advantages in rows:
        prob_ratio = torch.exp(target_logprobs - sampling_logprobs_)
        if name == "importance_sampling":
            loss = -(prob_ratio * advantages).sum()
        elif name == "ppo":
            clipped_ratio = torch.clamp(prob_ratio, config["clip_low_threshold"], config["clip_high_threshold"])
            unclipped_objective = prob_ratio * advantages
            clipped_objective = clipped_ratio * advantages
            ppo_objective = torch.min(unclipped_objective, clipped_objective)
            loss = -ppo_objective.sum()
        elif name == "cispo":
            clipped_ratio = torch.clamp(prob_ratio, config["clip_low_threshold"], config["clip_high_threshold"])
            cispo_objective = clipped_ratio.detach() * target_logprobs * advantages
            loss = -cispo_objective.sum()
        else:
            raise AssertionError(name)
        total = total + loss
    return total


@pytest.mark.parametrize(
    "loss",
    [
        PPOLoss(),
        PPOLoss(clip_high_threshold=1.28),
        CISPOLoss(),
        TISLoss(),
        ClippedISLoss(),
        CISPOLoss(clip_low_threshold=0.5, clip_high_threshold=1.5),
    ],
    ids=["ppo", "ppo-dapo", "cispo", "tis", "clipped_is", "cispo-custom"],
)
def test_each_loss_is_its_tinker_builtin_exactly(loss):
    """On a batch as the stage prepares it (normaliser folded in, A = q = 0 off the mask, as the
    Tinker backend sends it), our loss equals the built-in's documented formula: value and
    gradient. The ratios straddle every threshold."""
    gen = torch.Generator().manual_seed(0)
    lengths, n_prompt = [5, 3, 6], 2
    lp_rows, q_rows, a_rows, w_rows = [], [], [], []
    for n in lengths:
        w = torch.tensor([0.0] * n_prompt + [1.0] * n)
        q = torch.randn(n_prompt + n, generator=gen) * 0.5 - 1.0
        lp = q + torch.randn(n_prompt + n, generator=gen)  # ratios from ~0.1 to ~10
        a = torch.randn(n_prompt + n, generator=gen) / 14  # already token-mean folded
        lp_rows.append(lp), q_rows.append(q * w), a_rows.append(a * w), w_rows.append(w)
    width = max(len(r) for r in lp_rows)

    def pad(rows, value=0.0):
        return torch.stack([torch.cat([r, torch.full((width - len(r),), value)]) for r in rows])

    ours_lp = pad(lp_rows).requires_grad_(True)
    out = loss(ours_lp, {"weights": pad(w_rows), "sampler_logprobs": pad(q_rows), "advantages": pad(a_rows)})
    (g_ours,) = torch.autograd.grad(out.loss, ours_lp)

    theirs_lp = [r.clone().requires_grad_(True) for r in lp_rows]
    ref = tinker_builtin_loss(loss.tinker_builtin, loss.tinker_loss_fn_config, list(zip(theirs_lp, q_rows, a_rows)))
    g_theirs = torch.autograd.grad(ref, theirs_lp)
    assert float(out.loss.detach()) == pytest.approx(float(ref.detach()), abs=1e-6)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(g_ours[i, : n_prompt + n], g_theirs[i], atol=1e-6, rtol=0)
    rho = torch.exp(torch.cat([(lp - q)[n_prompt:] for lp, q in zip(lp_rows, q_rows)]))
    low, high = loss.tinker_loss_fn_config["clip_low_threshold"], loss.tinker_loss_fn_config["clip_high_threshold"]
    assert (rho > high).any() and (rho < 1).any() and (low == 0 or (rho < low).any())


@pytest.mark.parametrize(("loss_type", "aggregation"), [("dapo", "token_mean"), ("grpo", "seq_mean")])
def test_ppo_on_folded_advantages_is_grpo_loss(loss_type, aggregation):
    """PPO (a sum) on advantages times :func:`fold_normaliser` is GRPOLoss (checked against TRL in
    test_grpo_math.py) with the matching aggregation: same value and gradient."""
    gen = torch.Generator().manual_seed(1)
    weights = torch.tensor([[0, 1, 1, 1, 1.0], [0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    q = -torch.rand(3, 5, generator=gen) * 2
    lp0 = q + torch.randn(3, 5, generator=gen) * 0.4
    adv = torch.tensor([[0.7], [-1.2], [0.3]]).expand(3, 5).clone()
    folded = adv * torch.tensor(fold_normaliser(weights.tolist(), aggregation))
    lp_a, lp_b = lp0.clone().requires_grad_(True), lp0.clone().requires_grad_(True)
    ours = PPOLoss()(lp_a, {"weights": weights, "sampler_logprobs": q, "advantages": folded})
    theirs = GRPOLoss(loss_type=loss_type)(lp_b, {"weights": weights, "sampler_logprobs": q, "advantages": adv})
    assert float(ours.loss.detach()) == pytest.approx(float(theirs.loss.detach()), abs=1e-6)
    torch.testing.assert_close(torch.autograd.grad(ours.loss, lp_a)[0], torch.autograd.grad(theirs.loss, lp_b)[0])


def test_fold_normaliser_hand_computed():
    w = [[0, 1, 1, 1], [0, 1]]
    assert fold_normaliser(w, "token_mean") == [[0, 0.25, 0.25, 0.25], [0, 0.25]]
    seq = fold_normaliser(w, "seq_mean")
    assert seq[0] == pytest.approx([0, 1 / 6, 1 / 6, 1 / 6]) and seq[1] == pytest.approx([0, 0.5])
    assert fold_normaliser(w, "sum") == [[0, 1, 1, 1], [0, 1]]
    with pytest.raises(ValueError):
        fold_normaliser(w, "mean")


# --------------------------------------------------------------------------- diagnostics
def test_ratio_stats_hand_computed():
    # rows: rho (1.5, 0.5, 1.1) and (2.0); a masked position holding a huge log-ratio
    log_ratio = torch.tensor([[LN(1.5), LN(0.5), LN(1.1)], [LN(2.0), 80.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0]])
    s = ratio_stats(log_ratio, mask, clipped=torch.tensor([[True, False, False], [True, True, True]]))
    assert s["ratio/mean"] == pytest.approx(5.1 / 4)
    assert s["ratio/max"] == pytest.approx(2.0) and s["ratio/min"] == pytest.approx(0.5)
    assert s["ratio/clipped_frac"] == pytest.approx(0.5)  # 2 of the 4 loss tokens
    # ESS = (sum w)^2 / (n sum w^2) = 5.1^2 / (4 * 7.71) = 0.8433852
    assert s["is/ess"] == pytest.approx(26.01 / 30.84, abs=1e-6)
    # per sequence: w = (0.825, 2.0): 2.825^2 / (2 * (0.680625 + 4)) = 0.8525168
    assert s["is/ess_seq"] == pytest.approx(2.825**2 / (2 * (0.825**2 + 4)), abs=1e-6)
    # k3 KL(q || pi): mean(rho - 1 - log rho)
    kl = sum(r - 1 - LN(r) for r in (1.5, 0.5, 1.1, 2.0)) / 4
    assert s["is/kl"] == pytest.approx(kl, abs=1e-6)
    on_policy = ratio_stats(torch.zeros(2, 3), mask)
    assert on_policy["is/ess"] == pytest.approx(1.0) and on_policy["is/kl"] == pytest.approx(0.0)
    # one dominating weight: ESS -> 1/n, without overflow
    assert ratio_stats(torch.tensor([[300.0, 0.0, 0.0, 0.0]]), torch.ones(1, 4))["is/ess"] == pytest.approx(0.25)


# --------------------------------------------------------------------------- advantage cap
def test_cap_advantages_and_running_mean_hand_computed():
    weights = [[0, 1, 1], [0, 1, 1]]
    rows, n = cap_advantages([[9.0, 1.0, -5.0], [9.0, 0.5, 3.0]], weights, 2.0)
    assert (rows, n) == ([[9.0, 1.0, -2.0], [9.0, 0.5, 2.0]], 2)  # off-mask 9 untouched

    cap = AdvantageCap(multiple=2.0, momentum=0.5)
    # batch 1: non-zero |A| on the mask: 1, 1, 4 -> mean 2 -> cap 4: nothing above it (0 ignored)
    rows, m = cap([[0.0, 1.0, -1.0], [0.0, 4.0, 0.0]], weights)
    assert rows == [[0.0, 1.0, -1.0], [0.0, 4.0, 0.0]] and m == {"advantage/cap": 4.0, "advantage/capped_frac": 0.0}
    # batch 2: |A| 1, 1, 5 -> mean 7/3 -> running 0.5 * 2 + 0.5 * 7/3 = 13/6 -> cap 13/3
    rows, m = cap([[0.0, 1.0, -1.0], [0.0, -5.0, 0.0]], weights)
    assert rows[1][1] == pytest.approx(-13 / 3) and m["advantage/capped_frac"] == pytest.approx(1 / 3)
    assert cap.mean == pytest.approx(13 / 6)
    assert AdvantageCap(None)([[5.0]], [[1.0]]) == ([[5.0]], {})


def test_prepare_advantages_caps_then_folds():
    corrections = StaleRollouts(Staleness(aggregation="token_mean"), PPOLoss(), PPOLoss(), SamplingParams(), {}, "s")
    corrections.capper = AdvantageCap(multiple=1.0)
    batch = Batch(
        [
            Datum([1, 2, 3], [2, 3, 4], [0, 1, 1], [0, -1, -1], [0.0, 2.0, 2.0]),
            Datum([1, 2], [2, 3], [0, 1], [0, -1], [0.0, -1.0]),
        ]
    )
    metrics = corrections.prepare(batch)
    # |A| = 2, 2, 1 -> mean 5/3 = cap; 2 -> 5/3; then / N = 3 tokens
    assert batch.data[0].advantages == pytest.approx([0.0, 5 / 9, 5 / 9])
    assert batch.data[1].advantages == pytest.approx([0.0, -1 / 3])
    assert metrics["advantage/capped_frac"] == pytest.approx(2 / 3)


# --------------------------------------------------------------------------- sampler-matched scoring
def test_sampling_logprobs_temperature_top_k_top_p_hand_computed():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))  # one position, probabilities given
    for target, want in [(0, 0.5), (3, 0.05)]:
        lp, kept = sampling_logprobs(logits, torch.tensor([[target]]))
        assert float(lp) == pytest.approx(LN(want)) and bool(kept)
    # T = 0.5: p^2 / sum p^2 -> 0.25 / 0.3650
    lp, _ = sampling_logprobs(logits, torch.tensor([[0]]), temperature=0.5)
    assert float(lp) == pytest.approx(LN(0.25 / (0.25 + 0.09 + 0.0225 + 0.0025)), abs=1e-6)
    # top-k 2: renormalised over {0.5, 0.3}
    lp, kept = sampling_logprobs(logits, torch.tensor([[1]]), top_k=2)
    assert float(lp) == pytest.approx(LN(0.3 / 0.8), abs=1e-6) and bool(kept)
    lp, kept = sampling_logprobs(logits, torch.tensor([[2]]), top_k=2)
    assert not bool(kept) and math.isfinite(float(lp))  # outside the support: flagged, finite
    # top-p 0.7 keeps the smallest top set reaching 0.7: {0.5, 0.3} -> 0.5 / 0.8
    lp, kept = sampling_logprobs(logits, torch.tensor([[0]]), top_p=0.7)
    assert float(lp) == pytest.approx(LN(0.625), abs=1e-6) and bool(kept)
    # greedy sampling (T = 0) records untempered logprobs: nothing to match
    lp, _ = sampling_logprobs(logits, torch.tensor([[0]]), temperature=0.0, top_k=1)
    assert float(lp) == pytest.approx(LN(0.5))


SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}


def small_backend(**kwargs):
    from tempering.plugins.backends.local.backend import LocalBackend

    return LocalBackend(model_kwargs=SMALL, num_threads=1, **kwargs)


@pytest.fixture(scope="module")
def scoring_backend():
    b = small_backend()
    yield b
    b.close()


def prompts_of(backend, *texts):
    return [backend.tokenizer.encode(t) for t in texts]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(0.6, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8)])
def test_on_policy_ratio_is_one_only_when_scored_like_the_sampler(scoring_backend, temperature, top_k, top_p):
    """The local sampler records logprobs of the tempered / filtered distribution it drew from;
    scoring the same weights with matching settings gives rho = 1, the plain T = 1 score does not."""
    b = scoring_backend
    params = SamplingParams(max_tokens=5, temperature=temperature, top_k=top_k, top_p=top_p, seed=3)
    groups = b.sample(prompts_of(b, "12+34=", "7+8=", "99+1="), 4, params).result()
    batch = Batch([Datum.from_completion(c, advantage=0.5) for g in groups for c in g])
    matched = b.forward_backward(batch, OffPolicyObjective(PPOLoss(), temperature, top_k, top_p)).result()
    assert matched["ratio/max"] == pytest.approx(1.0, abs=2e-4) and matched["ratio/min"] == pytest.approx(1.0, abs=2e-4)
    assert matched["is/filtered_frac"] == 0.0 and matched["is/ess"] == pytest.approx(1.0, abs=1e-6)
    plain = b.forward_backward(batch, OffPolicyObjective(PPOLoss())).result()  # untempered scoring
    assert max(abs(math.log(plain["ratio/max"])), abs(math.log(plain["ratio/min"]))) > 0.01


# --------------------------------------------------------------------------- local sampling snapshots
def ce_batch(backend, texts):
    rows = []
    for t in texts:
        ids = backend.tokenizer.encode(t) + [backend.tokenizer.eos_token_id]
        rows.append(Datum(ids[:-1], ids[1:], [0.0] + [1.0] * (len(ids) - 2)))
    return Batch(rows)


class CE:
    needs_logits, tinker_builtin = False, None

    def __call__(self, logprobs, batch):
        from tempering.interfaces import LossOutput

        return LossOutput(-(logprobs * batch["weights"]).sum() / batch["weights"].sum())


def test_sampling_client_is_a_frozen_snapshot():
    b = small_backend()
    try:
        prompts = prompts_of(b, "12+34=", "5+5=")
        params = SamplingParams(max_tokens=4, seed=11)
        live_before = b.sample(prompts, 3, params).result()
        client0 = b.sampling_client().result()
        first = client0.sample(prompts, 3, params).result()
        b.forward_backward(ce_batch(b, ["12+34=46", "5+5=10"]), CE())
        b.optim_step(AdamParams(learning_rate=0.05))
        client1 = b.sampling_client().result()  # queued after the step: sees the new weights
        again = client0.sample(prompts, 3, params).result()
        new = client1.sample(prompts, 3, params).result()
        live_after = b.sample(prompts, 3, params).result()

        def flat(groups, key):
            values = [getattr(c, key) for g in groups for c in g]
            return [x for v in values for x in v] if key != "policy_version" else values

        assert flat(first, "tokens") == flat(live_before, "tokens")
        assert flat(first, "logprobs") == pytest.approx(flat(live_before, "logprobs"), abs=1e-5)
        assert flat(again, "logprobs") == flat(first, "logprobs")  # the old snapshot did not move
        assert set(flat(first, "policy_version")) == {0} and set(flat(new, "policy_version")) == {1}
        assert flat(new, "tokens") == flat(live_after, "tokens")
        assert flat(new, "logprobs") == pytest.approx(flat(live_after, "logprobs"), abs=1e-5)
        assert flat(new, "logprobs") != pytest.approx(flat(first, "logprobs"), abs=1e-3)  # weights changed
    finally:
        b.close()


def test_sampling_client_runs_while_the_trainer_is_busy():
    b = small_backend()
    try:
        client = b.sampling_client().result()
        gate = threading.Event()
        blocker = b._submit(gate.wait, 30)  # the training thread is now busy
        live = b.sample(prompts_of(b, "1+1="), 2, SamplingParams(max_tokens=3))  # queued behind it
        out = client.sample(prompts_of(b, "1+1="), 2, SamplingParams(max_tokens=3)).result(timeout=30)
        assert len(out[0]) == 2 and not blocker.done() and not live.done()
        gate.set()
        assert len(live.result(timeout=30)[0]) == 2
    finally:
        gate.set()
        b.close()


@pytest.mark.parametrize("kwargs", [{"threaded": False}, {"lora": {"rank": 2, "alpha": 4}}], ids=["unthreaded", "lora"])
def test_sampling_client_unthreaded_and_lora(kwargs):
    b = small_backend(**kwargs)
    try:
        client = b.sampling_client().result()
        b.forward_backward(ce_batch(b, ["1+1=2"]), CE())
        b.optim_step(AdamParams(learning_rate=0.05)).result()
        out = client.sample(prompts_of(b, "1+1="), 2, SamplingParams(max_tokens=3, seed=1)).result()
        assert {c.policy_version for c in out[0]} == {0} and b.step == 1
        if "lora" in kwargs:
            assert all("lora" in n for n in client.weights)  # only the adapter is snapshotted
    finally:
        b.close()


# --------------------------------------------------------------------------- the rollout producer
class FakeClient:
    """A sampler of a fake weight version: completions stamped with ``version``, computed on the
    backend's sampling thread (like the local backend's) and returned as a future."""

    def __init__(self, backend, version):
        self.backend, self.version, self.tokenizer = backend, version, backend.tokenizer

    def sample(self, prompts, n, params):
        return self.backend.sampler_thread.submit(self._sample, prompts, n, params)

    def _sample(self, prompts, n, params):
        self.backend.calls.append((self.version, len(prompts), params.seed))
        hook = self.backend.on_sample
        groups = self.backend.sample(prompts, n, params).result()
        version = self.version if hook is None else hook(len(self.backend.calls), self.version)
        for g in groups:
            for c in g:
                c.policy_version = version
        return groups


class VersionedFake(FakeBackend):
    """FakeBackend plus ``sampling_client()``; ``on_sample(call_number, version)`` may return
    another version to stamp (a sampler that failed to reload) or raise."""

    def __init__(self, on_sample=None, **kwargs):
        kwargs.setdefault("complete", lambda prompt, i: ["1", "22", "333"][i % 3])
        super().__init__(**kwargs)
        self.calls: list[tuple[int, int, int | None]] = []
        self.on_sample = on_sample
        self.sampler_thread = ThreadPoolExecutor(1, thread_name_prefix="fake-sampler")

    def sampling_client(self):
        fut = Future()
        fut.set_result(FakeClient(self, self.step))
        return fut


def length_reward(completion, example):
    return float(len(completion))


EXAMPLES = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(40)]


def drive(backend, *, k, fixed=False, steps=6, per_batch=3, chunk=2, pause=0.0, **kwargs):
    """A trainer loop without a model: take each batch, 'step', publish new weights."""
    ro = AsyncRollouts(
        backend,
        ExampleStream(EXAMPLES, seed=0),
        completion_sampler(backend.tokenizer, model_renderer(backend), RewardRunner(length_reward)),
        group_size=3,
        groups_per_batch=per_batch,
        params=SamplingParams(max_tokens=3),
        max_steps_off_policy=k,
        groups_per_sample=chunk,
        fixed_staleness=fixed,
        seed=5,
        last_batch=steps,
        **kwargs,
    )
    batches = []
    ro.start(sampler_of(backend))
    try:
        for step in range(steps):
            if pause:
                time.sleep(pause)  # a slow trainer: the producer runs ahead as far as it may
            rb = ro.next_batch(step, timeout=20)
            batches.append(rb)
            backend.step += 1
            ro.publish(sampler_of(backend), index=step + 1)
    finally:
        ro.close()
    return batches, ro


def test_fixed_staleness_holds_when_the_planner_runs_ahead_of_the_rollouts():
    """With several chunks in flight the planner plans batch b + 1 before batch b's chunks have
    taken their sampler; the weights of step b - k must outlive that (they were dropped, and a
    chunk took newer weights: staleness 1.67 instead of 2 in 14 of 15 runs before the fix)."""
    for _ in range(5):
        batches, _ = drive(VersionedFake(), k=2, fixed=True, chunks_in_flight=3)
        assert [rb.metrics["offpolicy/staleness_mean"] for rb in batches] == [0, 1, 2, 2, 2, 2]


def test_k0_is_synchronous_on_policy():
    backend = VersionedFake()
    batches, _ = drive(backend, k=0)
    assert [rb.metrics["offpolicy/staleness_max"] for rb in batches] == [0.0] * 6
    # each batch (two sample calls: 2 + 1 prompts) waited for the weights of its own step
    assert [v for v, _, _ in backend.calls] == [b for b in range(6) for _ in (0, 1)]
    assert batches[-1].metrics["offpolicy/resampled_total"] == 0


def test_fixed_staleness_is_exactly_k_and_reproducible():
    backends = [VersionedFake(), VersionedFake()]
    runs = [drive(b, k=2, fixed=True, pause=0.02) for b in backends]
    for backend, (batches, _) in zip(backends, runs):
        assert [rb.metrics["offpolicy/staleness_mean"] for rb in batches] == [0, 1, 2, 2, 2, 2]
        assert [rb.metrics["offpolicy/staleness_max"] for rb in batches] == [0, 1, 2, 2, 2, 2]
        # batch b is sampled with the weights of step max(0, b - 2), even when newer ones exist
        assert [v for v, _, _ in backend.calls] == [max(0, b - 2) for b in range(6) for _ in (0, 1)]
        assert batches[-1].metrics["offpolicy/resampled_total"] == 0
    assert backends[0].calls == backends[1].calls  # same versions, prompt counts and seeds
    texts = [
        [[s.completion.text for s in g.samples] + [g.example["prompt"]] for rb in b for g in rb.groups] for b, _ in runs
    ]
    assert texts[0] == texts[1]
    # slot order, one example per slot, examples in stream order: batch b holds slots 3b..3b+2
    assert [g.group_id for rb in runs[0][0] for g in rb.groups] == list(range(18))
    assert runs[0][1].position == 18


def test_newest_sampler_within_the_bound_and_sampling_runs_ahead():
    batches, _ = drive(VersionedFake(), k=2, pause=0.05)
    stale = [rb.metrics["offpolicy/staleness_max"] for rb in batches]
    assert max(stale) <= 2 and sum(stale) > 0  # ran ahead of the trainer, never past the bound
    assert all(rb.metrics["offpolicy/resampled"] == 0 for rb in batches)


def test_rewards_stream_per_sample_call_not_per_batch():
    """The second sample call of a batch waits until the first call's samples were scored: if
    rewards were only applied once the whole batch is sampled, it would wait in vain."""
    scored = threading.Event()
    waited = []

    def on_sample(call, version):
        if call == 2:
            waited.append(scored.wait(10))
        return version

    def reward(completion, example):
        scored.set()
        return float(len(completion))

    backend = VersionedFake(on_sample=on_sample)
    ro = AsyncRollouts(
        backend,
        ExampleStream(EXAMPLES),
        completion_sampler(backend.tokenizer, model_renderer(backend), RewardRunner(reward)),
        group_size=2,
        groups_per_batch=3,
        params=SamplingParams(max_tokens=3),
        max_steps_off_policy=0,
        groups_per_sample=1,
    )
    ro.start(sampler_of(backend))
    try:
        rb = ro.next_batch(0, timeout=30)
    finally:
        ro.close()
    assert waited == [True]
    assert all(s.reward == len(s.completion.text) for g in rb.groups for s in g.samples)


def test_a_group_beyond_the_bound_is_resampled_and_counted():
    # the very first sample call returns completions stamped 100 versions old
    batches, _ro = drive(VersionedFake(on_sample=lambda call, v: v - 100 if call == 1 else v), k=1, steps=3, chunk=1)
    first = batches[0]
    assert first.metrics["offpolicy/resampled"] == 1 and first.metrics["offpolicy/resampled_total"] == 1
    assert all(s.completion.policy_version == 0 for g in first.groups for s in g.samples)
    assert [g.example["prompt"] for g in first.groups] == [e["prompt"] for e in ExampleStream(EXAMPLES, seed=0).take(3)]
    assert all(rb.metrics["offpolicy/staleness_max"] <= 1 for rb in batches)


def test_a_sampler_that_never_updates_is_an_error():
    with pytest.raises(StalenessError, match="not being updated"):
        drive(VersionedFake(on_sample=lambda call, v: -100), k=1, steps=2, max_resamples=2)


def test_a_failing_sampler_surfaces_in_next_batch():
    def boom(call, version):
        raise RuntimeError("sampler exploded")

    with pytest.raises(RuntimeError, match="sampler exploded"):
        drive(VersionedFake(on_sample=boom), k=1, steps=1)


def test_failed_rewards_keep_their_place():
    def flaky(completion, example):
        if completion == "22":
            raise ValueError("bad checker")
        return 1.0

    backend = VersionedFake()
    ro = AsyncRollouts(
        backend,
        ExampleStream(EXAMPLES),
        completion_sampler(backend.tokenizer, model_renderer(backend), RewardRunner(flaky)),
        group_size=3,
        groups_per_batch=2,
        params=SamplingParams(max_tokens=3),
        max_steps_off_policy=1,
    )
    ro.start(sampler_of(backend))
    try:
        rb = ro.next_batch(0, timeout=20)
    finally:
        ro.close()
    assert [[s.failed for s in g.samples] for g in rb.groups] == [[False, True, False]] * 2
    assert ro.stats.failed >= 2


# --------------------------------------------------------------------------- the stage
STALE_KEYS = {f.name for f in dataclasses.fields(Staleness)}


def stage_cfg(**kw):
    """The stage's keys; the staleness keys among ``kw`` go in its ``stale:`` block."""
    stale = {"max_steps_off_policy": 1, **{k: kw.pop(k) for k in list(kw) if k in STALE_KEYS}}
    cfg = {
        "name": "offpolicy",
        "steps": 4,
        "prompts_per_step": 2,
        "group_size": 3,
        "max_tokens": 3,
        "dataset": {"name": "arithmetic", "size": 20},
        "reward": "exact_match",
        "stale": stale,
    }
    cfg.update(kw)
    return cfg


def run_stage(tmp_path, registry, backend, name="o", **kw):
    recipe = Recipe(name=name, output_dir=str(tmp_path / name), loggers=[], stages=[stage_cfg(**kw)])
    return recipe.run(registry, backend)


def answers_right(prompt, i):
    a, b = prompt.rstrip("=").split("+")
    return [str(int(a) + int(b)), "x", "0"][i % 3]


def test_stage_logs_staleness_ratio_and_ess(tmp_path, fresh_registry):
    backend = VersionedFake(complete=answers_right)
    result = run_stage(tmp_path, fresh_registry, backend, max_steps_off_policy=2, fixed_staleness=True, steps=5)
    rows = [h for h in result.history if "reward/mean" in h]
    assert [r["offpolicy/staleness_mean"] for r in rows] == [0, 1, 2, 2, 2]
    for key in (
        "ratio/mean",
        "ratio/max",
        "ratio/clipped_frac",
        "is/ess",
        "is/ess_seq",
        "advantage/capped_frac",
        "offpolicy/resampled",
        "offpolicy/queued_groups",
        "time/wait_rollouts",
        "time/train",
        "step_time",
    ):
        assert all(key in r for r in rows), key
    assert all(r["reward/mean"] == pytest.approx(1 / 3) for r in rows)
    # advantages reached the loss token-mean folded: per batch, sum |A| * N = sum over tokens of |A_raw|
    for batch in backend.batches:
        n = sum(d.num_loss_tokens for d in batch.data)
        raw = [a * n for d in batch.data for a, w in zip(d.advantages, d.weights) if w]
        assert max(abs(a) for a in raw) == pytest.approx(1.1547, abs=1e-3)  # (1 - 1/3) / std([1, 0, 0]) with eps


def test_stage_folds_the_normaliser_only_for_sum_losses(tmp_path, fresh_registry):
    """ppo is a sum: token-mean folded advantages; grpo normalises itself: raw advantages, and
    asking to fold for it is refused."""
    for loss, scaled in (("ppo", True), ("grpo", False)):
        backend = VersionedFake(complete=answers_right)
        run_stage(tmp_path, fresh_registry, backend, name=loss, loss=loss, steps=2)
        for batch in backend.batches:
            n = sum(d.num_loss_tokens for d in batch.data)
            top = max(abs(a) for d in batch.data for a, w in zip(d.advantages, d.weights) if w)
            assert top * (n if scaled else 1) == pytest.approx(1.1547, abs=1e-3)
    with pytest.raises(ConfigError, match="normalise twice") as err:
        run_stage(tmp_path, fresh_registry, VersionedFake(), name="twice", loss="grpo", aggregation="token_mean")
    assert "stages[0].stale.aggregation" in str(err.value)


def test_stage_config_errors_name_the_key(tmp_path, fresh_registry):
    for kw, key in [
        ({"sync_every": 3}, "stale.sync_every"),
        ({"max_steps_off_policy": -1}, "stale.max_steps_off_policy"),
        ({"fixed_staleness": True, "max_steps_off_policy": 2, "sync_every": 2}, "stale.fixed_staleness"),
        ({"aggregation": "mean"}, "stale.aggregation"),
        ({"loss": "ppo_typo"}, "loss"),
    ]:
        with pytest.raises((ConfigError, KeyError)) as err:
            run_stage(tmp_path, fresh_registry, VersionedFake(), **kw)
        assert f"stages[0].{key}" in str(err.value), err.value


OLD_KEY_RECIPE = """\
name: old
output_dir: {out}
backend: {{name: local, model: tiny_llama,
          model_kwargs: {{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}, num_threads: 1}}
loggers: []
stages:
  - {{id: rl, name: offpolicy, dataset: {{name: arithmetic, split: train}}, steps: 1, prompts_per_step: 2,
      group_size: 2, max_tokens: 2}}
"""


@pytest.mark.parametrize("key", ["max_steps_off_policy", "sync_every", "aggregation"])
def test_a_flat_staleness_key_of_earlier_versions_is_one_line_naming_its_block(rejects_before_training, key):
    value = {"max_steps_off_policy": "2", "sync_every": "1", "aggregation": "token_mean"}[key]
    rejects_before_training(
        OLD_KEY_RECIPE,
        f"stages.rl.{key}={value}",
        f"stages[0].{key}: '{key}' moved: write it as stale: {{{key}: ...}} (see CHANGELOG.md)",
    )


def test_stage_without_sampling_client_still_runs(tmp_path, fresh_registry):
    backend = FakeBackend(complete=answers_right)  # no sampling_client: samples its live weights
    result = run_stage(tmp_path, fresh_registry, backend, max_steps_off_policy=1, steps=3, loss="ppo")
    rows = [h for h in result.history if "reward/mean" in h]
    assert len(rows) == 3 and all(r["offpolicy/staleness_max"] <= 1 for r in rows)


def test_interrupted_stage_resumes_at_the_next_examples(tmp_path, fresh_registry):
    def prompts(backend):
        return [[d.input_tokens for d in b.data] for b in backend.batches]

    full = VersionedFake(complete=answers_right)
    run_stage(tmp_path, fresh_registry, full, name="full", fixed_staleness=True)
    part = VersionedFake(complete=answers_right)
    recipe = Recipe(
        name="part",
        output_dir=str(tmp_path / "part"),
        loggers=[],
        stages=[stage_cfg(fixed_staleness=True)],
        max_total_steps=2,
    )
    recipe.run(fresh_registry, part)
    assert read_progress(str(tmp_path / "part"))["global_step"] == 2
    resumed = VersionedFake(complete=answers_right)
    Recipe(**{**recipe.to_dict(), "max_total_steps": None}).run(fresh_registry, resumed)
    assert prompts(part) + prompts(resumed) == prompts(full)
    assert Path(tmp_path / "part" / "progress.json").exists()
