"""The ``offpolicy`` stage: GRPO-style RL whose sampling runs concurrently with training.

The RL engine's loop (:class:`tempering.training.rl.RLStage`) with an asynchronous rollout source: a
producer (:class:`tempering.rollouts.async_rollout.AsyncRollouts`) keeps rolling out groups through the
stage's sampler -- single-turn completions or multi-turn episodes -- from the newest sampler
snapshot it may use; the trainer takes one batch of ``prompts_per_step`` groups per step,
builds group-relative advantages, caps and normalises them, and runs ``forward_backward`` +
``optim_step``; right after the optimizer step it publishes a fresh sampler snapshot (every
``sync_every`` steps). A rollout is at most ``max_steps_off_policy`` optimizer steps stale (a
trajectory: its oldest turn); the loss corrects for that with per-token importance ratios
against the sampler's logprobs.

Per step it logs the staleness (mean / max / min over samples), the ratio statistics and
effective sample size of the loss (``ratio/*``, ``is/*``), re-sampled groups, queue depth, the
time the trainer waited for rollouts (``time/wait_rollouts``) and trained (``time/train``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tempering.algorithms.offpolicy.loss import AdvantageCap, OffPolicyObjective, _RatioLoss
from tempering.errors import ConfigError
from tempering.interfaces import Loss
from tempering.loss_contract import names_builtin
from tempering.rlmath.aggregation import FOLD_AGGREGATIONS, fold_normaliser
from tempering.rollouts.async_rollout import AsyncRollouts, sampler_of
from tempering.training.rl import RLStage
from tempering.types import Batch, Group

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import RunContext

AGGREGATIONS = ("auto", *FOLD_AGGREGATIONS)


def sums_over_tokens(loss: Loss) -> bool:
    """True for a loss that is a plain sum over tokens (every loss naming a Tinker built-in,
    and this package's losses), which needs its normaliser folded into the advantages; False
    for one that normalises itself (``grpo``'s aggregations)."""
    return isinstance(loss, _RatioLoss) or names_builtin(loss)


@dataclass
class StaleRollouts:
    """The keys and machinery of RL on stale rollouts, one piece of code for every stage that
    trains on them: ``offpolicy`` (always) and ``sdpo`` (when ``max_steps_off_policy`` is set).

    A mixin of an :class:`~tempering.training.rl.RLStage` (it reads the stage's backend, stream,
    sampler, sampling keys and seed). It owns the asynchronous producer
    (:class:`~tempering.rollouts.async_rollout.AsyncRollouts`: rollouts at most ``max_steps_off_policy``
    optimizer steps stale), the advantage cap and the normaliser folded into the advantages
    (:meth:`prepare_advantages`), the sampler-matched objective around the loss
    (:class:`~tempering.algorithms.offpolicy.loss.OffPolicyObjective`: ratio, ESS and KL
    diagnostics) and publishing a sampler snapshot after optimizer steps. Its methods are
    named so that they override nothing: the stage calls them from its own ``validate``,
    ``setup``, ``make_rollouts``, ``prepare`` and ``after_optim``.

    Keys:

    - ``max_steps_off_policy`` (k): the staleness bound; 0 = synchronous on-policy.
    - ``sync_every``: publish a sampler snapshot every this many steps (1 <= it <= k + 1).
    - ``fixed_staleness``: sample batch b with exactly the weights of step max(0, b - k)
      (reproducible, every batch k steps stale) instead of the newest allowed.
    - ``groups_per_sample``: prompts per rollout chunk (0 = a whole batch per chunk).
    - ``aggregation``: the normaliser folded into the advantages of a loss that sums over
      tokens (as Tinker's built-ins and this package's losses do): ``token_mean``, ``seq_mean``
      or ``sum`` (none); ``auto`` (default) = ``token_mean`` for such losses and nothing for a
      loss that normalises itself (``grpo``), which the other values refuse.
    - the loss's ``advantage_cap`` / ``advantage_cap_momentum`` (``clipped_is``: 3 x the running
      mean ``|A|``) are applied in :meth:`prepare_advantages`, before the normaliser.
    - ``max_resamples``: re-samples allowed for a group found beyond the bound.
    - ``seeded_sampling``: derive each chunk's sampling seed from the stage seed and its slot.
    """

    max_steps_off_policy: int = 1
    sync_every: int = 1
    fixed_staleness: bool = False
    groups_per_sample: int = 0
    aggregation: str = "auto"
    max_resamples: int = 2
    seeded_sampling: bool = True

    def check_staleness_keys(self, path: str) -> None:
        """The staleness keys, one line each at their path."""
        k = self.max_steps_off_policy
        if k < 0:
            raise ConfigError(f"must be >= 0, got {k}", f"{path}.max_steps_off_policy")
        if not 1 <= self.sync_every <= k + 1:
            raise ConfigError(
                f"must be between 1 and max_steps_off_policy + 1 = {k + 1} (a sampler older than the bound "
                f"could never be used), got {self.sync_every}",
                f"{path}.sync_every",
            )
        if self.fixed_staleness and self.sync_every != 1:
            raise ConfigError(
                "fixed_staleness needs sync_every: 1 (a snapshot of every step)", f"{path}.fixed_staleness"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"use one of {AGGREGATIONS} (got '{self.aggregation}')", f"{path}.aggregation")

    def setup_corrections(
        self, policy_loss: Any, objective: Any, state: Mapping[str, Any], path: str
    ) -> OffPolicyObjective:
        """Set up the corrections for ``policy_loss`` (the loss the advantages feed): the
        normaliser to fold (``aggregation``) and its advantage cap, whose running mean resumes
        from ``state``. Returns ``objective`` (the loss trained: the policy loss itself, or
        one that blends it in) scored as the sampler drew."""
        summed = sums_over_tokens(policy_loss)
        if not summed and self.aggregation not in ("auto", "sum"):
            raise ConfigError(
                f"{type(policy_loss).__name__} normalises itself (it is not a sum over tokens): folding "
                f"'{self.aggregation}' into its advantages would normalise twice; use auto",
                f"{path}.aggregation",
            )
        self._fold = ("token_mean" if summed else "sum") if self.aggregation == "auto" else self.aggregation
        self.capper = AdvantageCap.for_loss(policy_loss, state.get("advantage_abs_mean"))
        stage: Any = self
        return OffPolicyObjective(objective, stage.temperature, stage.top_k, stage.top_p)

    def async_rollouts(self, ctx: RunContext, state: Mapping[str, Any]) -> AsyncRollouts:
        """The producer, started at the resumed step with a sampler of the current weights."""
        stage: Any = self
        start = int(state.get("step", 0))
        rollouts = AsyncRollouts(
            stage.backend,
            stage.stream,
            stage.rollout_sampler,
            group_size=stage.group_size,
            groups_per_batch=stage.prompts_per_step,
            params=stage.params,
            max_steps_off_policy=self.max_steps_off_policy,
            groups_per_sample=self.groups_per_sample,
            fixed_staleness=self.fixed_staleness,
            first_batch=start,
            last_batch=stage.steps,
            seed=(stage.seed + ctx.seed) if self.seeded_sampling else None,
            max_resamples=self.max_resamples,
        )
        rollouts.start(sampler_of(stage.backend), index=start)
        return rollouts

    def corrections_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the corrections: the advantage cap's running mean."""
        return {"advantage_abs_mean": self.capper.mean}

    def publish_after(self, step: int) -> None:
        """Publish a sampler snapshot after optimizer step ``step`` (every ``sync_every``):
        queued after ``optim_step``, so it holds the new weights."""
        stage: Any = self
        if (step + 1) % self.sync_every == 0:
            stage.rollouts.publish(sampler_of(stage.backend), index=step + 1)

    def prepare_advantages(self, batch: Batch, capper: AdvantageCap) -> dict[str, float]:
        """Cap per-token ``|A|`` (``advantage_cap``), then fold the ``aggregation`` normaliser
        into the advantages, in place: the batch is then exactly what a Tinker built-in (a sum
        over tokens) needs."""
        weights = [d.weights for d in batch.data]
        rows = [list(d.advantages or [0.0] * len(d.weights)) for d in batch.data]
        rows, metrics = capper(rows, weights)
        aggregation = getattr(self, "_fold", None) or ("token_mean" if self.aggregation == "auto" else self.aggregation)
        factors = fold_normaliser(weights, aggregation)
        for d, adv, f in zip(batch.data, rows, factors):
            d.advantages = [a * x for a, x in zip(adv, f)]
        return metrics


@dataclass
class OffPolicyRL(StaleRollouts, RLStage):
    """Asynchronous GRPO-style RL with importance-sampling corrections (see the module docs).

    Keys besides the RL engine's (:class:`~tempering.training.rl.RLStage`): the staleness keys of
    :class:`StaleRollouts` (``max_steps_off_policy``, ``sync_every``, ``fixed_staleness``,
    ``groups_per_sample``, ``aggregation``, ``max_resamples``, ``seeded_sampling``) and the
    loss's ``advantage_cap`` / ``advantage_cap_momentum``.

    Sampler logprobs at ``temperature != 1`` (or with top-k/top-p): the sampler's logprobs are
    those of the tempered, filtered distribution it drew from, so the trainer scores its own
    policy the same way (logits / T, the same filters) and the ratio compares like with like
    (:class:`~tempering.algorithms.offpolicy.loss.OffPolicyObjective`).
    """

    loss: Any = "clipped_is"

    label = "offpolicy"
    summary_keys = ("reward/mean", "accuracy", "loss", "is/ess", "ratio/max", "offpolicy/staleness_mean")
    postfix = {"reward": "reward/mean", "stale": "offpolicy/staleness_mean"}

    def validate(self, ctx: RunContext) -> None:
        self.check_staleness_keys(ctx.path)
        super().validate(ctx)

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        super().setup(ctx, state)
        self._objective = self.setup_corrections(self.loss_fn, self.loss_fn, state, ctx.path)

    def make_rollouts(self, ctx: RunContext, state: Mapping[str, Any]) -> AsyncRollouts:
        return self.async_rollouts(ctx, state)

    def loop_state(self) -> dict[str, Any]:
        return {**super().loop_state(), **self.corrections_state()}

    def prepare(self, ctx: RunContext, batch: Batch, step: int, groups: Sequence[Group]) -> dict[str, Any]:
        return self.prepare_advantages(batch, self.capper)

    def objective(self) -> Any:
        return self._objective

    def after_optim(self, ctx: RunContext, step: int) -> None:
        self.publish_after(step)
