"""What every training stage shares: the loop skeleton (:class:`Stage`), optimizer settings
and held-out evaluation settings.

A stage subclasses :class:`Stage` and writes only what is its own -- ``setup`` (build its
components, restore its position), ``train_step`` (one optimizer step), ``loop_state`` (what a
checkpoint must remember to resume) and ``teardown``. :meth:`Stage.run` owns the rest, once for
all stages: the evaluation at the start, the progress bar, the step budget, ``end_step`` and its
checkpoints, periodic evaluation (and stopping early at a target accuracy), logging, failed
samples (each new cause printed once; too many stop the run, see :mod:`tempering.runs.failures`) and
the final evaluation.

The ``optimizer:`` and ``eval:`` blocks are validated with their own schema so a misspelt key
reports e.g. ``stages[1].optimizer.learnig_rate``. :func:`check_stage` checks, before any stage
trains, everything knowable from the config: value ranges (a learning rate <= 0 climbs the
loss), the enums of the stage's loss and advantage estimator (built, which is cheap, so their
own checks run), and the stage's dataset: that it loads, is not empty and has the columns the
stage and its reward read (:mod:`tempering.training.dataset_checks`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, TypeVar

from tempering.errors import ConfigError, TemperingError
from tempering.interfaces import Loss, RunContext, capability_name, supports
from tempering.loss_contract import check_reads
from tempering.registry import validate_params
from tempering.rollouts.renderer import check_renderer
from tempering.runs.collapse import CollapseWatch, stop_requested
from tempering.runs.failures import FailureWatch
from tempering.schema import Problem, check_config_at, choice_message, field_values
from tempering.training.dataset_checks import Columns, check_dataset, prompt_columns, reward_columns
from tempering.training.evaluate import StageEvaluator, eval_reward
from tempering.training.progress import progress
from tempering.training.schedule import lr_at
from tempering.types import AdamParams, SamplingParams

T = TypeVar("T")

SCHEDULES = ("constant", "linear", "cosine")  # the schedules tempering.training.schedule.lr_at knows
#: Components :func:`check_stage` builds (cheap, and their own checks -- enums such as a loss's
#: ``loss_type`` -- run at build time); the others (rewards, samplers) are only name-checked.
BUILT_TO_CHECK = ("loss", "advantage")


def sub_config(cls: type[T], value: Any, path: str) -> T:
    """Validate a nested config block against its schema -- dataclass ``cls``'s fields and its
    ``check_config`` (:mod:`tempering.schema`) -- and build it."""
    block = value if isinstance(value, cls) else cls(**validate_params(cls, dict(value or {}), path))
    check_config_at(cls, field_values(block), path)
    return block


@dataclass
class OptimizerConfig(AdamParams):
    """A stage's ``optimizer:`` block: the step settings a backend takes (:class:`AdamParams`'s
    fields, one list of them) plus the learning-rate schedule that sets each step's rate."""

    schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    final_ratio: float = 0.0

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem]:
        """Value ranges that cannot work (a negative learning rate is gradient *ascent*): the
        block's schema check (:mod:`tempering.schema`), run by :func:`sub_config`."""
        lr = config["learning_rate"]
        if not lr > 0:
            yield Problem(
                "learning_rate",
                f"must be > 0, got {lr} (a rate <= 0 does not descend the loss); typical values are 1e-5 to 1e-3",
            )
        for key in ("beta1", "beta2"):
            if not 0 <= config[key] < 1:
                yield Problem(key, f"must be in [0, 1), got {config[key]}")
        if not config["eps"] > 0:
            yield Problem("eps", f"must be > 0, got {config['eps']}")
        if not config["weight_decay"] >= 0:
            yield Problem("weight_decay", f"must be >= 0, got {config['weight_decay']}")
        if not config["grad_clip_norm"] >= 0:
            yield Problem("grad_clip_norm", f"must be >= 0 (0 = no clipping), got {config['grad_clip_norm']}")
        if config["schedule"] not in SCHEDULES:
            yield Problem("schedule", choice_message(config["schedule"], SCHEDULES))
        if not config["warmup_steps"] >= 0:
            yield Problem("warmup_steps", f"must be >= 0, got {config['warmup_steps']}")
        if not 0 <= config["final_ratio"] <= 1:
            yield Problem("final_ratio", f"must be in [0, 1], got {config['final_ratio']}")

    def adam(self, step: int, total: int) -> AdamParams:
        lr = lr_at(step, total, self.learning_rate, self.schedule, self.warmup_steps, self.final_ratio)
        # a plain AdamParams: what a backend takes (and the Tinker SDK mirrors), without the schedule
        return AdamParams(**{f.name: getattr(self, f.name) for f in fields(AdamParams)} | {"learning_rate": lr})


