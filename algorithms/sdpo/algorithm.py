"""The ``sdpo`` stage: policy-gradient RL whose loss also distils a feedback-conditioned teacher.

SDPO (Hübotter et al. 2026, "Reinforcement Learning via Self-Distillation"; TRL 1.16's
``trl.experimental.sdpo``). The stage is composed, not inherited: the core's policy-gradient
stage (:class:`~tempering.training.policy_gradient.PolicyGradient`: rollouts through the stage's
sampler, group-relative advantages, the policy loss, "old" and reference logprobs -- GRPO's step)
holding two components, each with its own config block:

* the self-distillation term (:class:`~tempering.algorithms.sdpo.distillation.SelfDistillation`;
  blocks ``distillation:`` and ``reprompt:``), which before training gives each sample a teacher:

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
   ``(1 - weight) * policy + weight * distillation``. Samples with no
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

* stale rollouts (:class:`~tempering.training.stale.StaleRollouts`; block ``stale:``, unset =
  synchronous, on-policy), the component the ``offpolicy`` stage holds too.

**Stale SDPO** (``stale: {max_steps_off_policy: k}``): rollouts come from the asynchronous
producer, up to ``k`` optimizer steps stale, with its corrections:
the advantage cap and folded normaliser of the policy loss (the stale recipe's ``loss:
clipped_is``: PPO's two-sided ratio clip around the *sampler's* policy, ``|A|`` capped at 3x its
running mean),
the ratio / ESS diagnostics, the staleness metrics, a sampler snapshot published after each
optimizer step. The "old" logprobs are the sampler's own, never recomputed (they are what the
stale tokens were drawn from), so the sampler must draw from the untempered policy the trainer
scores (temperature 1, no top-k/top-p). The distillation term's per-token weight is the ratio
clipped to ``[distillation.is_clip_low, distillation.is_clip]``. The teacher is scored at
training time: the current teacher weights on the stale sample's tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tempering.algorithms.sdpo.context import Reprompt
from tempering.algorithms.sdpo.distillation import Distillation, SelfDistillation, distillation, reprompt
from tempering.errors import ConfigError
from tempering.interfaces import Loss, RunContext
from tempering.loss_contract import check_reads
from tempering.rollouts.rollout import RolloutSource
from tempering.schema import Problem
from tempering.training.policy_gradient import PolicyGradient
from tempering.training.stage import Requirement
from tempering.training.stale import MOVED_KEYS as STALE_MOVED_KEYS
from tempering.training.stale import Staleness, StaleRollouts, staleness
from tempering.types import Batch, Group

__all__ = ["SDPO"]

#: The flat keys of earlier versions, and the block each moved to (one line for an old recipe).
MOVED = {
    **{
        f"distillation_{k}": f"distillation: {{{k}: ...}}"
        for k in ("mode", "alpha", "topk", "topk_support", "add_tail", "is_clip", "is_clip_low", "weight")
    },
    **{k: f"distillation: {{{k}: ...}}" for k in ("teacher", "ema_rate", "ema_every")},
    **{
        k: f"reprompt: {{{k}: ...}}"
        for k in (
            "use_successful_as_teacher",
            "success_reward_threshold",
            "dont_reprompt_on_self_success",
            "include_environment_feedback",
            "environment_feedback_only_without_solution",
            "remove_thinking_from_demonstration",
            "max_reprompt_len",
            "reprompt_template",
            "solution_template",
            "feedback_template",
        )
    },
    **STALE_MOVED_KEYS,
}


@dataclass
class SDPO(PolicyGradient):
    """Self-distillation policy optimization (see the module docstring; every key in
    docs/sdpo.md). Keys besides the policy-gradient stage's
    (:class:`~tempering.training.policy_gradient.PolicyGradient`: the RL engine's and
    ``recompute_logprobs``, ``log_kl``, ``kl_every``, ``reference``), three blocks:

    - ``distillation:`` (:class:`~tempering.algorithms.sdpo.distillation.Distillation`): ``mode``,
      ``alpha``, ``topk``, ``topk_support``, ``add_tail``, ``is_clip``, ``is_clip_low``,
      ``weight``, ``teacher``, ``ema_rate``, ``ema_every``;
    - ``reprompt:`` (:class:`~tempering.algorithms.sdpo.context.Reprompt`): who gets a teacher and
      the teacher's prompt;
    - ``stale:`` (:class:`~tempering.training.stale.Staleness`; null = on-policy): stale rollouts.
    """

    distillation: Any = field(default_factory=dict)
    reprompt: Any = field(default_factory=dict)
    stale: Any = None

    label = "sdpo"
    config_blocks: ClassVar[dict[str, type]] = {"distillation": Distillation, "reprompt": Reprompt, "stale": Staleness}
    moved_keys: ClassVar[dict[str, str]] = MOVED
    summary_keys = ("reward/mean", "accuracy", "loss", "sdpo/signal_frac", "sdpo/teacher_kl")
    postfix = {"reward": "reward/mean", "signal": "sdpo/signal_frac"}

    # ------------------------------------------------------------------ validation and setup
    def term(self, stage_id: str = "", path: str = "") -> SelfDistillation:
        """The self-distillation term of this stage's ``distillation:`` and ``reprompt:`` blocks."""
        where = f"{path}." if path else ""
        rules = reprompt(self.reprompt, f"{where}reprompt")
        return SelfDistillation(distillation(self.distillation, f"{where}distillation"), rules, stage_id)

    def staleness(self, path: str = "") -> Staleness | None:
        """The ``stale:`` block (None: on-policy)."""
        return None if self.stale is None else staleness(self.stale, f"{path}.stale" if path else "stale")

    def validate(self, ctx: RunContext) -> None:
        """The three blocks, one line each, before the policy-gradient stage's own checks (and
        before anything trains)."""
        path = ctx.path
        term = self.term(path=path)
        if ctx.backend is not None:
            problem = term.rules.check_encodable(ctx.backend.tokenizer)
            if problem is not None:
                raise ConfigError(problem.message, f"{path}.reprompt.{problem.key}")
        self.staleness(path)
        super().validate(ctx)

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The policy-gradient stage's checks; then, stale, a sampler whose logprobs are those of
        the policy the trainer scores. Both loss parts score the student untempered (the teacher
        too), so the importance ratios against the sampler's logprobs are only ratios when the
        sampler drew from the untempered, unfiltered policy; and they are never recomputed (a
        recomputation would be the current weights', not the stale sampler's). The blocks'
        own checks run when :meth:`validate` reads them."""
        yield from super().check_config(config)
        if config["stale"] is None:
            return
        for key, neutral in (("temperature", 1.0), ("top_k", 0), ("top_p", 1.0)):
            if config[key] != neutral:
                yield Problem(
                    key,
                    f"stale SDPO (a stale: block) needs {key}: {neutral:g}, got {config[key]}: the importance "
                    "ratios compare the sampler's logprobs with the untempered policy the trainer (and the "
                    "teacher) score",
                )
        if config["recompute_logprobs"] == "always":
            yield Problem(
                "recompute_logprobs",
                "stale SDPO keeps the sampler's logprobs as the importance ratios' 'old' (recomputed "
                "ones would be the current weights'); use auto",
            )

    def required_capabilities(self) -> list[Requirement]:
        """The policy-gradient stage's, and the distillation term's (:meth:`SelfDistillation.requirements`)."""
        return super().required_capabilities() + self.term().requirements()

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """The policy-gradient stage's inputs, plus the distillation term's (its mask and the
        teacher's values of the mode). ``loss`` is the stage's policy loss; the blended
        :class:`~tempering.algorithms.sdpo.loss.SDPOLoss` is checked against the same set at setup."""
        return super().batch_inputs(loss) | self.term().batch_inputs()

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        self.distiller = self.term(ctx.stage_id, ctx.path)
        super().setup(ctx, state)
        check_reads(self.blend, self.batch_inputs(self.loss_fn), f"{ctx.path}.loss", self.label)
        if self.corrections is not None:
            self.recompute = False  # the sampler's logprobs are the ratios' "old" (checked in validate)
        self.distiller.start(self.backend, resuming=int(state.get("step", 0)) > 0, path=ctx.path)

    def make_rollouts(self, ctx: RunContext, state: Mapping[str, Any]) -> RolloutSource:
        """The blended loss (the policy loss is built by now: the RL engine calls this last in its
        setup), then on-policy rollouts, or (a ``stale:`` block) the stale-rollout component's
        producer, set up for the policy loss and the blend."""
        self.blend = self.distiller.loss(self.loss_fn)
        keys = self.staleness(ctx.path)
        self.corrections: StaleRollouts | None = None
        if keys is None:
            return super().make_rollouts(ctx, state)
        self.corrections = StaleRollouts(keys, self.loss_fn, self.blend, self.params, state, ctx.path)
        return self.corrections.start(self, ctx, state)

    def loop_state(self) -> dict[str, Any]:
        return {**super().loop_state(), **(self.corrections.state() if self.corrections is not None else {})}

    def objective(self) -> Loss:
        """The :class:`~tempering.algorithms.sdpo.loss.SDPOLoss`; stale, wrapped in the off-policy
        objective (scored as the sampler drew, ratio diagnostics)."""
        return self.corrections.objective if self.corrections is not None else self.blend

    def teardown(self, ctx: RunContext, finished: bool) -> None:
        super().teardown(ctx, finished)
        if finished and "distiller" in vars(self):  # setup ran
            self.distiller.finish(self.backend)

    # ------------------------------------------------------------------ one step
    def prepare(self, ctx: RunContext, batch: Batch, step: int, groups: Sequence[Group]) -> dict[str, Any]:
        """The policy-gradient preparation (old / reference logprobs), the stale corrections (the
        policy loss's advantages capped and normalised), then each row's teacher."""
        metrics = super().prepare(ctx, batch, step, groups)
        if self.corrections is not None:
            metrics.update(self.corrections.prepare(batch))
        metrics.update(self.distiller.prepare(self.backend, batch, list(groups), self.rollout_sampler.context))
        return metrics

    def after_optim(self, ctx: RunContext, step: int) -> None:
        """The EMA teacher moves; stale, a sampler snapshot is published."""
        super().after_optim(ctx, step)
        self.distiller.after_step(self.backend, step)
        if self.corrections is not None:
            self.corrections.after_optim(self.backend, step)
