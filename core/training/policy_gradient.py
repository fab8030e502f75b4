"""The policy-gradient stage: the RL engine plus what a ratio-based loss needs before training.

:class:`PolicyGradient` is :class:`~tempering.training.rl.RLStage` (rollouts, group-relative
advantages, one optimizer step per batch) with the batch preparation every clipped-ratio
policy loss shares: the ratio's "old" logprobs (the sampler's, or recomputed when sampling was
not plain) and the KL to a reference policy, in the loss (``beta``) and/or logged every
``kl_every`` steps. ``grpo`` is this stage as it is; ``sdpo`` holds a self-distillation term and
stale rollouts beside it. It lives in the core, not in an algorithm, so that algorithms compose
it instead of inheriting one another.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

from tempering.interfaces import Loss, LossOnTrainingForward, RunContext, WeightSnapshots, supports
from tempering.loss_contract import REF_LOGPROBS, SAMPLER_LOGPROBS, WEIGHTS, reads_input
from tempering.rlmath.kl import k3_kl
from tempering.rollouts.rollout import recompute_sampler_logprobs, should_recompute
from tempering.schema import Problem
from tempering.training.rl import RLStage
from tempering.types import Batch, Group

__all__ = ["PolicyGradient", "kl_to_reference"]


@dataclass
class PolicyGradient(RLStage):
    """One optimizer step per batch of ``prompts_per_step x group_size`` samples, trained with a
    policy-gradient loss whose ratio needs "old" logprobs and maybe a KL to a reference.

    Keys besides the RL engine's (:class:`~tempering.training.rl.RLStage`):

    - ``recompute_logprobs``: the ratio's "old" logprobs are the sampler's own when sampling
      was plain (temperature 1, no top-k/top-p), and the same weights' logprobs otherwise
      (``auto``), because the sampler's logprobs are those of the tempered/filtered
      distribution while the trainer scores the untempered policy: using them would make an
      on-policy step look off-policy. ``always`` / ``never`` force either. The same weights'
      logprobs cost no extra forward pass on a backend whose loss runs on its own training
      forward (:class:`~tempering.interfaces.LossOnTrainingForward`, the local backend): one optimizer step per batch
      means "old" is that forward, detached. Elsewhere (Tinker's built-in losses) and on steps
      that log the KL (which reads them), a forward pass computes them.
    - ``log_kl`` / ``kl_every``: log the k3 KL to the reference every ``kl_every`` steps (one
      reference forward pass each time; a loss with ``beta > 0`` needs it, and so logs it, at
      every step).
    - ``reference``: ``stage_start`` (the policy as this stage began: after an SFT/DPO warmup,
      what TRL's ``ref_model`` would be) or ``base`` (LoRA adapter off / initial weights).
      ``stage_start`` uses a weight snapshot (:class:`~tempering.interfaces.WeightSnapshots`);
      on a backend without them GRPO warns and uses ``base`` (it requires no capability).
    """

    recompute_logprobs: str = "auto"  # auto | always | never
    log_kl: bool = True
    kl_every: int = 10
    reference: str = "stage_start"  # stage_start | base

    summary_keys = ("reward/mean", "accuracy", "loss", "kl", "kl_ref")

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The RL engine's checks, then these keys' values, at their keys."""
        yield from super().check_config(config)
        if config["recompute_logprobs"] not in ("auto", "always", "never"):
            yield Problem("recompute_logprobs", f"use auto, always or never (got '{config['recompute_logprobs']}')")
        if config["reference"] not in ("stage_start", "base"):
            yield Problem("reference", f"use stage_start or base (got '{config['reference']}')")
        if config["kl_every"] < 1:
            yield Problem("kl_every", f"must be >= 1, got {config['kl_every']}")

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        super().setup(ctx, state)
        self.recompute = should_recompute(self.recompute_logprobs, self.params)
        self.loss_on_forward = supports(self.backend, LossOnTrainingForward)
        if self.reference == "stage_start" and not supports(self.backend, WeightSnapshots):
            warnings.warn(
                f"{ctx.path}.reference: this backend cannot snapshot weights; using its base as the KL reference",
                RuntimeWarning,
                stacklevel=2,
            )
            self.reference = "base"
        self.ref_name = f"reference/{ctx.stage_id}"
        uses_ref = reads_input(self.loss_fn, REF_LOGPROBS) or self.log_kl
        if int(state.get("step", 0)) == 0 and self.reference == "stage_start" and uses_ref:
            cast(WeightSnapshots, self.backend).snapshot(
                self.ref_name
            ).result()  # saved in checkpoints: resume keeps it

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """The RL engine's inputs, plus the reference policy's logprobs: scored at every step
        for a loss that reads them (a KL term), else every ``kl_every`` steps for the log."""
        return super().batch_inputs(loss) | {REF_LOGPROBS}

    def prepare(self, ctx: RunContext, batch: Batch, step: int, groups: Sequence[Group]) -> dict[str, Any]:
        # logged on the stage's last step too: the summary after "Done." shows the last step's values
        logged = step % self.kl_every == 0 or step + 1 == self.steps
        kl_now = reads_input(self.loss_fn, REF_LOGPROBS) or (self.log_kl and logged)
        # "old" from the loss's own training forward, unless the loss requires the sampler's input
        from_forward = (
            self.recompute_logprobs == "auto"
            and self.loss_on_forward
            and not reads_input(self.loss_fn, SAMPLER_LOGPROBS)
        )
        if self.recompute and from_forward and not kl_now:
            for d in batch.data:  # the loss takes its own forward's logprobs, detached
                d.sampler_logprobs = None
        elif self.recompute:
            recompute_sampler_logprobs(self.backend, batch)
        if not kl_now:
            return {}
        kwargs = {"weights": self.ref_name} if self.reference == "stage_start" else {"reference": True}
        for d, lp in zip(batch.data, self.backend.logprobs(batch, **kwargs).result()):
            d.extra[REF_LOGPROBS] = list(lp)
        return {"kl_ref": kl_to_reference(batch)}


def kl_to_reference(batch: Batch) -> float:
    """Token-mean k3 estimate of KL(policy || reference) on the sampled tokens, from the
    behaviour logprobs: logged even when the loss has no KL term (``beta = 0``)."""
    t = batch.to_tensors()
    mask = t[WEIGHTS] > 0
    if not mask.any():
        return 0.0
    return float(k3_kl(t[SAMPLER_LOGPROBS], t[REF_LOGPROBS], mask)[mask].mean())