@dataclass
class EvalConfig:
    """Held-out evaluation: ``dataset`` (null = none), scored by ``reward`` every ``every``
    steps (0 = only at the start and end of the stage).

    ``reward`` (null = the stage's own ``reward``; ``exact_match`` for a stage without one, such
    as SFT): the held-out number then measures what training rewards -- a stage rewarding with
    ``{name: exact_match, case_sensitive: false}`` is evaluated case-insensitively too, not by
    the plain built-in (see :func:`eval_reward`).

    ``sampler``: how to roll out (null = the stage's own sampler, else ``completion``), e.g. an
    environment for a tool-use task; ``stop_at_accuracy``: end the stage (as finished) once the
    held-out accuracy reaches this value -- a warmup that stops at a target rather than after a
    step count that depends on the seed and the machine's numerics.

    The stop rule is checked every ``stop_every`` steps (0 = with each periodic evaluation) on
    the first ``stop_size`` held-out examples (null = all of them). A warmup's accuracy can
    jump from 15% to 45% within ten steps: checking only with the periodic evaluation
    overshoots the target, and a full evaluation every step or two costs more than training.
    A frequent check on a subset stops close to the target; the stage then ends with a full
    evaluation (``eval/accuracy``), and each check is logged as ``eval/stop_check_accuracy``.
    """

    dataset: Any = None
    reward: Any = None  # the stage's reward (eval_reward)
    every: int = 0
    max_tokens: int = 8
    temperature: float = 0.0
    at_start: bool = True
    sampler: Any = None
    stop_at_accuracy: Any = None
    stop_every: int = 0  # 0: with each periodic evaluation (``every``)
    stop_size: Any = None  # null: the whole held-out set

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values that cannot work, at their keys (run by :func:`sub_config`)."""
        c = config
        if c["max_tokens"] < 1:
            yield Problem("max_tokens", f"must be >= 1, got {c['max_tokens']}")
        if c["every"] < 0:
            yield Problem("every", f"must be >= 0 (0 = at the start and end only), got {c['every']}")
        if c["temperature"] < 0:
            yield Problem("temperature", f"must be >= 0 (0 = greedy), got {c['temperature']}")
        if c["stop_every"] < 0:
            yield Problem("stop_every", f"must be >= 0 (0 = with each evaluation), got {c['stop_every']}")
        size = c["stop_size"]
        if not (size is None or (isinstance(size, int) and size >= 1)):
            yield Problem("stop_size", f"must be a number of examples >= 1 or null (all), got {size!r}")
        target = c["stop_at_accuracy"]
        if target is not None and not ((c["every"] or c["stop_every"]) and 0 < float(target) <= 1):
            yield Problem("stop_at_accuracy", "needs eval.every or eval.stop_every > 0 and a value in (0, 1]")


def check_eval(ctx: RunContext, value: object, stage: object = None) -> EvalConfig:
    """Validate an ``eval:`` block and the components it names (its dataset's rows:
    :func:`check_stage`, after every config check)."""
    ev = sub_config(EvalConfig, value, f"{ctx.path}.eval")  # its fields and their values
    if ev.sampler is not None:
        check_sampler(ctx, ev.sampler, "eval.sampler")
    if ev.dataset is not None and ev.reward is not None:  # the stage's own is checked as its "reward"
        ctx.check("reward", ev.reward, "eval.reward")
    return ev


def stop_check(ev: EvalConfig, step: int, fresh_eval: bool) -> str | None:
    """How the stop rule is checked after ``step`` steps: ``"eval"`` (read the periodic
    evaluation that just ran: more examples, no second pass), ``"check"`` (a quick evaluation
    on ``stop_size`` examples, every ``stop_every`` steps), or ``None`` (not this step)."""
    if ev.stop_at_accuracy is None:
        return None
    if fresh_eval:
        return "eval"
    return "check" if ev.stop_every and step % ev.stop_every == 0 else None


def check_sampler(ctx: RunContext, spec: object, key: str) -> None:
    """Validate a sampler spec and the environment it names, if any, before anything trains."""
    ctx.check("sampler", spec, key, context=("context",))
    params = spec if isinstance(spec, Mapping) else {}
    if params.get("environment") is not None:
        ctx.check("environment", params["environment"], f"{key}.environment")


def check_stage(
    ctx: RunContext, stage: Any, components: tuple[str, ...] = ("loss",), columns: Columns | None = None
) -> dict[str, Any]:
    """Validate the blocks every training stage has -- ``steps``, ``optimizer``, ``eval``,
    ``dataset`` -- its named components (attribute name = component kind), its sampler and
    renderer, before anything trains. Losses and advantage estimators are built (their own
    checks run) and returned by kind, for further checks -- the loss's declared inputs against
    what the stage's batches hold (:func:`tempering.loss_contract.check_reads`); the rest are
    checked by name, keys
    and their factory's ``check_config`` (see :mod:`tempering.schema`). Then,
    unless in :func:`config_only`, the datasets (the stage's and ``eval``'s): ``columns`` is
    what the stage's rows must hold (see :func:`check_dataset`)."""
    if isinstance(stage, Stage):  # its own keys' values (a recipe's stage: checked when it was built too)
        check_config_at(type(stage), field_values(stage), ctx.path)
    sub_config(OptimizerConfig, stage.optimizer, f"{ctx.path}.optimizer")  # its fields and check
    ev = check_eval(ctx, stage.eval, stage)
    built: dict[str, Any] = {}
    for kind in components:
        if kind in BUILT_TO_CHECK:
            built[kind] = build_checked(ctx, kind, getattr(stage, kind), kind)
        else:
            ctx.check(kind, getattr(stage, kind), kind)
    if "loss" in built and isinstance(stage, Stage) and (provided := stage.batch_inputs(built["loss"])) is not None:
        check_reads(built["loss"], provided, f"{ctx.path}.loss", stage.label)  # the loss contract
    if getattr(stage, "sampler", None) is not None:
        check_sampler(ctx, stage.sampler, "sampler")
    if hasattr(stage, "renderer"):
        check_renderer(ctx, stage.renderer)
    if isinstance(stage, Stage):
        check_capabilities(ctx, stage, built.get("loss"))
    if CHECK_DATA.get():  # the data last: a typo in the config is reported before a missing file
        check_dataset(ctx, stage.dataset, "dataset", columns)
        if ev.dataset is not None:
            sampler = ev.sampler if ev.sampler is not None else stage.eval_sampler() or "completion"
            needed = reward_columns(ctx, eval_reward(ev, stage), "eval.reward")
            check_dataset(ctx, ev.dataset, "eval.dataset", prompt_columns(sampler, needed))
    return built


