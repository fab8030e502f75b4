"""The GRPO clipped-surrogate loss, with the aggregation modes of TRL 1.16's ``GRPOTrainer``.

:class:`GRPOLoss` (registered as ``grpo``) reads the batch and composes pure functions of
:mod:`tempering.rlmath`: the ratio (:mod:`~tempering.rlmath.ratios`), the per-token loss
(:func:`~tempering.rlmath.policy_loss.grpo_token_loss`), the aggregation
(:func:`~tempering.rlmath.aggregation.aggregate`) and TRL's metrics
(:func:`~tempering.rlmath.diagnostics.clip_metrics`). This docstring states the maths they
implement for GRPO.

Layout: ``logprobs`` and every per-position tensor of the batch are ``(B, T)`` over *target*
positions, as :meth:`tempering.types.Batch.to_tensors` pads them: ``weights`` is 1 on
completion tokens and 0 on prompt and padding positions, ``sampler_logprobs`` are the
behaviour-policy ("old") logprobs, ``advantages`` are per token (GRPO repeats the sequence's
advantage on each of its tokens) and ``ref_logprobs`` (only read when ``beta > 0``) the
reference policy's. Positions with weight 0 never reach the loss or its gradient, whatever
values they hold.

Per-token objective (``importance_sampling_level="token"``; ``r_t = exp(lp_t - old_t)``)::

    l_t = -min(r'_t * A_t, clip(r_t, 1 - epsilon_low, 1 + epsilon_high) * A_t)
          + beta * r_t * k3_t                                    (only when beta > 0)
    r'_t = min(r_t, delta) if delta is not None else r_t         (INTELLECT-2 two-sided clip)
    k3_t = exp(ref_t - lp_t) - (ref_t - lp_t) - 1

With ``importance_sampling_level="sequence"`` (GSPO) ``r`` is one ratio per sequence,
``exp(mean_t(lp_t - old_t))`` over its completion tokens, broadcast to its tokens.

The KL term is multiplied by the (differentiable) ratio when ``use_bias_correction_kl`` is
True -- TRL 1.16's default, which makes the KL gradient the unbiased reverse-KL gradient
(DeepSeek-V3.2). It changes the gradient even on-policy, where the ratio's value is 1.

Aggregation (``loss_type``; ``m`` = ``weights``, ``B`` = rows, sums over all ``(b, t)``):

- ``"grpo"``: ``mean_b( sum_t m*l / max(sum_t m, 1) )`` -- per-sequence token mean, then the
  mean over all ``B`` rows (a row with no completion token counts as 0). Length-biased.
- ``"bnpo"``: ``sum m*l / max(sum m, 1)`` -- token mean over this call's batch.
- ``"dapo"`` (default): ``sum m*l / N`` with ``N`` the number of completion tokens in the
  *whole* batch the optimizer step covers. TRL passes ``num_items_in_batch`` (tokens of the
  generation batch, all processes) and rescales it by processes, gradient-accumulation steps
  and ``steps_per_generation`` so that the summed micro-batch gradients equal a global token
  mean. Our loss sees the whole batch in one call, so ``N = sum m`` and dapo equals bnpo;
  a backend that splits a batch into micro-batches passes the total token count of the step
  as ``batch["num_items_in_batch"]`` (a scalar) and sums the micro-batch losses (no further
  division), which reproduces TRL exactly.
- ``"dr_grpo"``: ``sum m*l / (B * L)`` with the constant ``L = max_completion_length``. TRL
  uses its config's ``max_completion_length`` (default 512); ours defaults to the padded width
  ``T`` of the batch, which includes prompt positions, so set it (to the sampler's
  ``max_tokens``) to get a step-independent constant and TRL's value.

For ``grpo``, ``bnpo`` and ``dr_grpo`` TRL also divides by the gradient-accumulation steps;
with our one-call-per-step semantics that factor is 1 (a backend that accumulates several
calls per step divides itself).

Metrics (python floats), named as TRL logs them: ``clip_ratio/low_mean`` (fraction of
completion tokens with ``r < 1 - epsilon_low`` and ``A < 0``), ``clip_ratio/high_mean``
(``r' > 1 + epsilon_high`` and ``A > 0``), ``clip_ratio/region_mean`` (either),
``clip_ratio/low_min`` / ``clip_ratio/high_max`` (min / max over sequences of the per-sequence
fractions), ``kl`` (token mean of the KL term as added to the loss, i.e. ``r * k3`` with bias
correction, only when ``beta > 0``), plus ``ratio/mean`` and ``ratio/max`` of ``r``. With
sequence-level ratios the clip and ratio metrics are over sequences (TRL does the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from tempering.interfaces import LossOutput
from tempering.loss_contract import (
    ADVANTAGES,
    NUM_ITEMS_IN_BATCH,
    REF_LOGPROBS,
    SAMPLER_LOGPROBS,
    WEIGHTS,
    BuiltinLoss,
    LossSetup,
    NoBuiltin,
)
from tempering.rlmath.aggregation import LOSS_TYPES, aggregate, aggregation_coefficients
from tempering.rlmath.diagnostics import clip_metrics
from tempering.rlmath.kl import k3_kl
from tempering.rlmath.masks import active
from tempering.rlmath.policy_loss import clipped_surrogate, grpo_token_loss
from tempering.rlmath.ratios import IS_LEVELS, log_importance_weights
from tempering.schema import Problem, one_of, raise_problems
from tempering.types import Batch

# Every name but GRPOLoss is a re-export from tempering.rlmath, kept so that existing imports
# (tests, benchmarks, third-party plugins) keep working.
__all__ = [
    "GRPOLoss",
    "LOSS_TYPES",
    "aggregate",
    "clip_metrics",
    "clipped_surrogate",
    "grpo_token_loss",
    "k3_kl",
    "log_importance_weights",
]


@dataclass
class GRPOLoss:
    """GRPO / DAPO / Dr. GRPO / BNPO policy loss (TRL 1.16 ``GRPOTrainer._compute_loss``).

    Config keys: ``loss_type`` (``"dapo"`` default, ``"grpo"``, ``"dr_grpo"``, ``"bnpo"``),
    ``epsilon_low`` / ``epsilon_high`` (clip range ``[1 - low, 1 + high]``; DAPO recommends
    ``epsilon_high=0.28``), ``delta`` (two-sided clip: cap on the unclipped ratio, ``None``
    off), ``beta`` (k3 KL coefficient; needs ``batch["ref_logprobs"]``),
    ``max_completion_length`` (the dr_grpo constant; default: the batch's padded width),
    ``importance_sampling_level`` (``"token"`` or ``"sequence"`` = GSPO), and
    ``use_bias_correction_kl`` (multiply the KL term by the ratio; TRL 1.16's default).

    Reads ``batch["weights"]``, ``batch["advantages"]``, ``batch["sampler_logprobs"]`` (the
    ratio's "old" logprobs; without them, the forward's own logprobs, detached: only right for a
    batch trained in one optimizer step on the weights that sampled it),
    ``batch["ref_logprobs"]`` (beta > 0) and optionally ``batch["num_items_in_batch"]`` (dapo's
    global token count when a step is split over several calls). See the module docstring
    for the maths and the normalisers.
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    max_completion_length: int | None = None
    importance_sampling_level: str = "token"
    use_bias_correction_kl: bool = True

    needs_logits: ClassVar[bool] = False
    tinker_builtin: ClassVar[str | None] = None  # the built-in depends on the config and batch: builtin()

    @property
    def reads(self) -> frozenset[str]:
        """The batch inputs it requires (the loss contract): the reference policy's logprobs
        only with a KL term (GRPO's stage scores the reference exactly then). The sampler's
        logprobs are optional: without them the ratio's "old" is this forward, detached."""
        return frozenset({WEIGHTS, ADVANTAGES} | ({REF_LOGPROBS} if self.beta != 0.0 else set()))

    def for_stage(self, setup: LossSetup) -> GRPOLoss:
        """Dr. GRPO's constant ``max_completion_length``, when not set, is the stage's
        ``max_tokens`` (TRL's value; else the batch's padded width, which varies by step)."""
        if self.max_completion_length is not None or setup.max_tokens is None:
            return self
        return dataclasses.replace(self, max_completion_length=setup.max_tokens)

    def builtin(self, batch: Batch) -> BuiltinLoss | NoBuiltin:
        """Tinker's ``ppo`` (token ratios) or ``gspo`` (sequence ratios) with this loss's
        normaliser folded into the advantages, which is exact when no term but the clipped
        surrogate is on and the weights allow the fold (see the loss contract,
        :class:`~tempering.loss_contract.BuiltinLoss`); else why not."""
        why = []
        if self.beta != 0.0:
            why.append(f"beta={self.beta} adds the k3 KL term, which no built-in has")
        if self.delta is not None:
            why.append(f"delta={self.delta} (two-sided clip) is not in the built-in ppo")
        if self.importance_sampling_level not in ("token", "sequence"):
            why.append(f"importance_sampling_level={self.importance_sampling_level!r} has no built-in")
        if any(w < 0 for d in batch.data for w in d.weights):
            why.append("negative weights cannot be folded into advantages")
        sequence = self.importance_sampling_level == "sequence"
        if sequence and any(w not in (0.0, 1.0) for d in batch.data for w in d.weights):
            why.append(
                "sequence ratios over fractional weights (a weighted mean) are not the built-in gspo "
                "(a mean over a 0/1 mask)"
            )
        if why:
            return NoBuiltin("GRPOLoss: " + "; ".join(why))
        t = batch.to_tensors()
        mask = t[WEIGHTS]
        num_items = t.get(NUM_ITEMS_IN_BATCH)
        coef = aggregation_coefficients(
            lambda x: aggregate(x, mask, self.loss_type, self.max_completion_length, num_items=num_items), mask
        )
        config = {
            "clip_low_threshold": 1.0 - float(self.epsilon_low),
            "clip_high_threshold": 1.0 + float(self.epsilon_high),
        }
        if not sequence:
            return BuiltinLoss(
                "ppo",
                config,
                coef,
                f"GRPOLoss(loss_type={self.loss_type!r}) as the built-in ppo with its "
                "normaliser folded into the advantages (exact)",
            )
        if ADVANTAGES in t:
            folded = t[ADVANTAGES] * coef
            for i, d in enumerate(batch.data):
                if len({round(float(a), 12) for a, w in zip(folded[i, : len(d.weights)].tolist(), d.weights) if w}) > 1:
                    return NoBuiltin(
                        "GRPOLoss (sequence ratios): a row's folded advantage varies along it, where the built-in "
                        "gspo (GSPO-token) differs from the sequence ratio's gradient"
                    )
        return BuiltinLoss(
            "gspo",
            config,
            coef,
            f"GRPOLoss(loss_type={self.loss_type!r}, sequence ratios) as the built-in gspo "
            "with its normaliser folded into the advantages (exact: 0/1 mask, one advantage per row)",
        )

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values that cannot work, at their keys (the loss's schema check,
        :mod:`tempering.schema`: the registry runs it before building, ``__post_init__`` too)."""
        loss_type, level = config["loss_type"], config["importance_sampling_level"]
        yield one_of(
            "loss_type", loss_type, LOSS_TYPES, f"GRPOLoss.loss_type must be one of {LOSS_TYPES}, got {loss_type!r}"
        )
        yield one_of(
            "importance_sampling_level",
            level,
            IS_LEVELS,
            f"GRPOLoss.importance_sampling_level must be one of {IS_LEVELS}, got {level!r}",
        )
        low, high = config["epsilon_low"], config["epsilon_high"]
        if low < 0 or high < 0:
            yield Problem(
                "epsilon_low" if low < 0 else "epsilon_high",
                f"GRPOLoss: epsilon_low and epsilon_high must be >= 0, got {low}, {high}",
            )
        if config["delta"] is not None and config["delta"] <= 0:
            yield Problem("delta", f"GRPOLoss.delta must be > 0 (or None), got {config['delta']}")
        length = config["max_completion_length"]
        if length is not None and length <= 0:
            yield Problem("max_completion_length", f"GRPOLoss.max_completion_length must be > 0, got {length}")

    def __post_init__(self) -> None:
        raise_problems(self)

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        for key in (WEIGHTS, ADVANTAGES):
            if key not in batch:
                raise KeyError(f"GRPOLoss needs batch[{key!r}]; the batch has {sorted(batch)}")
        mask = batch[WEIGHTS].to(logprobs.dtype)
        # No "old" logprobs: the batch is trained in one optimizer step on the weights that
        # sampled it, so "old" is this very forward, detached (ratio 1; TRL's shortcut too).
        old = batch[SAMPLER_LOGPROBS].to(logprobs.dtype) if SAMPLER_LOGPROBS in batch else logprobs.detach()
        advantages = batch[ADVANTAGES].to(logprobs.dtype)
        if advantages.dim() == 1:  # one advantage per row
            advantages = advantages.unsqueeze(-1)
        # Masked positions may hold anything (a failed sample's NaN advantage): zero them before
        # any product, or the gradient of a masked product (0 * NaN) is NaN too.
        is_active = active(mask)
        advantages = torch.where(is_active, advantages.expand_as(logprobs), torch.zeros_like(logprobs))
        old = torch.where(is_active, old, torch.zeros_like(old))
        ref = batch.get(REF_LOGPROBS) if self.beta != 0.0 else None
        if self.beta != 0.0 and ref is None:
            raise KeyError(f"GRPOLoss with beta={self.beta} needs batch['ref_logprobs']; the batch has {sorted(batch)}")
        per_token, ratio, kl_term = grpo_token_loss(
            logprobs,
            old,
            advantages,
            mask,
            epsilon_low=self.epsilon_low,
            epsilon_high=self.epsilon_high,
            delta=self.delta,
            importance_sampling_level=self.importance_sampling_level,
            beta=self.beta,
            ref_logprobs=None if ref is None else ref.to(logprobs.dtype),
            use_bias_correction_kl=self.use_bias_correction_kl,
        )
        loss = aggregate(
            per_token, mask, self.loss_type, self.max_completion_length, num_items=batch.get(NUM_ITEMS_IN_BATCH)
        )
        metrics = clip_metrics(
            ratio.detach(), advantages.expand_as(logprobs), mask, self.epsilon_low, self.epsilon_high, self.delta
        )
        if kl_term is not None:
            metrics["kl"] = float(((kl_term.detach() * mask).sum() / mask.sum().clamp(min=1.0)).item())
        return LossOutput(loss=loss, metrics=metrics)
