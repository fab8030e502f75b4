"""SDPO's self-distillation term: a component the ``sdpo`` stage holds, with two config blocks.

``distillation:`` (:class:`Distillation`) says how the teacher's judgement enters the loss --
the mode (sampled token, top-k or full distributions), alpha, the importance-weight clip, the
blend weight -- and whose weights the teacher scores with (``ema`` of the policy, ``base``,
``stage_start``, ``live``). ``reprompt:`` (:class:`~tempering.algorithms.sdpo.context.Reprompt`)
says which samples get a teacher (a successful sibling, feedback) and what the teacher's prompt
is (the templates, the length cap).

:class:`SelfDistillation` is the term at run time: the stage calls it at named points -- ``start``
(the teacher's snapshot), ``prepare`` (each row's teacher, scored; the metrics), ``after_step``
(the EMA moves) and ``finish`` -- and builds its loss (:meth:`SelfDistillation.loss`, the
:class:`~tempering.algorithms.sdpo.loss.SDPOLoss` blend around the stage's policy loss). It reads
nothing of the stage: the backend, the batch, the groups and the sampler's context are arguments.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from tempering.algorithms.sdpo.context import (
    Reprompt,
    TeacherSignal,
    choose_signals,
    demonstration_text,
    has_feedback,
    reprompt_text,
    truncate_prompt,
)
from tempering.algorithms.sdpo.loss import DistillationSettings, SDPOLoss, distillation_problem, teacher_input
from tempering.interfaces import Backend, Distributions, FullDistributions, Loss, LossLogits, Tokenizer
from tempering.loss_contract import DISTILL_WEIGHTS, TEACHER_TOKEN_LOGPROBS
from tempering.rollouts.rollout import SamplerContext
from tempering.schema import Problem
from tempering.training import teacher as shared
from tempering.training.stage import Requirement, sub_config
from tempering.training.teacher import TEACHER_INPUT_KEYS, TeacherWeights
from tempering.types import Batch, Datum, Group, Sample

__all__ = ["Distillation", "SelfDistillation", "TeacherRows", "distillation", "reprompt"]


@dataclass
class Distillation(DistillationSettings):
    """The ``distillation:`` block (TRL's ``SDPOConfig`` names without their ``distillation_``
    prefix): ``mode`` (``sampled_token``, ``full_logits``, ``topk_logits``), ``alpha`` (1:
    reverse KL; 0 forward; JSD between), ``topk`` (required by ``topk_logits``),
    ``topk_support`` (``student`` / ``teacher``), ``add_tail``, ``is_clip`` (2.0; null = off),
    ``is_clip_low`` (null), ``weight`` (1.0: the share of the loss that is distillation), and
    the teacher's weights: ``teacher`` (``ema``, ``base``, ``stage_start``, ``live``),
    ``ema_rate`` (0.05), ``ema_every`` (1)."""

    teacher: str = "ema"
    ema_rate: float = 0.05
    ema_every: int = 1

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values that cannot work, at their keys (one rule set with :class:`SDPOLoss`)."""
        c = config
        problem = distillation_problem(
            c["mode"], c["alpha"], c["topk"], c["topk_support"], c["is_clip"], c["weight"], c["is_clip_low"]
        )
        if problem is not None:
            yield Problem(*problem)
        yield from TeacherWeights(c["teacher"], c["ema_rate"], every=c["ema_every"]).problems("ema_every")

    @property
    def teacher_input(self) -> str | None:
        """What the teacher must provide: ``token``, ``topk`` or ``full``; None when nothing is
        distilled (``weight`` 0)."""
        return teacher_input(self.mode, self.topk_support, self.weight)


def distillation(value: object, path: str) -> Distillation:
    """The ``distillation:`` block at ``path``, checked."""
    return sub_config(Distillation, value, path)


def reprompt(value: object, path: str) -> Reprompt:
    """The ``reprompt:`` block at ``path``, checked."""
    return sub_config(Reprompt, value, path)