class Requirement(NamedTuple):
    """A backend capability a stage's config needs: ``capability`` (a protocol of
    :mod:`tempering.interfaces`), the stage's ``key`` that needs it (``""``: the stage itself)
    and, optionally, the ``message`` to report when the backend lacks it."""

    capability: type
    key: str = ""
    message: str = ""


def check_capabilities(ctx: RunContext, stage: Stage, loss: Loss | None = None) -> None:
    """Raise a one-line :class:`ConfigError` at the stage's key path for the first capability
    of :meth:`Stage.required_capabilities` (then, given the stage's built ``loss``, of
    :meth:`Stage.loss_capabilities`) the backend lacks (:func:`tempering.interfaces.supports`).
    Nothing to check while the backend is not built yet (``ctx.backend`` is None)."""
    backend = ctx.backend
    if backend is None:
        return
    needs = stage.required_capabilities() + (stage.loss_capabilities(loss) if loss is not None else [])
    for need in needs:
        if not supports(backend, need.capability):
            name = capability_name(need.capability)
            message = need.message or (
                f"needs a backend with the capability '{name}' "
                f"({need.capability.__name__}); {type(backend).__name__} has not"
            )
            raise ConfigError(message, f"{ctx.path}.{need.key}" if need.key else ctx.path)


#: Whether :func:`check_stage` loads datasets (see :func:`config_only`).
CHECK_DATA: ContextVar[bool] = ContextVar("tempering_check_data", default=True)


@contextmanager
def config_only() -> Iterator[None]:
    """Validate stages (``stage.validate(ctx)``) without looking at their datasets: to check a
    recipe's config before its data exists, e.g. with placeholder paths."""
    token = CHECK_DATA.set(False)
    try:
        yield
    finally:
        CHECK_DATA.reset(token)


def build_checked(ctx: RunContext, kind: str, spec: object, key: str, **context: object) -> Any:
    """Build a component. Its schema (fields and ``check_config``) is checked by the registry
    first, each problem at its own key (:mod:`tempering.schema`); a component without a check
    that refuses its values in its constructor (a ``ValueError`` / ``TypeError``) is reported as
    one line at the component's key, its message as it is. Used before anything trains for the
    cheap components (losses, estimators), and at stage start for the others."""
    try:
        return ctx.build(kind, spec, key, **context)
    except TemperingError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(str(exc), f"{ctx.path}.{key}") from None


