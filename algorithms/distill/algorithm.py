"""The ``distill`` stage: on-policy distillation from a teacher model.

The student samples (the RL engine's rollouts: single-turn completions or multi-turn episodes,
:class:`tempering.training.rl.RLStage`); a teacher -- another model, loaded by a backend
(:mod:`tempering.algorithms.distill.teacher`) -- scores the very tokens the student sampled;
the KL term (:mod:`tempering.algorithms.distill.kl`) turns the per-token reverse KL into
advantages for the policy loss, or into a loss of its own. The stage is the RL engine plus two
components it holds, each with its own config block (``teacher:``, ``kl:``); it inherits no
other algorithm. An optional task ``reward`` adds its group-relative advantage to the KL's,
as the cookbook does when its environments reward.

Both models see the same token ids (the student's prompt and sample): the teacher must share
the student's vocabulary, which is checked when the stage starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tempering.algorithms.distill.kl import KLTerm, kl_term
from tempering.algorithms.distill.loss import ReverseKLLoss
from tempering.algorithms.distill.teacher import Teacher, TeacherSpec, check_teacher, open_teacher, teacher_spec
from tempering.errors import ConfigError
from tempering.interfaces import Distributions, FullDistributions, Loss, LossLogits, RunContext, supports
from tempering.loss_contract import TEACHER_TOKEN_LOGPROBS
from tempering.rollouts.rollout import recompute_sampler_logprobs, should_recompute
from tempering.schema import Problem, choice_message
from tempering.training.rl import RLStage
from tempering.training.stage import Requirement
from tempering.training.teacher import attach_teacher
from tempering.types import Batch, Datum, Group

RECOMPUTE = ("auto", "always", "never")


@dataclass
class Distill(RLStage):
    """On-policy distillation. Keys besides the RL engine's
    (:class:`~tempering.training.rl.RLStage`):

    - ``teacher`` (required): the teacher model (:class:`~tempering.algorithms.distill.teacher.TeacherSpec`):
      a folder / export / model name, ``{run: runs/NAME, step: N}``, a ``tinker://`` path on
      Tinker, or ``{backend: {...}}``;
    - ``kl``: the KL term (:class:`~tempering.algorithms.distill.kl.KLTerm`): ``sampled``
      (default), ``top_k`` or ``full``, with ``coef``, ``discount``, ``aggregation``;
    - ``reward``: ``null`` (default: the teacher is the only signal) or a task reward whose
      group-relative advantage is added to the KL advantage (``sampled`` only);
    - ``loss``: the policy loss the ``sampled`` advantages train (``importance_sampling``,
      Tinker's built-in sum; ``ppo`` / ``cispo`` clip it);
    - ``recompute_logprobs``: the student's logprobs in the KL are the sampler's when sampling
      was plain (temperature 1, no top-k/top-p), else a forward pass's (``auto``): a tempered
      sampler's logprobs are not the policy's. ``always`` / ``never`` force either.
    """

    teacher: Any = None
    kl: Any = "sampled"
    reward: Any = None
    loss: Any = "importance_sampling"
    group_size: int = 4
    recompute_logprobs: str = "auto"

    label = "distill"
    reward_optional = True  # the teacher is the signal
    #: The nested blocks' schemas (``tempering.registry.BLOCKS_HOOK``): their keys in docs/reference.md.
    config_blocks: ClassVar[dict[str, type]] = {"teacher": TeacherSpec, "kl": KLTerm}
    summary_keys = ("distill/teacher_kl", "loss", "reward/mean", "accuracy")
    postfix = {"kl": "distill/teacher_kl", "reward": "reward/mean"}

    # ------------------------------------------------------------------ validation and setup
    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The RL engine's checks, then what the KL estimator rules out (a policy loss or a task
        reward beside a ``top_k`` / ``full`` estimator, which is itself the loss). The blocks'
        own checks run when :meth:`validate` reads them."""
        yield from super().check_config(config)
        if config["recompute_logprobs"] not in RECOMPUTE:
            yield Problem("recompute_logprobs", choice_message(config["recompute_logprobs"], RECOMPUTE))
        estimator = estimator_of(config["kl"])
        if estimator == "sampled":
            return
        if config["loss"] != cls.__dataclass_fields__["loss"].default:
            yield Problem(
                "loss",
                f"kl.estimator '{estimator}' is itself the loss (a reverse KL over distributions); "
                "remove loss, or use kl.estimator: sampled to train its advantages with a policy loss",
            )
        if config["reward"] is not None:
            yield Problem(
                "reward",
                f"a task reward adds policy-gradient advantages, which kl.estimator '{estimator}' "
                "does not train; use kl.estimator: sampled, or remove reward",
            )

    def validate(self, ctx: RunContext) -> None:
        path = ctx.path
        kl_term(self.kl, f"{path}.kl")
        spec = teacher_spec(self.teacher, f"{path}.teacher")
        super().validate(ctx)
        check_teacher(spec, ctx)

    def required_capabilities(self) -> list[Requirement]:
        """A ``top_k`` / ``full`` estimator trains on the student's logits."""
        needs = super().required_capabilities()
        term = kl_term(self.kl, "kl")
        if not term.sampled:
            needs.append(
                Requirement(
                    LossLogits,
                    "kl.estimator",
                    f"'{term.estimator}' trains on the student's logits, which this backend does not give "
                    "a loss; use kl.estimator: sampled (Tinker's importance_sampling)",
                )
            )
        return needs

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """The RL engine's inputs plus what the teacher scores (its sampled-token logprobs, or
        distributions for the ``top_k`` / ``full`` estimators)."""
        return super().batch_inputs(loss) | kl_term(self.kl, "kl").teacher_needs.keys

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        super().setup(ctx, state)
        self.term: KLTerm = kl_term(self.kl, f"{ctx.path}.kl")
        self.kl_loss = self.term.loss()
        self.recompute = should_recompute(self.recompute_logprobs, self.params)
        self.teacher_model: Teacher = open_teacher(teacher_spec(self.teacher, f"{ctx.path}.teacher"), ctx)
        needs = self.term.teacher_needs
        wanted = {"full": FullDistributions, "topk": Distributions}.get(needs.input)
        if wanted is not None and not supports(self.teacher_model.scorer, wanted):
            self.teacher_model.close()
            raise ConfigError(
                f"'{self.term.estimator}' needs the teacher's {'full' if needs.input == 'full' else 'top-k'} "
                "next-token distributions, which its backend does not return; use kl.estimator: sampled"
                + ("" if needs.input == "topk" else " or top_k"),
                f"{ctx.path}.kl.estimator",
            )

    def teardown(self, ctx: RunContext, finished: bool) -> None:
        super().teardown(ctx, finished)
        teacher = vars(self).get("teacher_model")
        if teacher is not None:
            teacher.close()

    # ------------------------------------------------------------------ one step
    def prepare(self, ctx: RunContext, batch: Batch, step: int, groups: Sequence[Group]) -> dict[str, Any]:
        """The teacher scores the student's rows; the KL term shapes the advantages (or the
        distributions wait in the batch for its loss). Logs ``distill/teacher_kl``, the token
        mean of ``log p_student - log p_teacher`` on the sampled tokens (the cookbook's
        ``teacher_kl``: a one-sample estimate of the per-token reverse KL)."""
        if self.recompute:
            recompute_sampler_logprobs(self.backend, batch)
        needs = self.term.teacher_needs
        teacher_rows = Batch([Datum(d.input_tokens, d.target_tokens, d.weights) for d in batch.data])
        for d in batch.data:
            d.extra["completion_len"] = len(d.target_tokens)  # the teacher sees the student's whole row
        attach_teacher(
            self.teacher_model.scorer, batch, teacher_rows, needs.input, needs.topk, self.teacher_model.kwargs
        )
        metrics = teacher_kl(batch)
        if self.term.sampled:
            self.term.shape_advantages(batch)
        return metrics

    def objective(self) -> ReverseKLLoss | Loss:
        """The ``top_k`` / ``full`` reverse KL, else the policy loss on the KL advantages."""
        return self.kl_loss if self.kl_loss is not None else self.loss_fn


def estimator_of(kl: object) -> str:
    """The estimator a ``kl:`` value names (a string, a mapping, or a built :class:`KLTerm`),
    before the block is checked: what the stage's own keys are checked against."""
    if isinstance(kl, str):
        return kl
    if isinstance(kl, KLTerm):
        return kl.estimator
    return str(kl.get("estimator", "sampled")) if isinstance(kl, Mapping) else "sampled"


def teacher_kl(batch: Batch) -> dict[str, float]:
    """Token mean over the loss tokens of ``sampler_logprob - teacher_logprob`` (a sampled
    token outside a top-k teacher's support has no teacher logprob and is left out), and the
    mean teacher logprob of the student's tokens."""
    diffs, teacher = [], []
    for d in batch.data:
        for q, t, w in zip(d.sampler_logprobs or [], d.extra[TEACHER_TOKEN_LOGPROBS], d.weights):
            if w and t == t:  # t != t: NaN
                diffs.append(q - t)
                teacher.append(t)
    if not diffs:
        return {}
    return {"distill/teacher_kl": sum(diffs) / len(diffs), "distill/teacher_logprob": sum(teacher) / len(teacher)}