@dataclass
class TeacherRows:
    """The rows that have a teacher (``student``, the batch's own Datums) and the teacher's row
    for each (``teacher``), with the step's signal metrics."""

    student: list[Datum] = field(default_factory=list)
    teacher: list[Datum] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


class SelfDistillation:
    """The self-distillation term at run time (see the module docstring). ``stage_id`` names
    the teacher's weight snapshot, so two stages' teachers never collide."""

    def __init__(self, config: Distillation, rules: Reprompt, stage_id: str = "") -> None:
        self.config, self.rules = config, rules
        self.weights = TeacherWeights(config.teacher, config.ema_rate, f"{stage_id}/sdpo_teacher", config.ema_every)
        self._trained = False

    @property
    def active(self) -> bool:
        """Whether anything is distilled (``weight > 0``): else the stage is GRPO."""
        return self.config.weight > 0

    # ------------------------------------------------------------------ what the stage asks before training
    def requirements(self) -> list[Requirement]:
        """The teacher's weights (snapshots for ``stage_start`` / ``ema``, averaging for
        ``ema``) and what the mode asks of the teacher: its own top-k (``topk_logits`` on the
        teacher's support) or full distributions (``full_logits``, ``topk_logits`` on the
        student's support). Nothing when ``weight`` is 0 (no teacher)."""
        if not self.active:
            return []
        needs = self.weights.requirements("distillation.teacher")
        mode, support = self.config.mode, self.config.topk_support
        kind = self.config.teacher_input
        if kind == "full":
            full = (
                f"'{mode}' (support: {support}) needs the teacher's full next-token distributions, which this "
                "backend does not return; use distillation.mode: topk_logits with distillation.topk_support: "
                "teacher, or sampled_token"
            )
            needs.append(Requirement(FullDistributions, "distillation.mode", full))
        elif kind == "topk":
            topk = (
                "'topk_logits' needs the teacher's top-k next-token distributions, which this backend does not "
                "return; use distillation.mode: sampled_token"
            )
            needs.append(Requirement(Distributions, "distillation.mode", topk))
        if kind in ("full", "topk"):
            logits = (
                f"'{mode}' trains on the student's logits, which this backend does not give a loss (it returns "
                "per-token logprobs only); use distillation.mode: sampled_token"
            )
            needs.append(Requirement(LossLogits, "distillation.mode", logits))
        return needs

    def batch_inputs(self) -> frozenset[str]:
        """What the term adds to the batch: the distillation mask and the teacher's values of the
        mode (:data:`tempering.training.teacher.TEACHER_INPUT_KEYS`); nothing when nothing is
        distilled."""
        kind = self.config.teacher_input
        return frozenset({DISTILL_WEIGHTS} | TEACHER_INPUT_KEYS[kind]) if kind else frozenset()

    def loss(self, policy: Loss) -> SDPOLoss:
        """``(1 - weight) * policy + weight * distillation`` around the stage's policy loss."""
        settings = {f.name: getattr(self.config, f.name) for f in fields(DistillationSettings)}
        return SDPOLoss(
            policy=policy, **{**settings, "alpha": float(self.config.alpha), "weight": float(self.config.weight)}
        )

    # ------------------------------------------------------------------ the stage's named points
    def start(self, backend: Backend, resuming: bool, path: str) -> None:
        """The teacher's snapshot at the stage's first step (checked on resume)."""
        if self.active:
            self.weights.start(backend, resuming=resuming, path=path)

    def prepare(self, backend: Backend, batch: Batch, groups: list[Group], context: SamplerContext) -> dict[str, float]:
        """Each row's teacher, scored, in place (:meth:`attach_teachers`); the metrics and
        ``time/teacher``."""
        self._trained = True
        if not self.active:
            return {}
        t0 = time.perf_counter()
        metrics = self.attach_teachers(backend, batch, groups, context)
        metrics["time/teacher"] = time.perf_counter() - t0
        return metrics

    def after_step(self, backend: Backend, step: int) -> None:
        """The EMA teacher moves after each optimizer step (not after a step with nothing to train)."""
        if self._trained and self.active:
            ema = self.weights.after_step(backend, step)
            if ema is not None:
                ema.result()
        self._trained = False

    def finish(self, backend: Backend) -> None:
        """Drop the teacher's snapshot once the stage finished."""
        if self.active:
            self.weights.finish(backend)

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
        self, tokenizer: Tokenizer, context: SamplerContext, group: Group, sample: Sample, signal: TeacherSignal
    ) -> tuple[list[int], bool]:
        """The teacher's prompt tokens for ``sample`` (and whether they were truncated)."""
        r = self.rules
        solution = None
        if signal.solution is not None:
            solution = demonstration_text(
                tokenizer, group.samples[signal.solution], r.remove_thinking_from_demonstration
            )
        tokens = shared.reprompted_prefix(
            context,
            tokenizer,
            sample,
            lambda text: reprompt_text(
                r.reprompt_template, r.solution_template, r.feedback_template, text, solution, signal.feedback
            ),
        )
        return truncate_prompt(tokens, r.max_reprompt_len)

    def build_teachers(
        self, tokenizer: Tokenizer, batch: Batch, groups: list[Group], context: SamplerContext
    ) -> TeacherRows:
        """Which rows of ``batch`` have a teacher, and the teacher's row for each, in place:
        every row gets ``distill_weights`` (the distillation part's loss mask: the row's
        weights where it has a teacher, zeros elsewhere) and a taught row ``completion_len``.

        ``batch`` is :func:`tempering.training.rl.build_group_batch` of ``groups``: one row per training
        segment of each sample, in order. ``context`` is the stage's sampler's
        :class:`~tempering.rollouts.rollout.SamplerContext` (how its prompts were rendered)."""
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
        threshold = self.rules.success_reward_threshold
        out.metrics = {
            "sdpo/signal_frac": len(taught) / n,
            "sdpo/solution_frac": sum(sig.solution is not None for sig in flat) / n,
            "sdpo/feedback_frac": sum(sig.feedback is not None for sig in flat) / n,
            "sdpo/feedback_available_frac": sum(has_feedback(s.feedback) for s in samples) / n,
            "sdpo/success_group_frac": sum(
                any(s.trainable and s.reward >= threshold for s in g.samples) for g in groups
            )
            / max(len(groups), 1),
            "sdpo/no_signal_samples": float(sum(s.trainable and id(s) not in taught for s in samples)),
            "sdpo/rows_without_teacher": float(without),
            "sdpo/reprompt_truncated_frac": truncated / max(len(out.student), 1),
        }
        return out

    def attach_teachers(
        self, backend: Backend, batch: Batch, groups: list[Group], context: SamplerContext
    ) -> dict[str, float]:
        """:meth:`build_teachers`, then score the teacher rows and put their values in the
        taught rows (:data:`tempering.training.teacher.TEACHER_KEYS`), placeholders in the others (a
        batch's rows carry the same keys; their distillation mask is 0). Returns the metrics."""
        rows = self.build_teachers(backend.tokenizer, batch, groups, context)
        kind = self.config.teacher_input
        if rows.student and kind is not None:
            shared.attach_teacher(
                backend,
                Batch(rows.student),
                Batch(rows.teacher),
                kind,
                int(self.config.topk or 0),
                self.weights.kwargs,
            )
            width = _teacher_width(rows.student[0], kind)
            for d in batch.data:
                if TEACHER_TOKEN_LOGPROBS not in d.extra:
                    shared.fill_without_teacher(d, kind, width)
        return rows.metrics


def _teacher_width(datum: Datum, kind: str) -> int:
    """The vocabulary (``full``) or k (``topk``) of a scored row's teacher values."""
    if kind == "full":
        return int(datum.extra["teacher_logits"].shape[-1])
    if kind == "topk":
        return int(datum.extra["teacher_topk_logprobs"].shape[-1])
    return 0
