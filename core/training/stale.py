"""RL on stale rollouts: a component an RL stage holds, with its own ``stale:`` config block.

Sampling runs concurrently with training: a producer
(:class:`~tempering.rollouts.async_rollout.AsyncRollouts`) keeps rolling out groups from the newest
sampler snapshot it may use, at most ``max_steps_off_policy`` optimizer steps stale, and the
trainer corrects for the staleness. What the corrections are, in one place for every stage that
trains on stale rollouts (``offpolicy`` always; ``sdpo`` when its ``stale:`` block is set):

* the loss is scored as the sampler drew (:class:`OffPolicyObjective`: ``logits / T``, the same
  top-k / top-p filters), so the importance ratio against the sampler's logprobs compares like
  with like, and ratio / ESS diagnostics are logged whatever the loss;
* the policy loss's advantages are capped (:class:`~tempering.rlmath.advantage_cap.AdvantageCap`,
  when the loss asks for it: ``clipped_is``) and the ``aggregation`` normaliser is folded into them
  (:func:`~tempering.rlmath.aggregation.fold_normaliser`) for a loss that sums over tokens, as
  Tinker's built-ins do;
* a sampler snapshot is published after every ``sync_every`` optimizer steps.

A stage builds :class:`StaleRollouts` at setup from its block (:class:`Staleness`) and calls it at
four named points: ``start`` (the rollout source, from the stage's typed rollout settings),
``prepare`` (the corrections, on the batch), ``after_optim`` (publish) and ``state`` (what a
checkpoint keeps). Everything else it needs is an argument.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import tempering.loss_contract as loss_contract
from tempering.errors import ConfigError
from tempering.interfaces import Loss, LossOutput, at_positions, from_positions
from tempering.loss_contract import TARGET_IDS, loss_reads
from tempering.rlmath.advantage_cap import AdvantageCap
from tempering.rlmath.aggregation import FOLD_AGGREGATIONS, fold_normaliser
from tempering.rollouts.async_rollout import AsyncRollouts, sampler_of
from tempering.schema import Problem, one_of
from tempering.training.stage import sub_config
from tempering.types import Batch, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tempering.interfaces import Backend, RunContext
    from tempering.training.rl import RLStage

__all__ = [
    "AGGREGATIONS",
    "MOVED_KEYS",
    "OffPolicyObjective",
    "StaleRollouts",
    "Staleness",
    "sampling_logprobs",
    "staleness",
]

AGGREGATIONS = ("auto", *FOLD_AGGREGATIONS)


@dataclass
class Staleness:
    """The ``stale:`` block.

    - ``max_steps_off_policy`` (k): the staleness bound; 0 = synchronous on-policy.
    - ``sync_every``: publish a sampler snapshot every this many steps (1 <= it <= k + 1).
    - ``fixed_staleness``: sample batch b with exactly the weights of step max(0, b - k)
      (reproducible, every batch k steps stale) instead of the newest allowed.
    - ``groups_per_sample``: prompts per rollout chunk (0 = a whole batch per chunk).
    - ``aggregation``: the normaliser folded into the advantages of a loss that sums over
      tokens (as Tinker's built-ins and the ``offpolicy`` losses do): ``token_mean``,
      ``seq_mean`` or ``sum`` (none); ``auto`` (default) = ``token_mean`` for such losses and
      nothing for a loss that normalises itself (``grpo``), which the other values refuse.
    - ``max_resamples``: re-samples allowed for a group found beyond the bound.
    - ``seeded_sampling``: derive each chunk's sampling seed from the stage seed and its slot.

    The loss's ``advantage_cap`` / ``advantage_cap_momentum`` (``clipped_is``: 3 x the running
    mean ``|A|``) are applied too, before the normaliser.
    """

    max_steps_off_policy: int = 1
    sync_every: int = 1
    fixed_staleness: bool = False
    groups_per_sample: int = 0
    aggregation: str = "auto"
    max_resamples: int = 2
    seeded_sampling: bool = True

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values that cannot work, at their keys."""
        k = config["max_steps_off_policy"]
        if k < 0:
            yield Problem("max_steps_off_policy", f"must be >= 0, got {k}")
        elif not 1 <= config["sync_every"] <= k + 1:
            yield Problem(
                "sync_every",
                f"must be between 1 and max_steps_off_policy + 1 = {k + 1} (a sampler older than the bound "
                f"could never be used), got {config['sync_every']}",
            )
        if config["fixed_staleness"] and config["sync_every"] != 1:
            yield Problem("fixed_staleness", "fixed_staleness needs sync_every: 1 (a snapshot of every step)")
        if config["groups_per_sample"] < 0:
            yield Problem("groups_per_sample", f"must be >= 0 (0 = a whole batch), got {config['groups_per_sample']}")
        if config["max_resamples"] < 0:
            yield Problem("max_resamples", f"must be >= 0, got {config['max_resamples']}")
        aggregation = config["aggregation"]
        yield one_of("aggregation", aggregation, AGGREGATIONS, f"use one of {AGGREGATIONS} (got '{aggregation}')")


