"""The ``offpolicy`` stage: GRPO-style RL whose sampling runs concurrently with training.

A producer (:class:`tempering.async_rollout.AsyncRollouts`) keeps sampling groups from the
newest sampler snapshot it may use and streams each sample to the reward as soon as its sample
call returns; the trainer takes one batch of ``prompts_per_step`` groups per step, builds
group-relative advantages (:func:`tempering.algorithms.grpo.algorithm.build_group_batch`),
caps and normalises them, and runs ``forward_backward`` + ``optim_step``; right after the
optimizer step it publishes a fresh sampler snapshot (every ``sync_every`` steps). A rollout
is at most ``max_steps_off_policy`` optimizer steps stale; the loss corrects for that with
importance ratios against the sampler's logprobs.

Per step it logs the staleness (mean / max / min over samples), the ratio statistics and
effective sample size of the loss (``ratio/*``, ``is/*``), re-sampled groups, queue depth, the
time the trainer waited for rollouts (``time/wait_rollouts``) and trained (``time/train``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tempering.async_rollout import AsyncRollouts, sampler_of
from tempering.data import ExampleStream, load_examples
from tempering.errors import ConfigError
from tempering.evaluate import StageEvaluator
from tempering.progress import progress
from tempering.scoring import RewardRunner
from tempering.stage import EvalConfig, OptimizerConfig, check_stage, sub_config
from tempering.types import Batch, SamplingParams

from tempering.algorithms.grpo.algorithm import build_group_batch
from tempering.algorithms.offpolicy.loss import AdvantageCap, OffPolicyObjective, fold_normaliser

AGGREGATIONS = ("auto", "token_mean", "seq_mean", "sum")


def sums_over_tokens(loss: Any) -> bool:
    """True for a loss that is a plain sum over tokens (every loss naming a Tinker built-in,
    and this package's losses), which needs its normaliser folded into the advantages; False
    for one that normalises itself (``grpo``'s aggregations)."""
    from tempering.algorithms.offpolicy.loss import _RatioLoss

    return isinstance(loss, _RatioLoss) or getattr(loss, "tinker_builtin", None) is not None


@dataclass
class OffPolicyRL:
    """Asynchronous GRPO-style RL with importance-sampling corrections (see the module docs).

    Keys shared with ``grpo``: ``dataset``, ``reward``, ``advantage``, ``loss``, ``steps``,
    ``prompts_per_step``, ``group_size``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``,
    ``stop``, ``optimizer``, ``drop_zero_variance``, ``reward_timeout``, ``success_threshold``,
    ``eval``, ``seed``. Off-policy keys:

    - ``max_steps_off_policy`` (k): the staleness bound; 0 = synchronous on-policy.
    - ``sync_every``: publish a sampler snapshot every this many steps (1 <= it <= k + 1).
    - ``fixed_staleness``: sample batch b with exactly the weights of step max(0, b - k)
      (reproducible, every batch k steps stale) instead of the newest allowed.
    - ``groups_per_sample``: prompts per sample call (0 = a whole batch per call).
    - ``aggregation``: the normaliser folded into the advantages of a loss that sums over
      tokens (as Tinker's built-ins and this package's losses do): ``token_mean``, ``seq_mean``
      or ``sum`` (none); ``auto`` (default) = ``token_mean`` for such losses and nothing for a
      loss that normalises itself (``grpo``), which the other values refuse.
    - the loss's ``advantage_cap`` / ``advantage_cap_momentum`` (``clipped_is``: 3 x the running
      mean ``|A|``) are applied here, before the normaliser.
    - ``max_resamples``: re-samples allowed for a group found beyond the bound.
    - ``seeded_sampling``: derive each sample call's seed from the stage seed and its slot.
    - ``reward_concurrency``: rewards in flight at once.

    Sampler logprobs at ``temperature != 1`` (or with top-k/top-p): the sampler's logprobs are
    those of the tempered, filtered distribution it drew from, so the trainer scores its own
    policy the same way (logits / T, the same filters) and the ratio compares like with like
    (:class:`~tempering.algorithms.offpolicy.loss.OffPolicyObjective`).
    """

    dataset: Any = field(default_factory=lambda: {"name": "arithmetic"})
    reward: Any = "exact_match"
    advantage: Any = "group_norm"
    loss: Any = "clipped_is"
    steps: int = 50
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list = field(default_factory=list)  # type: ignore[type-arg]
    optimizer: Any = field(default_factory=lambda: {"learning_rate": 1e-4})
    drop_zero_variance: bool = False
    reward_timeout: float = 60.0
    reward_concurrency: int = 64
    success_threshold: float = 1.0
    eval: Any = field(default_factory=dict)
    seed: int = 0
    max_steps_off_policy: int = 1
    sync_every: int = 1
    fixed_staleness: bool = False
    groups_per_sample: int = 0
    aggregation: str = "auto"
    max_resamples: int = 2
    seeded_sampling: bool = True

    def validate(self, ctx: Any) -> None:
        """Check every nested block before any stage trains."""
        path = ctx.path
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
            raise ConfigError("fixed_staleness needs sync_every: 1 (a snapshot of every step)", f"{path}.fixed_staleness")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"use one of {AGGREGATIONS} (got '{self.aggregation}')", f"{path}.aggregation")
        for key in ("prompts_per_step", "group_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, key)}", f"{path}.{key}")
        check_stage(ctx, self, ("reward", "advantage", "loss"))

    # ------------------------------------------------------------------ the loop
    def run(self, ctx: Any) -> dict[str, Any]:
        self.validate(ctx)
        path = ctx.path
        backend = ctx.backend
        opt = sub_config(OptimizerConfig, self.optimizer, f"{path}.optimizer")
        ev = sub_config(EvalConfig, self.eval, f"{path}.eval")
        reward = ctx.build("reward", self.reward, "reward")
        estimator = ctx.build("advantage", self.advantage, "advantage")
        loss = ctx.build("loss", self.loss, "loss")
        if getattr(loss, "max_completion_length", 0) is None:
            loss.max_completion_length = self.max_tokens  # a grpo loss with Dr. GRPO's constant
        summed = sums_over_tokens(loss)
        if not summed and self.aggregation not in ("auto", "sum"):
            raise ConfigError(
                f"{type(loss).__name__} normalises itself (it is not a sum over tokens): folding "
                f"'{self.aggregation}' into its advantages would normalise twice; use auto",
                f"{path}.aggregation",
            )
        self._fold = ("token_mean" if summed else "sum") if self.aggregation == "auto" else self.aggregation
        objective = OffPolicyObjective(loss, self.temperature, self.top_k, self.top_p)
        runner = RewardRunner(reward, timeout=self.reward_timeout, concurrency=self.reward_concurrency)
        examples = load_examples(ctx, self.dataset, "dataset")
        state = ctx.resume_state or {}
        stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))
        start = int(state.get("step", 0))
        capper = AdvantageCap(
            getattr(loss, "advantage_cap", None), getattr(loss, "advantage_cap_momentum", 0.9), state.get("advantage_abs_mean")
        )
        evaluator = StageEvaluator(ctx, ev)
        sampling = SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, list(self.stop))
        last: dict[str, Any] = {}
        if start == 0 and (first := evaluator.run(at_start=True)):
            ctx.log(first)
            last.update(first)
        rollouts = AsyncRollouts(
            backend, stream, runner,
            group_size=self.group_size, groups_per_batch=self.prompts_per_step, params=sampling,
            max_steps_off_policy=self.max_steps_off_policy, groups_per_sample=self.groups_per_sample,
            fixed_staleness=self.fixed_staleness, first_batch=start, last_batch=self.steps,
            seed=(self.seed + ctx.seed) if self.seeded_sampling else None, max_resamples=self.max_resamples,
        )  # fmt: skip
        bar = progress(self.steps, f"{ctx.stage_id} (offpolicy, k={self.max_steps_off_policy})", initial=start)
        timeouts = 0
        t_prev = time.perf_counter()
        rollouts.start(sampler_of(backend), index=start)
        try:
            for step in range(start, self.steps):
                if not ctx.budget_left():
                    break
                metrics = self._step(ctx, rollouts, estimator, objective, capper, opt.adam(step, self.steps), step)
                metrics["reward/timeouts"] = float(rollouts.stats.timeouts - timeouts)
                timeouts = rollouts.stats.timeouts
                now = time.perf_counter()
                metrics["step_time"], t_prev = now - t_prev, now
                ctx.end_step({"step": step + 1, "position": rollouts.position, "advantage_abs_mean": capper.mean})
                if ev.every and (step + 1) % ev.every == 0 and step + 1 < self.steps:
                    metrics.update(evaluator.run())
                ctx.log(metrics)
                last.update(metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", stale=f"{metrics['offpolicy/staleness_mean']:.1f}")
        finally:
            rollouts.close()
            bar.close()
        if final := evaluator.run():
            ctx.log(final)
            last.update(final)
        keep = ("reward/mean", "accuracy", "loss", "is/ess", "ratio/max", "offpolicy/staleness_mean")
        return {k: v for k, v in last.items() if k in keep or k.startswith("eval/")}

    def _step(self, ctx: Any, rollouts: AsyncRollouts, estimator: Any, objective: OffPolicyObjective,
              capper: AdvantageCap, adam: Any, step: int) -> dict[str, Any]:  # fmt: skip
        backend = ctx.backend
        rb = rollouts.next_batch(step)
        batch, info = build_group_batch(rb.groups, estimator, self.drop_zero_variance, self.success_threshold)
        failed = sum(s.failed for g in rb.groups for s in g.samples)
        metrics: dict[str, Any] = {**info, **rb.metrics, "reward/failed": float(failed)}
        t1 = time.perf_counter()
        if batch is None:  # nothing to learn from: no optimizer step, but the sampler gate moves on
            if (step + 1) % self.sync_every == 0:
                rollouts.publish(sampler_of(backend), index=step + 1)
            metrics.update(loss=0.0, skipped=1.0)
            return metrics
        metrics.update(self.prepare_advantages(batch, capper))
        fb = backend.forward_backward(batch, objective)
        op = backend.optim_step(adam)
        if (step + 1) % self.sync_every == 0:  # queued after optim_step: a snapshot of the new weights
            rollouts.publish(sampler_of(backend), index=step + 1)
        metrics.update(fb.result())
        metrics.update(op.result())
        metrics["time/train"] = time.perf_counter() - t1
        metrics["skipped"] = 0.0
        return metrics

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
