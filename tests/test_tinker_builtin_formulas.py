"""Tinker's built-in losses against formulas written independently of our code (issue 24 item 20).

``builtin_loss`` is what the local Tinker server computes and what the mapping tests compare our
losses with; until now it was only checked against itself. Here each built-in is recomputed with
plain Python loops over one datum's positions, from the definitions in Tinker's loss documentation
(``r_t = exp(lp_t - q_t)``, sums over the datum's positions, no mask), and its gradient with the
derivative worked out by hand per token. Nothing here imports ``tempering.rlmath``.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tempering.plugins.tinker_server.builtin_losses import builtin_loss


def _clip(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def reference(
    loss_fn: str, cfg: dict, lp: list[float], q: list[float], adv: list[float], mask: list[float] | None = None
):
    """(loss, d loss / d lp) of one datum, from the documented definitions, one position at a time."""
    n = len(lp)
    loss, grad = 0.0, [0.0] * n
    if loss_fn == "gspo":
        # GSPO-token: every token carries the value of the sequence ratio
        # s = exp(mean over the mask of (lp - q)), with the gradient of its own logprob only.
        m = sum(mask)
        s = math.exp(sum((lp[t] - q[t]) * mask[t] for t in range(n)) / m)
    for t in range(n):
        r = math.exp(lp[t] - q[t])
        a = adv[t]
        if loss_fn == "importance_sampling":
            loss -= r * a
            grad[t] = -r * a  # d r / d lp = r
        elif loss_fn in ("ppo", "gspo"):
            lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
            x = s if loss_fn == "gspo" else r
            unclipped, clipped = x * a, _clip(x, lo, hi) * a
            loss -= min(unclipped, clipped)
            # the min picks the clipped term only when it is strictly smaller: then x is outside
            # [lo, hi] and the term is constant; otherwise the gradient is that of x * a (d x / d lp_t = x)
            grad[t] = 0.0 if clipped < unclipped else -x * a
        elif loss_fn == "cispo":
            w = _clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"])  # stop-gradient weight
            loss -= w * lp[t] * a
            grad[t] = -w * a
        elif loss_fn == "dro":
            beta = cfg["beta"]
            loss -= lp[t] * a - beta / 2 * (lp[t] - q[t]) ** 2
            grad[t] = -(a - beta * (lp[t] - q[t]))
        else:
            raise AssertionError(loss_fn)
    return loss, grad


def reference_cross_entropy(lp: list[float], weights: list[float] | None):
    if weights is None:  # the SDK's forward: absent weights are zeros
        return 0.0, [0.0] * len(lp)
    return -sum(w * x for w, x in zip(weights, lp)), [-w for w in weights]


CASES = [
    ("importance_sampling", {}),
    ("ppo", {}),  # documented default thresholds 0.8 / 1.2
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
    ("cispo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ("dro", {"beta": 0.5}),
    ("dro", {"beta": 2.0}),
    ("gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
    ("gspo", {"clip_low_threshold": 0.99, "clip_high_threshold": 1.01}),
]
FULL_CONFIG = {"ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}}


def _datum(rng: random.Random, n: int, spread: float):
    q = [-rng.random() * 3 for _ in range(n)]
    lp = [x + rng.gauss(0.0, spread) for x in q]
    adv = [rng.gauss(0.0, 1.0) for _ in range(n)]
    mask = [float(rng.random() < 0.7) for _ in range(n)]
    mask[-1] = 1.0
    return lp, q, adv, mask


def _ours(loss_fn, cfg, lp, q, adv, mask):
    inputs = {
        "target_tokens": torch.arange(len(lp)),
        "logprobs": torch.tensor(q, dtype=torch.float64),
        "advantages": torch.tensor(adv, dtype=torch.float64),
    }
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = torch.tensor(mask, dtype=torch.float64)
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    loss = builtin_loss(loss_fn, cfg, x, inputs)
    loss.backward()
    return float(loss.detach()), x.grad.tolist()


@pytest.mark.parametrize("loss_fn,cfg", CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("spread", [0.05, 0.6])  # ratios near 1 (mostly unclipped) and far (mostly clipped)
@pytest.mark.parametrize("seed", range(4))
def test_builtin_matches_the_documented_formula(loss_fn, cfg, spread, seed):
    rng = random.Random(1000 * seed + int(spread * 100))
    lp, q, adv, mask = _datum(rng, rng.randint(3, 9), spread)
    want, want_grad = reference(loss_fn, {**FULL_CONFIG.get(loss_fn, {}), **cfg}, lp, q, adv, mask)
    got, got_grad = _ours(loss_fn, cfg, lp, q, adv, mask)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert got_grad == pytest.approx(want_grad, rel=1e-9, abs=1e-12)


def test_the_cases_reach_both_branches_of_the_clip():
    """The seeds above do exercise clipped and unclipped positions (else the clip tests are empty)."""
    seen = set()
    for seed in range(4):
        for spread in (0.05, 0.6):
            rng = random.Random(1000 * seed + int(spread * 100))
            lp, q, _adv, _ = _datum(rng, rng.randint(3, 9), spread)
            for t in range(len(lp)):
                r = math.exp(lp[t] - q[t])
                seen.add(0.8 <= r <= 1.2)
    assert seen == {True, False}


@pytest.mark.parametrize("with_weights", [True, False])
def test_cross_entropy_matches_the_documented_formula(with_weights):
    rng = random.Random(7)
    lp = [-rng.random() * 3 for _ in range(6)]
    weights = [0.0, 0.0, 1.0, 1.0, 0.5, 1.0] if with_weights else None
    inputs = {"target_tokens": torch.arange(6)}
    if with_weights:
        inputs["weights"] = torch.tensor(weights, dtype=torch.float64)
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    loss = builtin_loss("cross_entropy", {}, x, inputs)
    loss.backward()
    want, want_grad = reference_cross_entropy(lp, weights)
    assert float(loss.detach()) == pytest.approx(want, abs=1e-12)
    assert x.grad.tolist() == pytest.approx(want_grad, abs=1e-12)
