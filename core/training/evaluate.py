"""Held-out evaluation: greedy (or sampled) rollouts scored like training scores them.

Evaluation goes through a sampler, like training: a single-turn task is scored on its
completion, a tool-use task is played as whole episodes of its environment, so the number a
stage reports is the number of the task it trains on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tempering.interfaces import Tokenizer, model_renderer
from tempering.registry import get_registry
from tempering.rollouts.data import load_examples
from tempering.rollouts.renderer import build_renderer, chat_text_prompts, renderer_spec
from tempering.rollouts.rollout import SamplerContext, collect, rollout_metrics
from tempering.rollouts.scoring import RewardRunner
from tempering.runs.calibration import calibration, forecasts_of, reliability_diagram, reliability_path
from tempering.runs.failures import failure_metrics
from tempering.runs.outcomes import outcome_metrics
from tempering.runs.rollout_log import DEFAULT_GROUPS, log_groups
from tempering.training.progress import paused
from tempering.types import Group, Sample, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import Backend, BuildContext, RunContext, Sampler
    from tempering.training.stage import EvalConfig, Stage


def evaluate(
    backend: Backend,
    examples: Sequence[Mapping[str, Any]],
    reward: Callable[..., Any] | None,
    max_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 256,
    success_threshold: float = 1.0,
    sampler: Sampler | None = None,
    on_groups: Callable[[list[Group]], Any] | None = None,
    tracebacks: bool = False,
    on_progress: Callable[[int, int], Any] | None = None,
) -> dict[str, Any]:
    """Mean reward and accuracy (share of rewards >= ``success_threshold``) on ``examples``.

    ``sampler`` defaults to single-turn completions (built for ``backend``'s tokenizer).
    What answering cost, as sums over the examples (divide by ``eval/n`` for the mean per
    episode, the latency and token figures a search agent is judged on next to its accuracy):
    ``eval/generated_tokens`` (the tokens the model wrote, every turn), ``eval/turns`` (model
    calls: 1 per single-turn example) and ``eval/seconds`` (wall clock of the whole evaluation,
    episodes batched). Failed samples count as wrong (reward 0) and are counted in ``eval/failed``, per cause in
    ``eval/failed/<cause>`` with the first error's text in ``eval/first_error/<cause>`` (see
    :mod:`tempering.runs.failures`), scored samples by their reward's label in
    ``eval/outcome/<label>`` (:mod:`tempering.runs.outcomes`); masked episodes (a limit
    configured to mask) count as wrong too.
    ``on_groups`` sees each chunk's scored groups (the rollout log keeps some). ``tracebacks``:
    also the first traceback per cause (``eval/first_traceback/<cause>``), for a stage's
    :class:`~tempering.runs.failures.FailureWatch` to print. ``on_progress(done, total)`` is
    called before the first chunk and after each (a stage's bar shows ``[eval done/total]``).
    A reward's own batch metrics (a :class:`~tempering.interfaces.PolicyReward`'s:
    ``monitor/accuracy``) come back under ``eval/``, averaged over chunks by their size.
    """
    if sampler is None:
        sampler = completion_sampler(
            backend.tokenizer, model_renderer(backend), RewardRunner(reward) if reward is not None else None
        )
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    rewards: list[float] = []
    failures: list[Sample] = []
    scored: list[Sample] = []
    extra: dict[str, Any] = {}
    batch_metrics: dict[str, float] = {}
    generated = turns = 0
    t0 = time.perf_counter()
    for start in range(0, len(examples), batch_size):
        if on_progress is not None:
            on_progress(start, len(examples))
        chunk = [dict(e) for e in examples[start : start + batch_size]]
        rollout = collect(sampler, backend, chunk, 1, params, first_id=start)
        if on_groups is not None:
            on_groups(rollout.groups)
        samples = [g.samples[0] for g in rollout.groups]
        failures += [s for s in samples if s.failed]
        scored += samples
        generated += sum(s.num_generated for s in samples)
        turns += sum(len(s.trajectory.turns) if s.trajectory is not None else 1 for s in samples)
        rewards += [0.0 if (s.failed or s.masked) else s.reward for s in samples]
        for k, v in rollout.stats.metrics.items():
            batch_metrics[k] = batch_metrics.get(k, 0.0) + v * len(chunk)
        for k, v in rollout_metrics(rollout.groups).items():
            if (
                k.startswith("env/")
                and isinstance(v, float)
                and not k.startswith("env/stop/")
                and k != "env/turns_mean"
            ):
                extra[f"eval/{k[4:]}"] = extra.get(f"eval/{k[4:]}", 0.0) + v
    if on_progress is not None:
        on_progress(len(examples), len(examples))
    n = max(len(rewards), 1)
    return {
        "eval/reward": sum(rewards) / n,
        "eval/accuracy": sum(r >= success_threshold - 1e-9 for r in rewards) / n,
        "eval/failed": float(len(failures)),
        "eval/n": float(len(rewards)),
        "eval/generated_tokens": float(generated),
        "eval/turns": float(turns),
        "eval/seconds": time.perf_counter() - t0,
        **extra,
        **{f"eval/{k}": v / n for k, v in batch_metrics.items()},
        **failure_metrics(failures, prefix="eval/", tracebacks=tracebacks),
        **outcome_metrics(scored, prefix="eval/"),
    }


def completion_sampler(
    tokenizer: Tokenizer, declared: str | None, reward: RewardRunner | None, renderer: object = "auto"
) -> Any:
    """A ``completion`` sampler outside a recipe (tests, notebooks): renderer ``auto`` is
    resolved (to ``declared``, the model's own renderer: :func:`tempering.interfaces.model_renderer`)
    through the process-wide registry when a chat example needs it; text prompts follow the
    stages' rule (:func:`tempering.rollouts.renderer.chat_text_prompts`)."""
    built: list[Any] = []

    def make_renderer() -> Any:
        if not built:
            spec = renderer_spec(renderer, tokenizer, declared)
            built.append(get_registry().build("renderer", spec, "renderer", tokenizer=tokenizer))
        return built[0]

    reg = get_registry()
    context = SamplerContext(
        tokenizer,
        make_renderer,
        reward,
        build=lambda kind, spec, key: reg.build(kind, spec, key),
        factory=lambda kind, spec, key: reg.factory(kind, spec, key),
        chat_prompts=chat_text_prompts(renderer, tokenizer, declared),
    )
    return reg.build(
        "sampler", "tempering:completion", "sampler", context=context
    )  # the built-in, through the registry


def eval_reward(ev: EvalConfig, stage: object) -> Any:
    """The reward an evaluation (``ev``: an :class:`~tempering.training.stage.EvalConfig`) scores with:
    ``eval.reward``, else the stage's own ``reward``, else the built-in ``exact_match``."""
    if ev.reward is not None:
        return ev.reward
    own = getattr(stage, "reward", None)
    return own if own is not None else "tempering:exact_match"


class StageEvaluator:
    """A stage's held-out evaluation (:class:`tempering.training.stage.EvalConfig`), when configured.

    It samples through ``eval.sampler``, else the stage's own sampler (so a tool-use stage is
    evaluated on whole episodes), with the stage's renderer.
    """

    def __init__(self, ctx: RunContext, cfg: EvalConfig, stage: Stage | None = None) -> None:
        self.ctx, self.cfg, self.stage = ctx, cfg, stage
        #: The stage's progress bar: an evaluation shows its phase there and is paused out of
        #: its time estimate (:func:`tempering.training.progress.paused`); None: no bar.
        self.bar: Any = None
        self.examples = load_examples(ctx, cfg.dataset, "eval.dataset") if cfg.dataset is not None else None
        self.sampler = None
        if self.examples:
            # the stage's limits: a reward that needs minutes per batch in training (the monitor
            # samples the policy, then asks a judge) needs them in evaluation too
            limits = {
                k: getattr(stage, f"reward_{k}") for k in ("timeout", "concurrency") if hasattr(stage, f"reward_{k}")
            }
            reward = RewardRunner(ctx.build("reward", eval_reward(cfg, stage), "eval.reward"), **limits)
            spec = cfg.sampler if cfg.sampler is not None else (stage.eval_sampler() if stage is not None else None)
            key = "eval.sampler" if cfg.sampler is not None else "sampler"
            self.sampler = build_sampler(ctx, spec or "completion", key, reward, getattr(stage, "renderer", "auto"))

    def run(self, at_start: bool = False) -> dict[str, Any]:
        if not self.examples or (at_start and not self.cfg.at_start):
            return {}
        groups: list[Group] = []
        with paused(self.bar, "eval") as report:
            metrics = evaluate(
                self.ctx.backend,
                self.examples,
                None,
                self.cfg.max_tokens,
                self.cfg.temperature,
                sampler=self.sampler,
                on_groups=groups.extend,
                tracebacks=True,
                on_progress=report,
            )
        step = getattr(self.ctx, "global_step", 0)
        count = getattr(self.stage, "log_rollouts", DEFAULT_GROUPS)
        log_groups(self.ctx, groups, "eval", step, count)
        metrics.update(self.calibrate(groups, step))
        return metrics

    def calibrate(self, groups: Sequence[Group], step: int) -> dict[str, float]:
        """For probability answers (a reward reporting the forecast ``p`` and outcome ``y``, as
        ``brier``/``brier_skill`` do): ``eval/brier``, ``eval/brier_skill``, ``eval/ece``,
        ``eval/base_rate`` and ``eval/forecasts`` (how many parsed: ``eval/n`` minus those that
        failed) over the parsed forecasts, and a reliability diagram PNG in the run folder
        (:func:`tempering.runs.calibration.reliability_path`). Nothing for other rewards."""
        pairs = forecasts_of(groups)
        if not pairs:
            return {}
        cal = calibration([p for p, _ in pairs], [y for _, y in pairs])
        output_dir = getattr(self.ctx, "output_dir", None)
        if output_dir:
            stage_id = getattr(self.ctx, "stage_id", "") or "eval"
            title = f"{stage_id}, step {step}"
            reliability_diagram(cal, reliability_path(output_dir, stage_id, step), title)
        return cal.metrics("eval/")

    def accuracy(self, size: int | None = None) -> float:
        """Held-out accuracy on the first ``size`` examples (all when None), nothing logged: the
        cheap, frequent check behind ``eval.stop_at_accuracy`` (``eval.stop_every``/``stop_size``)."""
        examples = (self.examples or [])[:size]
        if not examples:
            return 0.0
        with paused(self.bar, "stop check") as report:
            metrics = evaluate(
                self.ctx.backend,
                examples,
                None,
                self.cfg.max_tokens,
                self.cfg.temperature,
                sampler=self.sampler,
                on_progress=report,
            )
        return float(metrics["eval/accuracy"])


def build_sampler(
    ctx: BuildContext,
    spec: object,
    key: str,
    reward: RewardRunner | None,
    renderer: object = "auto",
    reward_key: str | None = None,
) -> Any:
    """Build a stage's sampler (``key`` is its config path under the stage), with the context
    it needs: the backend's tokenizer, the stage's renderer (built on first use), whether text
    prompts are rendered as user turns, and the reward (``reward_key``: its key under the stage,
    when the user wrote it)."""
    built: list[Any] = []

    def make_renderer() -> Any:
        if not built:
            built.append(build_renderer(ctx, renderer))
        return built[0]

    context = SamplerContext(
        ctx.backend.tokenizer,
        make_renderer,
        reward,
        build=lambda kind, s, k: ctx.build(kind, s, f"{key}.{k}"),
        factory=lambda kind, s, k: ctx.factory(kind, s, f"{key}.{k}"),
        path=f"{ctx.path}.{key}",
        chat_prompts=chat_text_prompts(renderer, ctx.backend.tokenizer, model_renderer(ctx.backend)),
        reward_key=f"{ctx.path}.{reward_key}" if reward_key else None,
    )
    return ctx.build("sampler", spec, key, context=context)
