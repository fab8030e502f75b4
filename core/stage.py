"""What every training stage shares: the loop skeleton (:class:`Stage`), optimizer settings
and held-out evaluation settings.

A stage subclasses :class:`Stage` and writes only what is its own -- ``setup`` (build its
components, restore its position), ``train_step`` (one optimizer step), ``loop_state`` (what a
checkpoint must remember to resume) and ``teardown``. :meth:`Stage.run` owns the rest, once for
all stages: the evaluation at the start, the progress bar, the step budget, ``end_step`` and its
checkpoints, periodic evaluation (and stopping early at a target accuracy), logging and the
final evaluation.

The ``optimizer:`` and ``eval:`` blocks are validated with their own schema so a misspelt key
reports e.g. ``stages[1].optimizer.learnig_rate``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from tempering.errors import ConfigError
from tempering.progress import progress
from tempering.registry import validate_params
from tempering.schedule import lr_at
from tempering.types import AdamParams, SamplingParams

T = TypeVar("T")


def sub_config(cls: type[T], value: Any, path: str) -> T:
    """Validate a nested config block against dataclass ``cls`` and build it."""
    if isinstance(value, cls):
        return value
    return cls(**validate_params(cls, dict(value or {}), path))


@dataclass
class OptimizerConfig:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    final_ratio: float = 0.0

    def adam(self, step: int, total: int) -> AdamParams:
        lr = lr_at(step, total, self.learning_rate, self.schedule, self.warmup_steps, self.final_ratio)
        return AdamParams(lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.grad_clip_norm)


@dataclass
class EvalConfig:
    """Held-out evaluation: ``dataset`` (null = none), scored by ``reward`` every ``every``
    steps (0 = only at the start and end of the stage).

    ``sampler``: how to roll out (null = the stage's own sampler, else ``completion``), e.g. an
    environment for a tool-use task; ``stop_at_accuracy``: end the stage (as finished) once a
    periodic evaluation reaches this accuracy -- a warmup that stops at a target rather than
    after a step count that depends on the machine's numerics.
    """

    dataset: Any = None
    reward: Any = "exact_match"
    every: int = 0
    max_tokens: int = 8
    temperature: float = 0.0
    at_start: bool = True
    sampler: Any = None
    stop_at_accuracy: Any = None


def check_eval(ctx: Any, value: Any) -> EvalConfig:
    """Validate an ``eval:`` block and the components it names."""
    ev = sub_config(EvalConfig, value, f"{ctx.path}.eval")
    if ev.dataset is not None and not isinstance(ev.dataset, list):
        ctx.check("dataset", ev.dataset, "eval.dataset")
        ctx.check("reward", ev.reward, "eval.reward")
    if ev.sampler is not None:
        check_sampler(ctx, ev.sampler, "eval.sampler")
    if ev.stop_at_accuracy is not None and not (ev.every and 0 < float(ev.stop_at_accuracy) <= 1):
        raise ConfigError("needs eval.every > 0 and a value in (0, 1]", f"{ctx.path}.eval.stop_at_accuracy")
    return ev


def check_sampler(ctx: Any, spec: Any, key: str) -> None:
    """Validate a sampler spec and the environment it names, if any, before anything trains."""
    ctx.check("sampler", spec, key, context=("context",))
    params = spec if isinstance(spec, Mapping) else {}
    if params.get("environment") is not None:
        ctx.check("environment", params["environment"], f"{key}.environment")


def check_stage(ctx: Any, stage: Any, components: tuple[str, ...] = ("loss",)) -> None:
    """Validate the blocks every training stage has -- ``optimizer``, ``eval``, ``dataset`` --
    its named components (attribute name = component kind), its sampler and renderer, without
    building them."""
    from tempering.renderer import check_renderer

    sub_config(OptimizerConfig, stage.optimizer, f"{ctx.path}.optimizer")
    check_eval(ctx, stage.eval)
    for kind in components:
        ctx.check(kind, getattr(stage, kind), kind)
    if getattr(stage, "sampler", None) is not None:
        check_sampler(ctx, stage.sampler, "sampler")
    if hasattr(stage, "renderer"):
        check_renderer(ctx, stage.renderer)
    if not isinstance(stage.dataset, list):
        ctx.check("dataset", stage.dataset, "dataset")
    steps = getattr(stage, "steps", 0)
    if steps < 0:
        raise ConfigError(f"must be >= 0, got {steps}", f"{ctx.path}.steps")


@dataclass
class Stage:
    """Base class of training stages: the loop skeleton, written once (see the module docs).

    Keys every stage has: ``steps``, ``optimizer`` (an :class:`OptimizerConfig` block),
    ``eval`` (an :class:`EvalConfig` block) and ``seed`` (added to the recipe's seed for the
    stage's data order). Subclasses are dataclasses adding their own keys, and set:

    * ``label``: the name shown on the progress bar;
    * ``summary_keys`` / ``summary_prefixes``: the metrics :meth:`run` returns;
    * ``postfix``: progress-bar label -> metric key.
    """

    steps: int = 50
    optimizer: Any = field(default_factory=lambda: {"learning_rate": 1e-4})
    eval: Any = field(default_factory=dict)
    seed: int = 0

    label: ClassVar[str] = "stage"
    summary_keys: ClassVar[tuple[str, ...]] = ("loss",)
    summary_prefixes: ClassVar[tuple[str, ...]] = ("eval/",)
    postfix: ClassVar[dict[str, str]] = {"loss": "loss"}

    # ------------------------------------------------------------------ what a stage writes
    def validate(self, ctx: Any) -> None:
        """Check every nested block before any stage trains."""
        check_stage(ctx, self)

    def setup(self, ctx: Any, state: Mapping[str, Any]) -> None:
        """Build components and restore the loop position from ``state`` (empty on a fresh start)."""

    def train_step(self, ctx: Any, step: int) -> dict[str, Any]:
        """One optimizer step; returns its metrics."""
        raise NotImplementedError

    def loop_state(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume (besides the step), e.g. the data position."""
        return {}

    def teardown(self, ctx: Any, finished: bool) -> None:
        """Release what setup built; ``finished``: the stage will not resume."""

    def eval_sampler(self) -> Any:
        """The sampler evaluation uses when ``eval.sampler`` is not set."""
        return getattr(self, "sampler", None)

    def adam(self, step: int) -> AdamParams:
        """This step's optimizer settings (the learning-rate schedule applied)."""
        return self._optimizer.adam(step, self.steps)

    # ------------------------------------------------------------------ the skeleton
    def run(self, ctx: Any) -> dict[str, Any]:
        from tempering.evaluate import StageEvaluator

        self.validate(ctx)
        self._optimizer = sub_config(OptimizerConfig, self.optimizer, f"{ctx.path}.optimizer")
        ev = sub_config(EvalConfig, self.eval, f"{ctx.path}.eval")
        state = dict(ctx.resume_state or {})
        start = int(state.get("step", 0))
        self.setup(ctx, state)
        evaluator = StageEvaluator(ctx, ev, self)
        last: dict[str, Any] = {}
        finished = False
        fresh_eval = False
        bar = progress(self.steps, f"{ctx.stage_id} ({self.label})", initial=start)
        try:
            if start == 0 and (first := evaluator.run(at_start=True)):
                ctx.log(first)
                last.update(first)
            finished = start >= self.steps
            for step in range(start, self.steps):
                if not ctx.budget_left():
                    break
                t0 = time.perf_counter()
                metrics = self.train_step(ctx, step)
                metrics.setdefault("step_time", time.perf_counter() - t0)
                ctx.end_step({"step": step + 1, **self.loop_state()})
                fresh_eval = bool(ev.every and (step + 1) % ev.every == 0 and step + 1 < self.steps)
                if fresh_eval:
                    metrics.update(evaluator.run())
                ctx.log(metrics)
                last.update(metrics)
                bar.update(1)
                bar.set_postfix({k: f"{metrics[m]:.3f}" for k, m in self.postfix.items() if isinstance(metrics.get(m), float)})
                if fresh_eval and ev.stop_at_accuracy is not None and metrics["eval/accuracy"] >= float(ev.stop_at_accuracy):
                    ctx.log({"stopped_early": 1.0, "eval/stop_at_accuracy": float(ev.stop_at_accuracy)})
                    finished = True
                    break
            else:
                finished = True
        finally:
            bar.close()
            self.teardown(ctx, finished)
        if not (finished and fresh_eval) and (final := evaluator.run()):
            ctx.log(final)
            last.update(final)
        return {k: v for k, v in last.items() if k in self.summary_keys or k.startswith(self.summary_prefixes)}


@dataclass
class SamplingKeys:
    """The sampling keys of a stage that samples (``SamplingParams`` of each model turn)."""

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list = field(default_factory=list)  # type: ignore[type-arg]

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, list(self.stop))
