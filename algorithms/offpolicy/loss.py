"""Off-policy policy-gradient losses with corrected (clipped / truncated) importance ratios.

The registered losses here (``ppo``, ``cispo``, ``tis``, ``clipped_is``) read the batch and call
the pure functions of :mod:`tempering.rlmath.policy_loss` (the formulas, written once, shared
with the Tinker backend's built-ins); what stays here is off-policy's own: the sampler-matched
objective, the stage's advantage cap and the losses' Tinker names.

Layout as in :mod:`tempering.algorithms.grpo.loss`: ``logprobs`` and every per-position tensor
are ``(B, T)`` over target positions; ``batch["weights"]`` is the loss mask (non-zero on the
completion tokens that count), ``batch["sampler_logprobs"]`` the behaviour policy's logprobs
``q`` and ``batch["advantages"]`` per-token advantages ``A``. The ratio is
``rho = exp(lp_theta - q)``, per token, or with ``level="sequence"`` one per sequence
(``exp`` of the masked mean log-ratio, GSPO's length-normalised form) broadcast to its tokens.

Every loss is a **sum over tokens**, exactly as Tinker's built-in losses compute it, so any
normaliser (token mean, sequence mean) must be folded into ``advantages`` before the call (the
``offpolicy`` stage does it: :func:`fold_normaliser`). With ``level="token"`` each loss names the
Tinker built-in that computes the same value and gradient (``tinker_builtin``) and the
``loss_fn_config`` to send (``tinker_loss_fn_config``):

=============== ================================================================ ==================
name            per-token loss (summed over mask)                                Tinker built-in
=============== ================================================================ ==================
``ppo``         ``-min(rho*A, clip(rho, low, high)*A)``; low/high 0.8/1.2         ``ppo``
``cispo``       ``-sg(clip(rho, low, high)) * A * lp``; low/high 0.0/4.0          ``cispo``
``tis``         ``-sg(min(rho, C)) * A * lp`` (truncated IS, Yao et al.; C=2)     ``cispo`` {0, C}
``clipped_is``  ``ppo``'s formula, 0.8/1.2, on advantages capped at 3x running    ``ppo`` (capped A)
                mean ``|A|``
=============== ================================================================ ==================

``importance_sampling`` (``-rho*A``, unclipped) is registered by ``tempering.algorithms.sdft``
(:func:`~tempering.rlmath.policy_loss.importance_sampling_loss` is its formula).
Tinker's definitions (docs ``tinker/losses``, pages importance-sampling, ppo, cispo):
``prob_ratio = exp(target_logprobs - sampling_logprobs)``; importance_sampling
``loss = -(prob_ratio * advantages).sum()``; ppo ``clipped_ratio = clamp(prob_ratio,
clip_low_threshold, clip_high_threshold)``, ``loss = -min(prob_ratio * A, clipped_ratio *
A).sum()``; cispo ``loss = -(clamp(prob_ratio, low, high).detach() * target_logprobs *
A).sum()`` with default thresholds ``{0.0, 4.0}``.

``sg`` is stop-gradient: the coefficient losses (cispo, tis) have gradient ``w * A * grad(lp)``
with ``w`` the clipped ratio, which never vanishes (unlike PPO's clip, whose gradient is 0 once
the ratio has left the trust region in the direction ``A`` pushes); their *value* is not an
estimate of the objective (it is ``lp``-weighted), only their gradient is.

``clipped_is`` is the "clipped importance ratios and capped advantages" recipe for stale
rollouts: the ratio clipped to ``[clip_low_threshold, clip_high_threshold]`` (+-0.2) inside
PPO's pessimistic ``min`` (a trust region around the *sampler's* policy, so a stale batch
cannot drag the policy further than the clip allows), on advantages whose per-token ``|A|`` is
capped at ``advantage_cap`` times its running mean. Every loss here has the ``advantage_cap``
and ``advantage_cap_momentum`` knobs (off except for ``clipped_is``); the stage applies the cap
(:class:`AdvantageCap`) before the call, so on Tinker the loss is still the built-in ``ppo``.
Measured on the arithmetic task at staleness 3 (docs/offpolicy.md), the coefficient forms
(``cispo``, ``tis``, and the clipped ratio used as a coefficient) drift at a high learning rate
while the PPO-style ``min`` does not: a coefficient's gradient never switches off, so nothing
stops a stale batch from pushing the policy ever further from the policy that sampled it.

Metrics (python floats; over loss tokens): ``ratio/mean``, ``ratio/max``, ``ratio/min`` of the
raw ``rho``; ``ratio/clipped_frac``, the share of tokens whose ratio the loss clipped
(truncated, or outside PPO's region with the sign of ``A`` that makes the clip bind);
``is/ess`` = ``(sum w)^2 / (n * sum w^2)`` over the raw per-token ratios (1 = on-policy, -> 1/n
when one token dominates) and ``is/ess_seq`` the same over per-sequence weights
``exp(sum_t log rho_t)``; ``is/kl`` = mean ``rho - 1 - log rho``, the k3 estimate of
``KL(q || pi_theta)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

import tempering.loss_contract as loss_contract
from tempering.interfaces import Loss, LossOutput, at_positions, from_positions
from tempering.loss_contract import ADVANTAGES, SAMPLER_LOGPROBS, TARGET_IDS, WEIGHTS, loss_reads
from tempering.rlmath.aggregation import fold_normaliser
from tempering.rlmath.diagnostics import ratio_stats
from tempering.rlmath.masks import active, masked
from tempering.rlmath.policy_loss import cispo_loss, importance_sampling_loss, ppo_loss, tis_loss
from tempering.rlmath.ratios import IS_LEVELS, log_importance_weights

# cispo_loss, fold_normaliser, importance_sampling_loss, ppo_loss, ratio_stats and tis_loss are
# re-exports from tempering.rlmath, kept so that existing imports (tests, third-party plugins)
# keep working.
__all__ = [
    "LEVELS",
    "AdvantageCap",
    "CISPOLoss",
    "ClippedISLoss",
    "OffPolicyObjective",
    "PPOLoss",
    "TISLoss",
    "cap_advantages",
    "cispo_loss",
    "fold_normaliser",
    "importance_sampling_loss",
    "ppo_loss",
    "ratio_stats",
    "sampling_logprobs",
    "tis_loss",
]

LEVELS = IS_LEVELS


# --------------------------------------------------------------------------- sampler-matched scoring
def sampling_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probabilities of ``targets`` under the distribution a sampler with these settings
    draws from: ``logits / T``, then top-k, then top-p (the local backend's and HF's order,
    with HF's own warpers so ties and boundaries match), log-softmaxed. ``temperature <= 0``
    (greedy) means the untempered model, as the local backend records it.

    Returns ``(logprobs (B, T), kept (B, T) bool)``: ``kept`` is False where the target lies
    outside the filtered support (its probability there is 0; the logprob is replaced by the
    temperature-only one so it stays finite -- callers mask such tokens out).
    """
    scores = logits.float()
    if temperature > 0 and temperature != 1.0:
        scores = scores / float(temperature)
    tempered = torch.log_softmax(scores, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if temperature <= 0 or (top_k <= 0 and top_p >= 1.0):
        return tempered, torch.ones_like(tempered, dtype=torch.bool)
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    flat = scores.reshape(-1, scores.shape[-1])
    if top_k > 0:
        flat = TopKLogitsWarper(top_k=int(top_k))(None, flat)
    if top_p < 1.0:
        flat = TopPLogitsWarper(top_p=float(top_p))(None, flat)
    filtered = torch.log_softmax(flat.reshape(scores.shape), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    kept = torch.isfinite(filtered)
    return torch.where(kept, filtered, tempered), kept


@dataclass
class OffPolicyObjective:
    """Wraps any policy loss so the trainer's logprobs match the sampler's distribution and
    importance-ratio diagnostics are always logged.

    With ``temperature``/``top_k``/``top_p`` at their neutral values (1, 0, 1) the backend's
    logprobs are used as they are and the inner loss's Tinker built-in still applies. Otherwise
    the policy is scored from the logits exactly as the sampler drew (:func:`sampling_logprobs`),
    so ``rho = pi_theta^T(y) / q(y)`` compares like with like: it is 1 on-policy, and the
    IS-corrected gradient is that of the tempered policy the rollouts came from. Tokens outside
    the trainer's filtered support (possible only with top-k/top-p) have ``rho = 0`` and are
    masked out. This needs logits, so there is no Tinker built-in for it.
    """

    inner: Any
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def matched(self) -> bool:
        return self.temperature > 0 and (self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0)

    @property
    def needs_logits(self) -> bool:
        return self.matched or loss_contract.needs_logits(self.inner)

    @property
    def reads(self) -> frozenset[str] | None:
        """The inner loss's inputs (the loss contract), plus the target ids when it scores the
        logits as the sampler drew."""
        inner = loss_reads(self.inner)
        return None if inner is None else inner | ({TARGET_IDS} if self.matched else set())

    @property
    def tinker_builtin(self) -> str | None:
        return None if self.matched else loss_contract.builtin_name(self.inner)

    @property
    def tinker_loss_fn_config(self) -> dict[str, float] | None:
        return None if self.matched else loss_contract.builtin_fn_config(self.inner)

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        filtered_frac = 0.0
        if self.matched:
            positions, width = batch.get("logit_positions"), logprobs.shape[-1]
            targets = at_positions(batch["target_ids"], positions)
            logprobs, kept = sampling_logprobs(batch["logits"], targets, self.temperature, self.top_k, self.top_p)
            logprobs, kept = from_positions(logprobs, positions, width), from_positions(kept, positions, width, True)
            mask = batch["weights"]
            is_active = active(mask)
            filtered_frac = float((is_active & ~kept).sum()) / max(int(is_active.sum()), 1)
            batch = {**batch, "weights": torch.where(kept, mask, torch.zeros_like(mask))}
        out = self.inner(logprobs, batch)
        metrics = dict(out.metrics)
        if "sampler_logprobs" in batch:
            mask = batch["weights"]
            lr = masked(logprobs.detach() - batch["sampler_logprobs"].to(logprobs.dtype), mask)
            for key, value in ratio_stats(lr, mask).items():
                metrics.setdefault(key, value)
        if self.matched:
            metrics["is/filtered_frac"] = filtered_frac
        return LossOutput(out.loss, metrics)


# --------------------------------------------------------------------------- registered losses
@dataclass
class _RatioLoss:
    """Shared plumbing: reads the batch, builds the ratio, adds diagnostics.

    ``level``: ``token`` ratios or one ``sequence`` ratio (masked-mean log-ratio, GSPO).
    ``advantage_cap`` (multiple of the running mean ``|A|``, null = off) and
    ``advantage_cap_momentum`` are read by the stage, which caps the advantages before the
    call (:class:`AdvantageCap`)."""

    level: str = "token"
    advantage_cap: float | None = None
    advantage_cap_momentum: float = 0.9

    needs_logits: ClassVar[bool] = False
    reads: ClassVar[frozenset[str]] = frozenset({WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES})  # the loss contract
    _builtin: ClassVar[str] = ""

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"{type(self).__name__}.level must be one of {LEVELS}, got {self.level!r}")
        if self.advantage_cap is not None and self.advantage_cap <= 0:
            raise ValueError(f"{type(self).__name__}.advantage_cap must be > 0 (or null), got {self.advantage_cap}")
        if not 0.0 <= self.advantage_cap_momentum < 1.0:
            raise ValueError(
                f"{type(self).__name__}.advantage_cap_momentum must be in [0, 1), got {self.advantage_cap_momentum}"
            )
        self._check()

    def _check(self) -> None:  # per-loss parameter checks
        pass

    @property
    def tinker_builtin(self) -> str | None:
        """The Tinker loss computing exactly this (token level only; GSPO-style sequence
        ratios are a custom loss there)."""
        return self._builtin if self.level == "token" else None

    @property
    def tinker_loss_fn_config(self) -> dict[str, float] | None:
        return self._config() if self.level == "token" else None

    def _config(self) -> dict[str, float]:
        raise NotImplementedError

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        for key in (WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES):
            if key not in batch:
                raise KeyError(f"{type(self).__name__} needs batch[{key!r}]; the batch has {sorted(batch)}")
        mask = batch["weights"].to(logprobs.dtype)
        q = batch["sampler_logprobs"].to(logprobs.dtype)
        adv = batch["advantages"].to(logprobs.dtype)
        log_ratio = log_importance_weights(logprobs, q, mask, self.level)
        ratio = torch.exp(log_ratio).expand_as(logprobs)
        loss, clipped = self._loss(logprobs, ratio, adv, mask)
        token_lr = log_importance_weights(logprobs.detach(), q, mask, "token")
        return LossOutput(loss, ratio_stats(token_lr, mask, clipped.expand_as(logprobs)))


@dataclass
class _ThresholdLoss(_RatioLoss):
    """A ratio loss with Tinker's two thresholds, sent as its ``loss_fn_config``."""

    clip_low_threshold: float = 0.0
    clip_high_threshold: float = 4.0

    def _config(self) -> dict[str, float]:
        return {"clip_low_threshold": self.clip_low_threshold, "clip_high_threshold": self.clip_high_threshold}


@dataclass
class PPOLoss(_ThresholdLoss):
    """Tinker's ``ppo``: ``-sum(min(rho*A, clip(rho, clip_low_threshold, clip_high_threshold)*A))``.

    Defaults 0.8 / 1.2 (Tinker's). ``ratio/clipped_frac`` counts tokens where the clip binds
    (``rho > high`` with ``A > 0`` or ``rho < low`` with ``A < 0``): their gradient is 0."""

    clip_low_threshold: float = 0.8
    clip_high_threshold: float = 1.2
    _builtin: ClassVar[str] = "ppo"

    def _check(self) -> None:
        if not 0 <= self.clip_low_threshold <= 1 <= self.clip_high_threshold:
            raise ValueError(
                "PPOLoss: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                f"got {self.clip_low_threshold}, {self.clip_high_threshold}"
            )

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.clip_low_threshold, self.clip_high_threshold
        clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
        return ppo_loss(ratio, adv, mask, lo, hi), clipped


@dataclass
class CISPOLoss(_ThresholdLoss):
    """Tinker's ``cispo``: ``-sum(sg(clip(rho, clip_low_threshold, clip_high_threshold)) * A * lp)``.

    Defaults 0.0 / 4.0 (Tinker's one-sided default: only large ratios are capped)."""

    clip_low_threshold: float = 0.0
    clip_high_threshold: float = 4.0
    _builtin: ClassVar[str] = "cispo"

    def _check(self) -> None:
        if not 0 <= self.clip_low_threshold <= self.clip_high_threshold:
            raise ValueError(
                f"{type(self).__name__}: need 0 <= low <= high, "
                f"got {self.clip_low_threshold}, {self.clip_high_threshold}"
            )

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = self.clip_low_threshold, self.clip_high_threshold
        return cispo_loss(logprobs, ratio, adv, mask, lo, hi), (ratio < lo) | (ratio > hi)


@dataclass
class TISLoss(_RatioLoss):
    """Truncated importance sampling: ``-sum(sg(min(rho, C)) * A * lp)``, ``C = truncation``
    (default 2, as Yao et al.'s TIS). Exactly Tinker's ``cispo`` with thresholds ``{0, C}``."""

    truncation: float = 2.0
    _builtin: ClassVar[str] = "cispo"

    def _check(self) -> None:
        if self.truncation <= 0:
            raise ValueError(f"TISLoss.truncation must be > 0, got {self.truncation}")

    def _config(self) -> dict[str, float]:
        return {"clip_low_threshold": 0.0, "clip_high_threshold": self.truncation}

    def _loss(
        self, logprobs: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return tis_loss(logprobs, ratio, adv, mask, self.truncation), ratio > self.truncation


@dataclass
class ClippedISLoss(PPOLoss):
    """The "clipped importance ratios and capped advantages" recipe for stale rollouts:
    ``-sum(min(rho*A', clip(rho, c_low, c_high)*A'))`` with ``c_low/c_high = 0.8/1.2`` (+-0.2)
    and ``A'`` the advantages with per-token ``|A|`` capped at ``advantage_cap = 3`` times its
    running mean (EMA, ``advantage_cap_momentum``). Tinker: ``ppo`` with these thresholds,
    after the stage has capped the advantages."""

    advantage_cap: float | None = 3.0


# --------------------------------------------------------------------------- advantage capping
def cap_advantages(rows: list[list[float]], weights: list[list[float]], cap: float) -> tuple[list[list[float]], int]:
    """Clamp every loss token's advantage to ``[-cap, cap]``; returns the new rows and how many
    tokens were capped. Off-mask positions are left as they are."""
    n = 0
    out = []
    for adv, w in zip(rows, weights):
        row = []
        for a, m in zip(adv, w):
            if m != 0 and abs(a) > cap:
                a = cap if a > 0 else -cap
                n += 1
            row.append(a)
        out.append(row)
    return out, n


@runtime_checkable
class CapsAdvantages(Protocol):
    """A loss that asks the ``offpolicy`` stage to cap its advantages (every loss here): a cap
    at ``advantage_cap`` times the running mean ``|A|`` (``None``: off), whose mean moves with
    ``advantage_cap_momentum``. Read by the stage, typed, instead of probed."""

    advantage_cap: float | None
    advantage_cap_momentum: float


class AdvantageCap:
    """Caps per-token ``|A|`` at ``multiple`` x its running mean (the stale-rollout recipe).

    The running mean is an exponential moving average (``momentum``) of each batch's mean
    ``|A|`` over loss tokens with a non-zero advantage (zero-variance groups would otherwise
    drag it down and cap the rare informative group); the first batch initialises it. The
    cap for a batch uses the mean *including* that batch. ``multiple=None`` disables it.
    """

    def __init__(self, multiple: float | None, momentum: float = 0.9, mean: float | None = None) -> None:
        if multiple is not None and multiple <= 0:
            raise ValueError(f"AdvantageCap: multiple must be > 0 (or None), got {multiple}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"AdvantageCap: momentum must be in [0, 1), got {momentum}")
        self.multiple, self.momentum, self.mean = multiple, momentum, mean

    @classmethod
    def for_loss(cls, loss: Loss, mean: float | None = None) -> AdvantageCap:
        """The cap ``loss`` asks for (:class:`CapsAdvantages`); none for any other loss."""
        if isinstance(loss, CapsAdvantages):
            return cls(loss.advantage_cap, loss.advantage_cap_momentum, mean)
        return cls(None, 0.9, mean)

    def __call__(
        self, rows: list[list[float]], weights: list[list[float]]
    ) -> tuple[list[list[float]], dict[str, float]]:
        if self.multiple is None:
            return rows, {}
        values = [abs(a) for adv, w in zip(rows, weights) for a, m in zip(adv, w) if m != 0 and a != 0]
        if not values:
            return rows, {
                "advantage/cap": float("inf") if self.mean is None else self.multiple * self.mean,
                "advantage/capped_frac": 0.0,
            }
        batch_mean = sum(values) / len(values)
        self.mean = batch_mean if self.mean is None else self.momentum * self.mean + (1 - self.momentum) * batch_mean
        cap = self.multiple * self.mean
        rows, n = cap_advantages(rows, weights, cap)
        return rows, {"advantage/cap": cap, "advantage/capped_frac": n / len(values)}
