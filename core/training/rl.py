"""The RL engine: one stage loop for every group-relative RL algorithm.

:class:`RLStage` is a :class:`~tempering.training.stage.Stage` that, at each step, takes a batch of
scored groups from a *rollout source*, turns rewards into group-relative advantages
(:func:`build_group_batch`), lets the algorithm prepare the batch (reference logprobs, capped
and folded advantages, ...) and runs ``forward_backward`` + ``optim_step``. What an algorithm
really changes is small and named: where rollouts come from (:class:`SyncRollouts` for
on-policy GRPO, :class:`~tempering.rollouts.async_rollout.AsyncRollouts` for off-policy RL),
:meth:`RLStage.prepare` and the objective it trains (:meth:`RLStage.objective`), and what
happens after an optimizer step (:meth:`RLStage.after_optim`).

Rollouts come from the stage's sampler (``completion`` by default, ``environment`` for
multi-turn tool use), so every RL algorithm trains on single-turn completions and multi-turn
trajectories alike: a trajectory's training rows carry weight 1 exactly on its sampled tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tempering.errors import ConfigError
from tempering.interfaces import AdvantageEstimator, Loss, Sampler
from tempering.loss_contract import ADVANTAGES, ROW_INPUTS, SAMPLER_LOGPROBS, LossSetup, for_stage
from tempering.registry import split_spec
from tempering.rollouts.data import ExampleStream, load_examples
from tempering.rollouts.rollout import RolloutBatch, RolloutSource, collect, rollout_metrics
from tempering.rollouts.scoring import RewardRunner
from tempering.runs.collapse import DEFAULT_STEPS as COLLAPSE_STEPS
from tempering.runs.rollout_log import DEFAULT_GROUPS, log_groups
from tempering.schema import Problem
from tempering.training.dataset_checks import Columns, check_rows, prompt_columns, reward_columns
from tempering.training.evaluate import build_sampler
from tempering.training.stage import SamplingKeys, Stage, build_checked, check_stage
from tempering.types import Batch, Group, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import Backend, RunContext


class SyncRollouts:
    """On-policy rollouts: each step samples its batch now, with the live weights."""

    def __init__(
        self,
        backend: Backend,
        stream: ExampleStream,
        sampler: Sampler,
        group_size: int,
        groups_per_batch: int,
        params: SamplingParams,
    ) -> None:
        self.backend, self.stream, self.sampler = backend, stream, sampler
        self.group_size, self.per_batch, self.params = group_size, groups_per_batch, params

    @property
    def position(self) -> int:
        return self.stream.position

    def next_batch(self, step: int) -> RolloutBatch:
        t0 = time.perf_counter()
        rollout = collect(
            self.sampler,
            self.backend,
            self.stream.take(self.per_batch),
            self.group_size,
            self.params,
            first_id=step * self.per_batch,
        )
        return RolloutBatch(rollout.groups, {**rollout.metrics, "time/rollout": time.perf_counter() - t0})

    def close(self) -> None:
        pass


#: What :func:`build_group_batch` reports of the rewards (left out of an unscored stage's metrics).
REWARD_METRICS = ("reward/mean", "reward/std", "accuracy", "groups/zero_variance_frac")

#: The most samples (``prompts_per_step`` x ``group_size``) one RL step may take: far above any
#: real step (GRPO papers use ~1-16k), far below what would hang building the step's examples.
MAX_SAMPLES_PER_STEP = 1 << 20


@dataclass
class RLStage(SamplingKeys, Stage):
    """Keys shared by every RL stage (``grpo``, ``offpolicy``):

    ``dataset``, ``reward`` (scores completions; for environments, final answers the
    environment leaves unscored; ``null`` in a stage whose signal is not a reward -- on-policy
    distillation's teacher -- where every sample scores 0 and no reward metric is logged),
    ``advantage``, ``loss``, ``sampler`` (``completion`` or
    ``{name: environment, environment: ..., max_turns: ...}``), ``renderer`` (``auto``: the
    model's format), ``steps``, ``prompts_per_step``, ``group_size``, ``max_tokens`` (per model
    turn), ``temperature``, ``top_p``, ``top_k``, ``stop``, ``optimizer``,
    ``drop_zero_variance``, ``reward_timeout``, ``reward_concurrency``, ``success_threshold``,
    ``max_failed_fraction``, ``max_tool_error_fraction``, ``failure_window``, ``log_rollouts``,
    ``collapse_steps``, ``stop_on_collapse``, ``eval``, ``seed``.

    ``log_rollouts`` (default 4): groups per step (and per evaluation) written to
    ``rollouts.jsonl`` -- the first ones, plus every group with a failed sample; 0 = none,
    -1 = all (see :mod:`tempering.runs.rollout_log`).

    ``collapse_steps`` (default 10; 0 = off): one line, once, when this many steps in a row
    had ``groups/zero_variance_frac`` >= 0.9 (no reward spread within groups: nothing to learn
    from), and ``collapsed_at_step`` in the stage's summary; ``stop_on_collapse: true`` (or
    ``tempering run --stop-on-collapse``) stops the stage there, checkpointed (see
    :mod:`tempering.runs.collapse`).

    ``max_failed_fraction`` (default 0.5): the stage stops (checkpointed, resumable, the run
    ends with one line naming the cause) once more than this share of the samples of the last
    ``failure_window`` (default 3) steps failed -- a reward that raises, times out or returns
    no number, an episode whose environment raised. 1 never stops. Each new cause's first
    error is printed once either way (see :mod:`tempering.runs.failures`).

    ``max_tool_error_fraction`` (default 1: never stops): the same for tool calls that fail or
    time out (``env/tool_errors`` of ``env/tool_calls``). Not stopping by default because a
    model learning to call tools makes bad calls (unknown tools, wrong arguments) that count as
    tool errors; set it (say 0.5) when the tools themselves may break. Either way the first
    ``tool_error`` and ``tool_timeout`` are printed once and the stage's summary sums them.
    """

    dataset: Any = field(default_factory=lambda: {"name": "arithmetic"})
    reward: Any = "tempering:exact_match"  # a default means the built-in: never a conflict the user did not write
    advantage: Any = "group_norm"
    loss: Any = "grpo"
    sampler: Any = "completion"
    renderer: Any = "auto"
    prompts_per_step: int = 16
    group_size: int = 8
    drop_zero_variance: bool = False
    reward_timeout: float = 60.0
    reward_concurrency: int = 64
    success_threshold: float = 1.0
    max_failed_fraction: float = 0.5
    max_tool_error_fraction: float = 1.0
    failure_window: int = 3
    log_rollouts: int = DEFAULT_GROUPS
    collapse_steps: int = COLLAPSE_STEPS
    stop_on_collapse: bool = False

    summary_keys: ClassVar[tuple[str, ...]] = ("reward/mean", "accuracy", "loss")
    postfix = {"reward": "reward/mean", "acc": "accuracy"}
    #: Whether the stage trains without a reward (``reward: null``): only a stage whose
    #: ``prepare`` brings its own signal (distillation's teacher); elsewhere it is an error.
    reward_optional: ClassVar[bool] = False

    # ------------------------------------------------------------------ validation and setup
    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The engine's keys' values that cannot work, at their keys (after the stage's and the
        sampling keys' checks)."""
        yield from super().check_config(config)
        c = config
        for key in ("prompts_per_step", "group_size", "reward_concurrency", "failure_window"):
            if c[key] < 1:
                yield Problem(key, f"must be >= 1, got {c[key]}")
        samples = c["prompts_per_step"] * c["group_size"]
        if samples > MAX_SAMPLES_PER_STEP:
            yield Problem(
                "prompts_per_step",
                f"{c['prompts_per_step']} prompts x group_size {c['group_size']} = {samples} samples a step; "
                f"at most {MAX_SAMPLES_PER_STEP} are allowed (a step samples them all before it trains): "
                "lower prompts_per_step",
            )
        if c["collapse_steps"] < 0:
            yield Problem(
                "collapse_steps", f"must be a number of steps >= 0 (0 = never warn), got {c['collapse_steps']}"
            )
        if not (c["reward_timeout"] is None or c["reward_timeout"] > 0):
            yield Problem("reward_timeout", f"must be > 0 (seconds), got {c['reward_timeout']}")
        if c["log_rollouts"] < -1:
            yield Problem("log_rollouts", f"must be a number of groups >= 0, or -1 for all, got {c['log_rollouts']}")
        for key in ("max_failed_fraction", "max_tool_error_fraction"):
            if not 0 <= c[key] <= 1:
                yield Problem(key, f"must be in [0, 1] (1 = never stop), got {c[key]}")
        scored = c["reward"] is not None
        if not (scored or cls.reward_optional):
            yield Problem("reward", f"{cls.label} learns from a reward; give one (e.g. reward: exact_match)")
        if not scored and c["drop_zero_variance"]:
            yield Problem(
                "drop_zero_variance",
                "without a reward every group has zero variance, so every group would be dropped: set it to false",
            )

    def validate(self, ctx: RunContext) -> None:
        components = ("reward", "advantage", "loss") if self.scored else ("advantage", "loss")
        built = check_stage(ctx, self, components, self.dataset_columns(ctx))
        if self.scored:  # without a reward the advantages are the stage's own (prepare)
            name = split_spec(self.advantage, "advantage")[0] if isinstance(self.advantage, (str, Mapping)) else ""
            check_group_size(ctx, built["advantage"], self.group_size, name)

    @property
    def scored(self) -> bool:
        """Whether samples are scored by a reward (``reward`` is not ``null``)."""
        return self.reward is not None

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        self.backend = ctx.backend
        self.reward_runner = (
            RewardRunner(
                build_checked(ctx, "reward", self.reward, "reward"),
                timeout=self.reward_timeout,
                concurrency=self.reward_concurrency,
            )
            if self.scored
            else None  # unscored: every sample keeps reward 0
        )
        self.estimator = ctx.build("advantage", self.advantage, "advantage")
        # what the loss cannot see in a batch (Dr. GRPO's constant normaliser: max_tokens), passed once
        self.loss_fn = for_stage(ctx.build("loss", self.loss, "loss"), LossSetup(max_tokens=self.max_tokens))
        default = type(self).__dataclass_fields__["reward"].default
        written = self.scored and self.reward != default  # the default: nothing to warn about
        self.rollout_sampler = build_sampler(
            ctx, self.sampler, "sampler", self.reward_runner, self.renderer, reward_key="reward" if written else None
        )
        examples = load_examples(ctx, self.dataset, "dataset")
        check_rows(examples, self.dataset_columns(ctx), ctx.path, "dataset")  # rows validate could not peek at
        self.stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))
        self.params = self.sampling_params()
        self.rollouts: RolloutSource = self.make_rollouts(ctx, state)

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """Each row's tokens and weights, the sampler's logprobs and the group-relative advantages
        (the loss contract's names, :mod:`tempering.loss_contract`)."""
        return ROW_INPUTS | {SAMPLER_LOGPROBS, ADVANTAGES}

    def dataset_columns(self, ctx: RunContext) -> Columns:
        """What the rows must hold: a prompt (for the ``completion`` sampler) and the columns
        the reward reads (see :mod:`tempering.training.dataset_checks`)."""
        return prompt_columns(self.sampler, reward_columns(ctx, self.reward))

    def make_rollouts(self, ctx: RunContext, state: Mapping[str, Any]) -> RolloutSource:
        """The rollout source: synchronous, on-policy by default."""
        return SyncRollouts(
            self.backend, self.stream, self.rollout_sampler, self.group_size, self.prompts_per_step, self.params
        )

    def loop_state(self) -> dict[str, Any]:
        return {"position": self.rollouts.position}

    def teardown(self, ctx: RunContext, finished: bool) -> None:
        rollouts = getattr(self, "rollouts", None)
        if rollouts is not None:
            rollouts.close()

    # ------------------------------------------------------------------ one step
    def train_step(self, ctx: RunContext, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        rb = self.rollouts.next_batch(step)
        batch, info = build_group_batch(rb.groups, self.estimator, self.drop_zero_variance, self.success_threshold)
        if not self.scored:  # zeros everywhere: no reward to report, no collapse to warn of
            info = {k: v for k, v in info.items() if k not in REWARD_METRICS}
        metrics: dict[str, Any] = {**info, **rollout_metrics(rb.groups), **rb.metrics}
        log_groups(
            ctx,
            rb.groups,
            "train",
            getattr(ctx, "global_step", step) + 1,
            self.log_rollouts,
            batch.meta["advantages"] if batch is not None else None,
        )
        if batch is None:  # every group was dropped, or no sample is valid: nothing to learn from
            self.after_optim(ctx, step)
            metrics["skipped"] = 1.0
            if "reward/mean" in info:  # zero-variance groups: a real, zero, loss
                metrics["loss"] = 0.0
            return metrics
        metrics.update(self.prepare(ctx, batch, step, rb.groups))
        t1 = time.perf_counter()
        fb = self.backend.forward_backward(batch, self.objective())
        op = self.backend.optim_step(self.adam(step))  # submitted back to back, awaited together
        self.after_optim(ctx, step)
        metrics.update(fb.result())
        metrics.update(op.result())
        metrics["time/train"] = time.perf_counter() - t1
        metrics["tokens_per_s"] = sum(s.num_generated for g in rb.groups for s in g.samples) / (
            time.perf_counter() - t0
        )
        metrics["skipped"] = 0.0
        return metrics

    # ------------------------------------------------------------------ what algorithms change
    def prepare(self, ctx: RunContext, batch: Batch, step: int, groups: Sequence[Group]) -> dict[str, Any]:
        """Complete the batch before training (in place); returns metrics. ``groups``: the
        step's scored groups the batch was built from (:func:`build_group_batch`), for what a
        row alone does not say (siblings, feedback)."""
        return {}

    def objective(self) -> Loss:
        """The loss ``forward_backward`` trains."""
        return self.loss_fn

    def after_optim(self, ctx: RunContext, step: int) -> None:
        """Called once the step's training calls are submitted (or the step was skipped)."""


def check_group_size(ctx: RunContext, estimator: AdvantageEstimator, group_size: int, name: str = "") -> None:
    """``group_size`` must give the advantage estimator something to compare: a probe batch
    of two groups with distinct rewards must get some non-zero, finite advantage. A
    group-relative estimator (``group_norm``, ``rloo``, ...) gives a group of 1 advantage 0
    forever -- nothing would be learned."""
    import torch  # here, not at the top: validating a recipe imports this module without torch

    name = name or getattr(estimator, "__name__", type(estimator).__name__)
    path = f"{ctx.path}.group_size"
    rewards = torch.arange(2 * group_size, dtype=torch.float32)
    gids = torch.arange(2).repeat_interleave(group_size)
    try:
        adv = torch.as_tensor(estimator(rewards, gids)).float()
    except Exception as exc:  # noqa: BLE001 - reported with the key that causes it
        raise ConfigError(
            f"advantage '{name}' fails on groups of {group_size}: {type(exc).__name__}: {exc}", path
        ) from None
    if bool(torch.isfinite(adv).all()) and bool(adv.abs().sum() > 0):
        return
    what = f"groups of {group_size} get advantages {[round(a, 3) for a in adv.tolist()[:4]]}: nothing would be learned"
    if group_size < 2:
        raise ConfigError(
            f"must be >= 2 with advantage '{name}', got {group_size} (it compares the samples of a group: {what})", path
        )
    raise ConfigError(f"advantage '{name}': {what}", path)


def build_group_batch(
    groups: list[Group], estimator: AdvantageEstimator, drop_zero_variance: bool = False, success_threshold: float = 1.0
) -> tuple[Batch | None, dict[str, float]]:
    """Advantages over the trainable samples, then one :class:`~tempering.types.Datum` per
    training row (a single-turn sample has one; a multi-turn trajectory one per segment).

    Failed and masked samples, and (optionally) zero-variance groups, get weight 0: they stay
    visible in the metrics but do not move the policy. With no valid sample at all there is no
    batch and no ``reward/mean`` / ``accuracy``: a batch of failures has no reward to report
    (a 0 would read as one).
    """
    import torch

    from tempering.rlmath.advantages import zero_variance_groups

    samples = [s for g in groups for s in g.samples]
    gids = torch.tensor([g.group_id for g in groups for _ in g.samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    valid = torch.tensor([s.trainable for s in samples])
    adv = torch.zeros_like(rewards)
    zero_var = torch.zeros_like(valid)
    if valid.any():
        adv[valid] = estimator(rewards[valid], gids[valid]).float()
        zero_var[valid] = zero_variance_groups(rewards[valid], gids[valid])
    keep = valid & ~zero_var if drop_zero_variance else valid
    ok = rewards[valid]
    info = {"advantage/abs_mean": float(adv[keep].abs().mean()) if keep.any() else 0.0}
    if len(ok):
        info.update(
            {
                "reward/mean": float(ok.mean()),
                "reward/std": float(ok.std()) if len(ok) > 1 else 0.0,
                "accuracy": float((ok >= success_threshold - 1e-9).float().mean()),
                "groups/zero_variance_frac": float(zero_var[valid].float().mean()),
            }
        )
    if not keep.any():
        return None, info
    data = [
        seg.to_datum(advantage=float(a), weight=1.0 if k else 0.0)
        for s, a, k in zip(samples, adv.tolist(), keep.tolist())
        for seg in s.segments()
    ]
    # per-sample advantages ride along in meta, for the rollout log
    return Batch(data, meta={"num_groups": len(groups), "advantages": adv.tolist()}), info
