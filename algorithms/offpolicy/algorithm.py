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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tempering.interfaces import Loss
from tempering.rollouts.async_rollout import AsyncRollouts
from tempering.training.rl import RLStage
from tempering.training.stale import MOVED_KEYS, Staleness, StaleRollouts, staleness
from tempering.types import Batch, Group

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import RunContext

__all__ = ["OffPolicyRL"]


@dataclass
class OffPolicyRL(RLStage):
    """Asynchronous GRPO-style RL with importance-sampling corrections (see the module docs).

    The RL engine (:class:`~tempering.training.rl.RLStage`) holding one component, the
    stale-rollout corrections (:class:`~tempering.training.stale.StaleRollouts`), configured by
    its ``stale:`` block (:class:`~tempering.training.stale.Staleness`: ``max_steps_off_policy``
    (default 1), ``sync_every``, ``fixed_staleness``, ``groups_per_sample``, ``aggregation``,
    ``max_resamples``, ``seeded_sampling``); the loss's ``advantage_cap`` /
    ``advantage_cap_momentum`` are applied by it.

    Sampler logprobs at ``temperature != 1`` (or with top-k/top-p): the sampler's logprobs are
    those of the tempered, filtered distribution it drew from, so the trainer scores its own
    policy the same way (logits / T, the same filters) and the ratio compares like with like
    (:class:`~tempering.training.stale.OffPolicyObjective`).
    """

    loss: Any = "clipped_is"
    stale: Any = field(default_factory=dict)

    label = "offpolicy"
    config_blocks: ClassVar[dict[str, type]] = {"stale": Staleness}
    moved_keys: ClassVar[dict[str, str]] = MOVED_KEYS
    summary_keys = ("reward/mean", "accuracy", "loss", "is/ess", "ratio/max", "offpolicy/staleness_mean")
    postfix = {"reward": "reward/mean", "stale": "offpolicy/staleness_mean"}

    def validate(self, ctx: RunContext) -> None:
        staleness(self.stale, f"{ctx.path}.stale")
        super().validate(ctx)

    def make_rollouts(self, ctx: RunContext, state: Mapping[str, Any]) -> AsyncRollouts:
        """The stale-rollout component, set up for the stage's loss (the RL engine calls this
        last in its setup, once the loss and sampler exist), and its producer."""
        keys = staleness(self.stale, f"{ctx.path}.stale")
        self.corrections = StaleRollouts(keys, self.loss_fn, self.loss_fn, self.params, state, ctx.path)
        return self.corrections.start(self, ctx, state)

    def loop_state(self) -> dict[str, Any]:
        return {**super().loop_state(), **self.corrections.state()}

    def prepare(self, ctx: RunContext, batch: Batch, step: int, groups: Sequence[Group]) -> dict[str, Any]:
        return self.corrections.prepare(batch)

    def objective(self) -> Loss:
        return self.corrections.objective

    def after_optim(self, ctx: RunContext, step: int) -> None:
        self.corrections.after_optim(self.backend, step)