#: The flat keys of earlier versions -> the block they moved to: a stage's ``moved_keys``
#: (:data:`tempering.registry.MOVED_KEYS_HOOK`), so an old recipe gets one line saying where.
MOVED_KEYS = {f.name: f"stale: {{{f.name}: ...}}" for f in fields(Staleness)}


def staleness(value: object, path: str) -> Staleness:
    """The ``stale:`` block at ``path``, checked (``{}``: every default)."""
    return sub_config(Staleness, value, path)


class StaleRollouts:
    """The stale-rollout component (see the module docstring), set up for one stage.

    ``policy_loss``: the loss the advantages feed (its cap, whether it sums over tokens);
    ``objective``: the loss trained (the policy loss itself, or one that blends it in), wrapped
    to be scored as the sampler drew with ``params``; ``state``: the stage's checkpointed state
    (the cap's running mean resumes from it); ``path``: the stage's config path, for errors.
    """

    def __init__(
        self,
        keys: Staleness,
        policy_loss: Loss,
        objective: Loss,
        params: SamplingParams,
        state: Mapping[str, Any],
        path: str,
    ) -> None:
        summed = loss_contract.sums_over_tokens(policy_loss)
        if not summed and keys.aggregation not in ("auto", "sum"):
            raise ConfigError(
                f"{type(policy_loss).__name__} normalises itself (it is not a sum over tokens): folding "
                f"'{keys.aggregation}' into its advantages would normalise twice; use auto",
                f"{path}.stale.aggregation",
            )
        self.keys = keys
        self.fold = ("token_mean" if summed else "sum") if keys.aggregation == "auto" else keys.aggregation
        self.capper = AdvantageCap.for_loss(policy_loss, state.get("advantage_abs_mean"))
        self.objective = OffPolicyObjective(objective, params.temperature, params.top_k, params.top_p)
        self.source: AsyncRollouts | None = None

    def start(self, stage: RLStage, ctx: RunContext, state: Mapping[str, Any]) -> AsyncRollouts:
        """The producer of ``stage``'s rollouts (its backend, example stream, sampler, group and
        batch sizes, sampling params and steps), started at the resumed step (``state``) with a
        sampler of the backend's current weights: the stage's rollout source. Each chunk's
        sampling seed derives from the stage's and the run's seeds (with ``seeded_sampling``)."""
        keys = self.keys
        first_step = int(state.get("step", 0))
        seed = stage.seed + ctx.seed
        self.source = AsyncRollouts(
            stage.backend,
            stage.stream,
            stage.rollout_sampler,
            group_size=stage.group_size,
            groups_per_batch=stage.prompts_per_step,
            params=stage.params,
            max_steps_off_policy=keys.max_steps_off_policy,
            groups_per_sample=keys.groups_per_sample,
            fixed_staleness=keys.fixed_staleness,
            first_batch=first_step,
            last_batch=stage.steps,
            seed=seed if keys.seeded_sampling else None,
            max_resamples=keys.max_resamples,
        )
        self.source.start(sampler_of(stage.backend), index=first_step)
        return self.source

    def prepare(self, batch: Batch) -> dict[str, float]:
        """Cap per-token ``|A|`` (the loss's ``advantage_cap``), then fold the normaliser into the
        advantages, in place: the batch is then exactly what a Tinker built-in (a sum over tokens)
        needs. Returns the cap's metrics."""
        weights = [d.weights for d in batch.data]
        rows = [list(d.advantages or [0.0] * len(d.weights)) for d in batch.data]
        rows, metrics = self.capper(rows, weights)
        factors = fold_normaliser(weights, self.fold)
        for d, adv, f in zip(batch.data, rows, factors):
            d.advantages = [a * x for a, x in zip(adv, f)]
        return metrics

    def after_optim(self, backend: Backend, step: int) -> None:
        """Publish a sampler snapshot after optimizer step ``step`` (every ``sync_every``):
        queued after ``optim_step``, so it holds the new weights."""
        if self.source is not None and (step + 1) % self.keys.sync_every == 0:
            self.source.publish(sampler_of(backend), index=step + 1)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps: the advantage cap's running mean."""
        return {"advantage_abs_mean": self.capper.mean}


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
    import torch

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
        import torch

        from tempering.rlmath.diagnostics import ratio_stats
        from tempering.rlmath.masks import active, masked

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
