"""The ``sdpo`` stage: GRPO whose loss also distils a feedback-conditioned teacher into the policy.

SDPO (Hübotter et al. 2026, "Reinforcement Learning via Self-Distillation"; TRL 1.16's
``trl.experimental.sdpo``). Each step runs the RL engine's GRPO step
(:class:`~tempering.algorithms.grpo.algorithm.GRPO`: rollouts through the stage's sampler,
group-relative advantages, the policy loss) and, before training, gives each sample a teacher:

1. **who has a teacher** (:mod:`tempering.algorithms.sdpo.context`): a sample is shown the
   first successful sibling of its group (``reward >= success_reward_threshold``; never
   itself with ``dont_reprompt_on_self_success``) and/or its own feedback
   (``Sample.feedback``: a tool error, a failing test, "expected 42, got 41");
2. **the teacher's prompt**: the student's prompt text through ``reprompt_template`` (with the
   solution and feedback through their templates), rendered exactly as the student's prompt
   was -- raw text, or a user turn through the stage's chat renderer -- and cut to its last
   ``max_reprompt_len`` tokens (:func:`tempering.training.teacher.reprompted_prefix`);
3. **the teacher scores the student's tokens**: the same model, with the ``teacher``'s
   weights (``ema`` by default: an average of the policy moving by ``ema_rate`` after every
   optimizer step; ``base``, ``stage_start``, ``live``), on the teacher prompt followed by the
   student's very continuation -- token logprobs, top-k or full distributions, by mode
   (:func:`tempering.training.teacher.attach_teacher`);
4. the loss (:class:`~tempering.algorithms.sdpo.loss.SDPOLoss`) blends the distillation
   loss over the samples with a teacher with the policy loss over all:
   ``(1 - distillation_weight) * policy + distillation_weight * distillation``. Samples with no
   teacher signal get the policy-gradient part only (``sdpo/no_signal_samples``).

**Multi-turn samples** (the ``environment`` sampler) are distilled like SDFT's: the teacher
prompt is the episode's first messages with the last user message re-prompted, rendered by the
same renderer; the student row is the trajectory's first training row (every model turn and the
tool results between them, the latter at weight 0), and the teacher row is the teacher prompt
followed by the same tokens, so the teacher judges every turn having seen the same tool results.
A successful sibling's episode is shown as its turns' text and tool results
(:func:`~tempering.algorithms.sdpo.context.demonstration_text`). Rows after a renderer rewrote
history (a later row of a trajectory) do not start with the student's prompt: they get the policy
gradient only (``sdpo/rows_without_teacher``).

**Stale SDPO** (``max_steps_off_policy: k``; unset = synchronous, on-policy): rollouts come
from the ``offpolicy`` stage's asynchronous producer, up to ``k`` optimizer steps stale, with
its corrections -- the same code (:class:`~tempering.algorithms.offpolicy.algorithm.StaleRollouts`):
the advantage cap and folded normaliser of the policy loss (the stale recipe's ``loss:
clipped_is``: PPO's two-sided ratio clip around the *sampler's* policy, ``|A|`` capped at 3x its
running mean),
the ratio / ESS diagnostics, the staleness metrics, a sampler snapshot published after each
optimizer step. The "old" logprobs are the sampler's own, never recomputed (they are what the
stale tokens were drawn from), so the sampler must draw from the untempered policy the trainer
scores (temperature 1, no top-k/top-p). The distillation term's per-token weight is the ratio
clipped to ``[distillation_is_clip_low, distillation_is_clip]``. The teacher is scored at
training time: the current teacher weights on the stale sample's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.algorithms.grpo.algorithm import GRPO
from tempering.algorithms.offpolicy.algorithm import StaleRollouts
from tempering.algorithms.sdpo.context import (
    DEFAULT_FEEDBACK_TEMPLATE,
    DEFAULT_REPROMPT_TEMPLATE,
    DEFAULT_SOLUTION_TEMPLATE,
    RepromptRules,
    TeacherSignal,
    choose_signals,
    demonstration_text,
    has_feedback,
    reprompt_text,
    template_problem,
    truncate_prompt,
    unencodable,
)
from tempering.algorithms.sdpo.loss import SDPOLoss, distillation_problem, teacher_input
from tempering.errors import ConfigError
from tempering.interfaces import Backend, Distributions, FullDistributions, Loss, LossLogits, RunContext, Tokenizer
from tempering.loss_contract import DISTILL_WEIGHTS, TEACHER_TOKEN_LOGPROBS, check_reads
from tempering.training import teacher as shared
from tempering.training.stage import Requirement
from tempering.training.teacher import TEACHER_INPUT_KEYS, TeacherWeights
from tempering.types import Batch, Datum, Group, Sample

__all__ = ["SDPO", "TeacherRows"]


@dataclass
class SDPO(StaleRollouts, GRPO):
    """Self-distillation policy optimization (see the module docstring; every key in
    docs/sdpo.md). Keys besides GRPO's:

    - ``distillation_mode`` (``sampled_token``, ``full_logits``, ``topk_logits``),
      ``distillation_alpha`` (1), ``distillation_topk`` (required by ``topk_logits``),
      ``distillation_topk_support`` (``student`` / ``teacher``), ``distillation_add_tail``,
      ``distillation_is_clip`` (2.0; null = off), ``distillation_is_clip_low`` (null),
      ``distillation_weight`` (1.0);
    - ``teacher`` (``ema``, ``base``, ``stage_start``, ``live``), ``ema_rate`` (0.05),
      ``ema_every`` (1);
    - ``use_successful_as_teacher``, ``success_reward_threshold`` (1.0),
      ``dont_reprompt_on_self_success``, ``include_environment_feedback``,
      ``environment_feedback_only_without_solution``, ``remove_thinking_from_demonstration``;
    - ``reprompt_template``, ``solution_template``, ``feedback_template``, ``max_reprompt_len``;
    - stale SDPO: ``max_steps_off_policy`` (null = on-policy) and the ``offpolicy`` stage's
      ``sync_every``, ``fixed_staleness``, ``groups_per_sample``, ``aggregation``,
      ``max_resamples``, ``seeded_sampling`` (:class:`StaleRollouts`).
    """

    distillation_mode: str = "sampled_token"
    distillation_alpha: float = 1.0
    distillation_topk: int | None = None
    distillation_topk_support: str = "student"
    distillation_add_tail: bool = False
    distillation_is_clip: float | None = 2.0
    distillation_is_clip_low: float | None = None
    distillation_weight: float = 1.0
    teacher: str = "ema"
    ema_rate: float = 0.05
    ema_every: int = 1
    use_successful_as_teacher: bool = True
    success_reward_threshold: float = 1.0
    dont_reprompt_on_self_success: bool = True
    include_environment_feedback: bool = True
    environment_feedback_only_without_solution: bool = False
    remove_thinking_from_demonstration: bool = False
    max_reprompt_len: int = 10240
    reprompt_template: str = DEFAULT_REPROMPT_TEMPLATE
    solution_template: str = DEFAULT_SOLUTION_TEMPLATE
    feedback_template: str = DEFAULT_FEEDBACK_TEMPLATE
    max_steps_off_policy: int | None = None  # type: ignore[assignment]  # null: synchronous, on-policy

    label = "sdpo"
    summary_keys = ("reward/mean", "accuracy", "loss", "sdpo/signal_frac", "sdpo/teacher_kl")
    postfix = {"reward": "reward/mean", "signal": "sdpo/signal_frac"}

    # ------------------------------------------------------------------ validation and setup
    @property
    def stale(self) -> bool:
        """Whether rollouts come from the asynchronous producer (``max_steps_off_policy`` set)."""
        return self.max_steps_off_policy is not None

    def teacher_weights(self, stage_id: str = "") -> TeacherWeights:
        """The teacher's weights and snapshot lifecycle (:class:`tempering.training.teacher.TeacherWeights`)."""
        return TeacherWeights(self.teacher, self.ema_rate, f"{stage_id}/sdpo_teacher", self.ema_every)

    @property
    def rules(self) -> RepromptRules:
        return RepromptRules(
            self.use_successful_as_teacher,
            self.success_reward_threshold,
            self.dont_reprompt_on_self_success,
            self.include_environment_feedback,
            self.environment_feedback_only_without_solution,
        )

    def validate(self, ctx: RunContext) -> None:
        """Every SDPO key, one line each, before GRPO's own checks (and before anything trains)."""
        path = ctx.path
        problem = distillation_problem(
            self.distillation_mode,
            self.distillation_alpha,
            self.distillation_topk,
            self.distillation_topk_support,
            self.distillation_is_clip,
            self.distillation_weight,
            self.distillation_is_clip_low,
        )
        if problem is not None:
            raise ConfigError(problem[1], f"{path}.{problem[0]}")
        self.teacher_weights().check(path, every_key="ema_every")
        if self.max_reprompt_len < 1:
            raise ConfigError(
                f"must be >= 1 (tokens of the teacher's prompt kept), got {self.max_reprompt_len}",
                f"{path}.max_reprompt_len",
            )
        required = ["prompt"]
        if self.use_successful_as_teacher:
            required.append("solution")
        if self.include_environment_feedback:
            required.append("feedback")
        templates = (
            ("reprompt_template", required, ("prompt", "solution", "feedback")),
            (
                "solution_template",
                ["successful_previous_attempt"] if self.use_successful_as_teacher else [],
                ("successful_previous_attempt",),
            ),
            ("feedback_template", ["feedback_raw"] if self.include_environment_feedback else [], ("feedback_raw",)),
        )
        for key, need, allowed in templates:
            why = template_problem(getattr(self, key), need, allowed)
            if why is not None:
                raise ConfigError(why, f"{path}.{key}")
        for key, need, _ in templates:  # the templates the teacher uses, once the model is known
            if ctx.backend is not None and (need or key == "reprompt_template"):
                why = unencodable(ctx.backend.tokenizer, getattr(self, key))
                if why is not None:
                    raise ConfigError(why, f"{path}.{key}")
        if self.stale:
            self.check_stale(path)
        super().validate(ctx)

    def check_stale(self, path: str) -> None:
        """Stale SDPO's keys: the ``offpolicy`` stage's staleness keys, and a sampler whose
        logprobs are those of the policy the trainer scores. Both loss parts score the student
        untempered (the teacher too), so the importance ratios against the sampler's logprobs
        are only ratios when the sampler drew from the untempered, unfiltered policy; and they
        are never recomputed (a recomputation would be the current weights', not the stale
        sampler's)."""
        self.check_staleness_keys(path)
        for key, neutral in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
            if getattr(self, key) != neutral:
                raise ConfigError(
                    f"stale SDPO (max_steps_off_policy set) needs {key}: {neutral:g}, got {getattr(self, key)}: the "
                    "importance ratios compare the sampler's logprobs with the untempered policy the trainer (and "
                    "the teacher) score",
                    f"{path}.{key}",
                )
        if self.recompute_logprobs == "always":
            raise ConfigError(
                "stale SDPO keeps the sampler's logprobs as the importance ratios' 'old' (recomputed "
                "ones would be the current weights'); use auto",
                f"{path}.recompute_logprobs",
            )

    def required_capabilities(self) -> list[Requirement]:
        """The teacher's weights (snapshots for ``stage_start`` / ``ema``, averaging for
        ``ema``) and what the mode asks of the teacher: its own top-k (``topk_logits`` on the
        teacher's support) or full distributions (``full_logits``, ``topk_logits`` on the
        student's support). Nothing when ``distillation_weight`` is 0 (no teacher)."""
        needs = super().required_capabilities()
        if self.distillation_weight == 0:
            return needs
        needs += self.teacher_weights().requirements("teacher")
        kind = self._teacher_input()
        if kind == "full":
            full = (
                f"'{self.distillation_mode}' (support: {self.distillation_topk_support}) needs the teacher's "
                "full next-token distributions, which this backend does not return; "
                "use distillation_mode: topk_logits with distillation_topk_support: teacher, or sampled_token"
            )
            needs.append(Requirement(FullDistributions, "distillation_mode", full))
        elif kind == "topk":
            topk = (
                "'topk_logits' needs the teacher's top-k next-token distributions, which this backend does not "
                "return; use distillation_mode: sampled_token"
            )
            needs.append(Requirement(Distributions, "distillation_mode", topk))
        if kind in ("full", "topk"):
            logits = (
                f"'{self.distillation_mode}' trains on the student's logits, which this backend does not give "
                "a loss (it returns per-token logprobs only); use distillation_mode: sampled_token"
            )
            needs.append(Requirement(LossLogits, "distillation_mode", logits))
        return needs

    def _teacher_input(self) -> str | None:
        return teacher_input(self.distillation_mode, self.distillation_topk_support, self.distillation_weight)

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """GRPO's inputs, plus the distillation mask and the teacher's values of the mode
        (:data:`tempering.training.teacher.TEACHER_INPUT_KEYS`) when something is distilled. ``loss`` is
        the stage's policy loss; the blended :class:`SDPOLoss` is checked against the same set
        at setup."""
        kind = self._teacher_input()
        return super().batch_inputs(loss) | ({DISTILL_WEIGHTS} | TEACHER_INPUT_KEYS[kind] if kind else frozenset())

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        super().setup(ctx, state)
        loss = SDPOLoss(
            policy=self.loss_fn,
            mode=self.distillation_mode,
            alpha=float(self.distillation_alpha),
            topk=self.distillation_topk,
            topk_support=self.distillation_topk_support,
            add_tail=self.distillation_add_tail,
            is_clip=self.distillation_is_clip,
            weight=float(self.distillation_weight),
            is_clip_low=self.distillation_is_clip_low,
        )
        check_reads(loss, self.batch_inputs(self.loss_fn), f"{ctx.path}.loss", self.label)
        self._objective: Any = loss
        if self.stale:
            self.recompute = False  # the sampler's logprobs are the ratios' "old" (checked in validate)
            self._objective = self.setup_corrections(self.loss_fn, loss, state, ctx.path)
        self.weights = self.teacher_weights(ctx.stage_id)
        if self.distillation_weight > 0:
            self.weights.start(self.backend, resuming=int(state.get("step", 0)) > 0, path=ctx.path)
        self._trained = False

    def make_rollouts(self, ctx: RunContext, state: Mapping[str, Any]) -> Any:
        return self.async_rollouts(ctx, state) if self.stale else super().make_rollouts(ctx, state)

    def loop_state(self) -> dict[str, Any]:
        return {**super().loop_state(), **(self.corrections_state() if self.stale else {})}

    def objective(self) -> Any:
        """The :class:`SDPOLoss`; stale, wrapped in the off-policy objective (ratio diagnostics)."""
        return self._objective

    def teardown(self, ctx: RunContext, finished: bool) -> None:
        super().teardown(ctx, finished)
        if finished and "weights" in vars(self) and self.distillation_weight > 0:  # setup ran
            self.weights.finish(self.backend)

    # ------------------------------------------------------------------ one step
    def prepare(self, ctx: RunContext, batch: Batch, step: int, groups: Sequence[Group]) -> dict[str, Any]:
        """GRPO's preparation (old / reference logprobs; stale: the sampler's logprobs kept, the
        policy loss's advantages capped and normalised), then each row's teacher."""
        metrics = super().prepare(ctx, batch, step, groups)
        if self.stale:
            metrics.update(self.prepare_advantages(batch, self.capper))
        self._trained = True
        if self.distillation_weight == 0:
            return metrics
        t0 = time.perf_counter()
        metrics.update(self.attach_teachers(self.backend, batch, list(groups)))
        metrics["time/teacher"] = time.perf_counter() - t0
        return metrics

    def after_optim(self, ctx: RunContext, step: int) -> None:
        """The EMA teacher moves after each optimizer step (not after a step with nothing to train)."""
        super().after_optim(ctx, step)
        if self._trained and self.distillation_weight > 0:
            ema = self.weights.after_step(self.backend, step)
            if ema is not None:
                ema.result()
        self._trained = False
        if self.stale:
            self.publish_after(step)

    # ------------------------------------------------------------------ teachers
    def signals(self, groups: list[Group]) -> list[list[TeacherSignal]]:
        """Each sample's teacher signal, group by group (failed or masked samples are nobody's
        solution)."""
        return [
            choose_signals(
                [s.reward for s in g.samples],
                [s.feedback for s in g.samples],
                self.rules,
                [s.trainable for s in g.samples],
            )
            for g in groups
        ]

    def teacher_prefix(
        self, tokenizer: Tokenizer, context: Any, group: Group, sample: Sample, signal: TeacherSignal
    ) -> tuple[list[int], bool]:
        """The teacher's prompt tokens for ``sample`` (and whether they were truncated)."""
        solution = None
        if signal.solution is not None:
            solution = demonstration_text(
                tokenizer, group.samples[signal.solution], self.remove_thinking_from_demonstration
            )
        tokens = shared.reprompted_prefix(
            context,
            tokenizer,
            sample,
            lambda text: reprompt_text(
                self.reprompt_template, self.solution_template, self.feedback_template, text, solution, signal.feedback
            ),
        )
        return truncate_prompt(tokens, self.max_reprompt_len)

    def build_teachers(
        self, tokenizer: Tokenizer, batch: Batch, groups: list[Group], context: Any = None
    ) -> TeacherRows:
        """Which rows of ``batch`` have a teacher, and the teacher's row for each, in place:
        every row gets ``distill_weights`` (the distillation part's loss mask: the row's
        weights where it has a teacher, zeros elsewhere) and a taught row ``completion_len``.

        ``batch`` is :func:`tempering.training.rl.build_group_batch` of ``groups``: one row per training
        segment of each sample, in order. ``context`` is the sampler's
        :class:`~tempering.rollouts.rollout.SamplerContext` (the stage's own by default)."""
        context = context if context is not None else self.rollout_sampler.context
        rows: list[tuple[int, int, Sample, int]] = [
            (gi, i, s, k)
            for gi, g in enumerate(groups)
            for i, s in enumerate(g.samples)
            for k in range(len(s.segments()))
        ]
        if len(rows) != len(batch.data):
            raise RuntimeError(
                f"SDPO: {len(batch.data)} training rows for {len(rows)} segments; the batch must be "
                "build_group_batch of the step's groups"
            )
        signals = self.signals(groups)
        out = TeacherRows()
        taught: set[int] = set()
        truncated = without = 0
        for d, (gi, i, s, k) in zip(batch.data, rows):
            d.extra[DISTILL_WEIGHTS] = [0.0] * len(d.weights)
            signal = signals[gi][i]
            if not signal.active or not any(d.weights):
                continue
            start = shared.prompt_start(s)
            seg = s.segments()[k]
            if k > 0 or not shared.distillable(seg, start):
                without += 1
                continue
            prefix, cut = self.teacher_prefix(tokenizer, context, groups[gi], s, signal)
            truncated += cut
            d.extra["completion_len"] = len(seg.tokens) - start
            d.extra[DISTILL_WEIGHTS] = list(d.weights)
            out.student.append(d)
            out.teacher.append(shared.teacher_row(prefix, seg, start))
            taught.add(id(s))
        samples = [s for g in groups for s in g.samples]
        flat = [sig for group_signals in signals for sig in group_signals]
        n = max(len(samples), 1)
        out.metrics = {
            "sdpo/signal_frac": len(taught) / n,
            "sdpo/solution_frac": sum(sig.solution is not None for sig in flat) / n,
            "sdpo/feedback_frac": sum(sig.feedback is not None for sig in flat) / n,
            "sdpo/feedback_available_frac": sum(has_feedback(s.feedback) for s in samples) / n,
            "sdpo/success_group_frac": sum(
                any(s.trainable and s.reward >= self.success_reward_threshold for s in g.samples) for g in groups
            )
            / max(len(groups), 1),
            "sdpo/no_signal_samples": float(sum(s.trainable and id(s) not in taught for s in samples)),
            "sdpo/rows_without_teacher": float(without),
            "sdpo/reprompt_truncated_frac": truncated / max(len(out.student), 1),
        }
        return out

    def attach_teachers(
        self, backend: Backend, batch: Batch, groups: list[Group], context: Any = None
    ) -> dict[str, float]:
        """:meth:`build_teachers`, then score the teacher rows and put their values in the
        taught rows (:data:`tempering.training.teacher.TEACHER_KEYS`), placeholders in the others (a
        batch's rows carry the same keys; their distillation mask is 0). Returns the metrics."""
        rows = self.build_teachers(backend.tokenizer, batch, groups, context)
        kind = self._teacher_input()
        weights = vars(self).get("weights") or self.teacher_weights()  # set up, or used on its own (tests)
        if rows.student and kind is not None:
            shared.attach_teacher(
                backend,
                Batch(rows.student),
                Batch(rows.teacher),
                kind,
                int(self.distillation_topk or 0),
                weights.kwargs,
            )
            width = _teacher_width(rows.student[0], kind)
            for d in batch.data:
                if TEACHER_TOKEN_LOGPROBS not in d.extra:
                    shared.fill_without_teacher(d, kind, width)
        return rows.metrics


@dataclass
class TeacherRows:
    """The rows that have a teacher (``student``, the batch's own Datums) and the teacher's row
    for each (``teacher``), with the step's signal metrics."""

    student: list[Datum] = field(default_factory=list)
    teacher: list[Datum] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _teacher_width(datum: Datum, kind: str) -> int:
    """The vocabulary (``full``) or k (``topk``) of a scored row's teacher values."""
    if kind == "full":
        return int(datum.extra["teacher_logits"].shape[-1])
    if kind == "topk":
        return int(datum.extra["teacher_topk_logprobs"].shape[-1])
    return 0