@dataclass
class Stage:
    """Base class of training stages: the loop skeleton, written once (see the module docs).

    Keys every stage has: ``steps``, ``optimizer`` (an :class:`OptimizerConfig` block),
    ``eval`` (an :class:`EvalConfig` block) and ``seed`` (added to the recipe's seed for the
    stage's data order). Subclasses are dataclasses adding their own keys, and set:

    * ``requires``: the backend capabilities (protocols of :mod:`tempering.interfaces`) the
      stage needs whatever its config; one that depends on the config is added by
      :meth:`required_capabilities`. :func:`check_stage` checks them once the backend is built,
      before any stage trains;
    * ``label``: the name shown on the progress bar;
    * ``summary_keys`` / ``summary_prefixes``: the metrics :meth:`run` returns;
    * ``postfix``: progress-bar label -> metric key.
    """

    steps: int = 50
    optimizer: Any = field(default_factory=lambda: {"learning_rate": 1e-4})
    eval: Any = field(default_factory=dict)
    seed: int = 0

    requires: ClassVar[tuple[type, ...]] = ()
    label: ClassVar[str] = "stage"
    summary_keys: ClassVar[tuple[str, ...]] = ("loss",)
    summary_prefixes: ClassVar[tuple[str, ...]] = ("eval/",)
    postfix: ClassVar[dict[str, str]] = {"loss": "loss"}

    # ------------------------------------------------------------------ what a stage writes
    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values of the stage's own keys that cannot work, each a :class:`Problem` at its
        key (:mod:`tempering.schema`): run by the registry when it builds the stage from a
        recipe, and by :func:`check_stage` for a stage built in Python. A subclass adds its
        own after ``super().check_config(config)``'s. What needs the backend, a component or
        the data is :meth:`validate`'s."""
        steps = config.get("steps", 1)
        if steps < 1:
            yield Problem(
                "steps", f"must be >= 1, got {steps} (a stage of no steps would be skipped; remove the stage instead)"
            )

    def validate(self, ctx: RunContext) -> None:
        """Check every nested block before any stage trains."""
        check_stage(ctx, self)

    def required_capabilities(self) -> list[Requirement]:
        """The backend capabilities this stage's config needs: :attr:`requires`, plus (in a
        subclass) those its keys ask for, e.g. SDFT's ``teacher: ema``."""
        return [Requirement(cap) for cap in self.requires]

    def loss_capabilities(self, loss: Loss) -> list[Requirement]:
        """The backend capabilities the stage's built ``loss`` needs, for needs that depend on
        the loss's own config (SDFT's logit modes: the model's logits in the loss). Checked
        with :meth:`required_capabilities`, once the loss is built at validation."""
        return []

    def batch_inputs(self, loss: Loss) -> frozenset[str] | None:
        """What this stage's batches hold for ``loss``: the loss contract's input names
        (:mod:`tempering.loss_contract`), checked against what the loss ``reads`` when the
        recipe is validated. ``None`` (the default): not declared, not checked."""
        return None

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        """Build components and restore the loop position from ``state`` (empty on a fresh start)."""

    def train_step(self, ctx: RunContext, step: int) -> dict[str, Any]:
        """One optimizer step; returns its metrics."""
        raise NotImplementedError

    def loop_state(self) -> dict[str, Any]:
        """What a checkpoint must hold to resume (besides the step), e.g. the data position."""
        return {}

    def teardown(self, ctx: RunContext, finished: bool) -> None:
        """Release what setup built; ``finished``: the stage will not resume."""

    def eval_sampler(self) -> Any:
        """The sampler evaluation uses when ``eval.sampler`` is not set."""
        return getattr(self, "sampler", None)

    def adam(self, step: int) -> AdamParams:
        """This step's optimizer settings (the learning-rate schedule applied)."""
        return self._optimizer.adam(step, self.steps)

    # ------------------------------------------------------------------ the skeleton
    def run(self, ctx: RunContext) -> dict[str, Any]:
        with config_only():  # run_recipe checked the data before stage 1; setup loads it now
            self.validate(ctx)
        self._optimizer = sub_config(OptimizerConfig, self.optimizer, f"{ctx.path}.optimizer")
        ev = sub_config(EvalConfig, self.eval, f"{ctx.path}.eval")
        state = dict(ctx.resume_state or {})
        start = int(state.get("step", 0))
        self.setup(ctx, state)
        evaluator = StageEvaluator(ctx, ev, self)
        # the summary: the last step's values and the latest evaluation's, never an older step's
        last_step: dict[str, Any] = {}
        evaluated: dict[str, Any] = {}
        watch = FailureWatch(
            ctx.stage_id or self.label,
            ctx.path,
            getattr(self, "max_failed_fraction", None),
            getattr(self, "failure_window", 1),
            getattr(self, "max_tool_error_fraction", None),
        )
        collapse = CollapseWatch(
            ctx.stage_id or self.label,
            ctx.path,
            getattr(self, "collapse_steps", 0),
            stop_requested(getattr(self, "stop_on_collapse", False)),
        )
        bar = progress(self.steps, f"{ctx.stage_id} ({self.label})", initial=start)
        evaluator.bar = bar  # evaluations show their phase on it, and are left out of its estimate
        try:
            self._loop(ctx, ev, evaluator, bar, watch, collapse, start, last_step, evaluated)
        finally:
            bar.close()
        summary = {
            k: v
            for k, v in {**last_step, **evaluated}.items()
            if k in self.summary_keys or k.startswith(self.summary_prefixes)
        }
        summary.update(watch.summary())  # failures by cause over the whole stage: "Done." must not hide them
        summary.update(collapse.summary())
        return summary

    def _loop(
        self,
        ctx: RunContext,
        ev: EvalConfig,
        evaluator: StageEvaluator,
        bar: Any,
        watch: FailureWatch,
        collapse: CollapseWatch,
        start: int,
        last_step: dict[str, Any],
        evaluated: dict[str, Any],
    ) -> None:
        """The steps and evaluations of :meth:`run`; fills ``last_step`` (the last step's
        metrics) and ``evaluated`` (the latest evaluation's) for the summary."""
        finished = fresh_eval = False
        try:
            if start == 0 and (first := evaluator.run(at_start=True)):
                watch.observe(first, " (evaluation at the start)")
                ctx.log(first)
                evaluated.update(first)
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
                    evaluated.update(done := evaluator.run())
                    metrics.update(done)
                how = stop_check(ev, step + 1, fresh_eval) if step + 1 < self.steps else None
                if how == "check":
                    metrics["eval/stop_check_accuracy"] = evaluator.accuracy(ev.stop_size)
                watch.observe(metrics, f" step {step + 1}")
                ctx.log(metrics)
                last_step.clear()
                last_step.update(metrics)
                bar.update(1)
                bar.set_postfix(
                    {k: f"{metrics[m]:.3f}" for k, m in self.postfix.items() if isinstance(metrics.get(m), float)}
                )
                watch.check(last=step + 1 == self.steps)  # StopRun: the run checkpoints this stage, unfinished
                collapse.observe(metrics, step + 1)  # the same, with --stop-on-collapse
                key = {"eval": "eval/accuracy", "check": "eval/stop_check_accuracy"}.get(how or "")
                if key and metrics[key] >= float(ev.stop_at_accuracy):
                    ctx.log({"stopped_early": 1.0, "eval/stop_at_accuracy": float(ev.stop_at_accuracy)})
                    finished = True
                    break
            else:
                finished = True
        finally:
            self.teardown(ctx, finished)
        if not (finished and fresh_eval) and (final := evaluator.run()):
            watch.observe(final, " (final evaluation)")
            ctx.log(final)
            evaluated.update(final)


@dataclass
class SamplingKeys:
    """The sampling keys of a stage that samples (``SamplingParams`` of each model turn)."""

    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[Any] = field(default_factory=list)  # SamplingParams.stop: strings or token ids

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, list(self.stop))

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """Ranges of the sampling keys, then the next class's checks (a mixin of a
        :class:`Stage`: cooperative, so both run)."""
        c = config
        if c["max_tokens"] < 1:
            yield Problem("max_tokens", f"must be >= 1, got {c['max_tokens']}")
        if c["temperature"] < 0:
            yield Problem("temperature", f"must be >= 0, got {c['temperature']}")
        if not 0 < c["top_p"] <= 1:
            yield Problem("top_p", f"must be in (0, 1], got {c['top_p']}")
        if c["top_k"] < 0:
            yield Problem("top_k", f"must be >= 0 (0 = no top-k), got {c['top_k']}")
        after = super()
        if hasattr(after, "check_config"):
            yield from after.check_config(config)
