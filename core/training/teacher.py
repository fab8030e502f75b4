"""The self-distillation teacher, shared by SDFT and SDPO: whose weights score, with what
context, and how its values line up with the student's rows.

In both algorithms the teacher is *the same model* given more context than the student had
(a demonstration for SDFT; a successful sibling or the environment's feedback for SDPO), and
it scores the very tokens the student sampled. Three things are common and live here, so one
piece of code serves both:

* **Whose weights** (:class:`TeacherWeights`): ``base`` (LoRA adapter off / frozen initial
  weights), ``stage_start`` (a snapshot taken as the stage began), ``live`` (the current
  policy) or ``ema`` (a snapshot that moves towards the policy by ``rate`` after optimizer
  steps). Snapshots are a backend capability
  (:class:`~tempering.interfaces.WeightSnapshots`, :class:`~tempering.interfaces.EmaWeights`),
  declared as :class:`~tempering.training.stage.Requirement` s so a backend without them is refused
  before anything trains, and are saved in checkpoints so a resumed stage has the same teacher.
* **What context** (:func:`reprompted_prefix`): the student's first prompt with the last user
  message's text rewritten (raw text, a user turn, a ``messages`` chat, or a multi-turn
  episode's first messages), rendered by the stage's own renderer so chat formats stay exact.
* **Alignment** (:func:`teacher_row`, :func:`attach_teacher`): the student row is
  ``prompt_s + continuation`` and the teacher row ``prompt_t + continuation``; the last
  ``completion_len`` target positions of both predict the same tokens, so the teacher's values
  there are copied into the student row's positions (prompt positions get placeholders the
  loss mask hides). The values travel in the row's ``extra`` under :data:`TEACHER_KEYS`.

:func:`teacher_divergence` reads those keys back inside a loss and computes the per-token
divergence with :mod:`tempering.rlmath.divergence`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, cast, runtime_checkable

from tempering.interfaces import (
    Backend,
    Distributions,
    EmaWeights,
    Tokenizer,
    WeightSnapshots,
    at_positions,
    from_positions,
)
from tempering.loss_contract import (
    LOGIT_POSITIONS,
    LOGITS,
    TEACHER_LOGITS,
    TEACHER_TOKEN_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
)
from tempering.rollouts.data import encode_prompt, user_turn
from tempering.schema import Problem
from tempering.training.stage import Requirement
from tempering.types import Batch, Datum, Sample, Segment

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tempering.rollouts.rollout import SamplerContext
    from tempering.training.stage import Requirement

#: Teacher weights: see :class:`TeacherWeights`.
TEACHERS = ("base", "stage_start", "live", "ema")
#: What a loss needs from the teacher: ``token`` logprobs of the sampled tokens, ``topk``
#: (values, ids) of its own top-k, or ``full`` distributions over the vocabulary.
TEACHER_INPUTS = ("token", "topk", "full")
#: The ``Datum.extra`` keys :func:`attach_teacher` fills (per target position): the loss
#: contract's names (:mod:`tempering.loss_contract`), so a loss reads them as its stage wrote them.
TEACHER_KEYS = (TEACHER_TOKEN_LOGPROBS, TEACHER_LOGITS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS)
#: The batch inputs :func:`attach_teacher` fills for each teacher input (the sampled tokens'
#: logprobs always: the stage logs the sampled-token KL from them).
TEACHER_INPUT_KEYS: Final[Mapping[str, frozenset[str]]] = {
    "token": frozenset({TEACHER_TOKEN_LOGPROBS}),
    "topk": frozenset({TEACHER_TOKEN_LOGPROBS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS}),
    "full": frozenset({TEACHER_TOKEN_LOGPROBS, TEACHER_LOGITS}),
}


@dataclass(frozen=True)
class TeacherNeeds:
    """What a distillation loss needs its stage to prepare, declared by the loss
    (:class:`DistillationLoss`) instead of read off its config by name.

    ``input``: one of :data:`TEACHER_INPUTS` (what :func:`attach_teacher` scores); ``topk``: the
    teacher's top-k size for ``topk``; ``aggregation``: the normaliser (``seq_mean`` /
    ``token_mean``) the stage folds into the sampled-token advantages, for a loss that sums
    over tokens (``token``: Tinker's ``importance_sampling``)."""

    input: str = "token"
    topk: int = 0
    aggregation: str = "seq_mean"

    @property
    def keys(self) -> frozenset[str]:
        """The batch inputs the teacher's scores fill (:data:`TEACHER_INPUT_KEYS`)."""
        return TEACHER_INPUT_KEYS[self.input]


@runtime_checkable
class DistillationLoss(Protocol):
    """A loss that learns from a teacher and says what the teacher must provide."""

    @property
    def teacher_needs(self) -> TeacherNeeds: ...


def teacher_needs(loss: object) -> TeacherNeeds:
    """What ``loss`` needs of the teacher: its declaration (:class:`DistillationLoss`), else the
    sampled-token default -- a plain policy loss (``importance_sampling``) trained on the
    teacher's sampled-token advantages, as it always was."""
    return loss.teacher_needs if isinstance(loss, DistillationLoss) else TeacherNeeds()


@dataclass
class TeacherWeights:
    """Whose weights the teacher scores with, and the snapshot's lifecycle over a stage.

    ``kind`` is one of :data:`TEACHERS`; ``rate`` the EMA rate (``teacher = (1 - rate) teacher
    + rate policy``); ``name`` the snapshot's name on the backend (per stage, so two stages'
    teachers never collide); ``every`` moves the EMA every this many optimizer steps.
    """

    kind: str = "ema"
    rate: float = 0.05
    name: str = "teacher"
    every: int = 1

    def problems(self, every_key: str = "") -> Iterator[Problem]:
        """A bad kind (at ``teacher``), rate (``ema_rate``) or interval (``every_key``, when the
        stage has one), as :class:`~tempering.schema.Problem` s for the stage's or block's check."""
        if self.kind not in TEACHERS:
            yield Problem("teacher", f"use one of {', '.join(TEACHERS)} (got '{self.kind}')")
        if not 0.0 < self.rate <= 1.0:
            yield Problem("ema_rate", f"must be in (0, 1], got {self.rate}")
        if every_key and self.every < 1:
            yield Problem(every_key, f"must be >= 1, got {self.every}")

    @property
    def snapshotted(self) -> bool:
        """True when the teacher is a weight snapshot of its own (``stage_start``, ``ema``)."""
        return self.kind in ("stage_start", "ema")

    def requirements(self, key: str = "teacher") -> list[Requirement]:
        """The backend capabilities this teacher needs: snapshots for ``stage_start`` / ``ema``,
        averaging for ``ema``."""
        needs = []
        if self.snapshotted:
            needs.append(
                Requirement(WeightSnapshots, key, f"'{self.kind}' needs a backend with weight snapshots (e.g. local)")
            )
        if self.kind == "ema":
            needs.append(
                Requirement(
                    EmaWeights,
                    key,
                    "'ema' needs a backend that averages weights (ema_update, "
                    f"e.g. local); use {key}: stage_start, base or live",
                )
            )
        return needs

    def start(self, backend: Backend, resuming: bool, path: str) -> None:
        """Take the snapshot at the stage's first step; on resume, insist the checkpoint has it
        (a teacher silently restarted from other weights would change the run)."""
        if not self.snapshotted:
            return
        snapshots = cast(WeightSnapshots, backend)
        if not resuming:
            snapshots.snapshot(self.name).result()
        elif self.name not in snapshots.snapshot_names():
            raise RuntimeError(f"{path}: resuming, but the checkpoint has no '{self.name}' teacher snapshot")

    @property
    def kwargs(self) -> dict[str, Any]:
        """The scoring call's keywords: ``{}`` (live), ``{"reference": True}`` (base) or
        ``{"weights": name}``."""
        return {"base": {"reference": True}, "live": {}}.get(self.kind, {"weights": self.name})

    def after_step(self, backend: Backend, step: int) -> Future[None] | None:
        """Queue the EMA update after optimizer step ``step`` (0-based) when one is due; the
        backend runs calls in order, so it moves after the step and before any checkpoint."""
        if self.kind != "ema" or (step + 1) % self.every:
            return None
        return cast(EmaWeights, backend).ema_update(self.name, self.rate)

    def finish(self, backend: Backend) -> None:
        """Drop the snapshot once the stage finished (a later stage must not inherit it)."""
        if self.snapshotted:
            cast(WeightSnapshots, backend).drop_snapshot(self.name).result()


# --------------------------------------------------------------------------- the teacher's context
def prompt_start(sample: Sample) -> int:
    """How many tokens of the sample's first training row are its first prompt."""
    traj = sample.trajectory
    if traj is None:
        return len(sample.completion.prompt_tokens)
    return traj.turns[0].prompt_len if traj.turns else 0


def distillable(segment: Segment, start: int) -> bool:
    """A row can be distilled when its first ``start`` tokens are the student's prompt (no
    sampled token among them) and something was sampled after them."""
    return 0 < start < len(segment.tokens) and not any(segment.weights[:start]) and any(segment.weights[start:])


def prompt_messages(sample: Sample) -> tuple[list[dict[str, Any]], Any] | None:
    """The chat messages (and tools) the student's first prompt was rendered from, or None
    when the student saw the raw ``prompt`` text: a multi-turn episode's messages before its
    first assistant turn, an example's ``messages``, or its text prompt as one user turn."""
    traj = sample.trajectory
    if traj is not None:
        first = next((i for i, m in enumerate(traj.messages) if m.get("role") == "assistant"), len(traj.messages))
        return [dict(m) for m in traj.messages[:first]], traj.tools
    if "messages" in sample.example:
        return [dict(m) for m in sample.example["messages"]], sample.example.get("tools")
    return None


def reprompted_prefix(
    context: SamplerContext,
    tokenizer: Tokenizer | None,
    sample: Sample,
    rewrite: Callable[[str], str],
    earlier: Callable[[str], list[dict[str, Any]]] | None = None,
) -> list[int]:
    """The teacher's prompt tokens: the student's first prompt with the text of its last user
    message replaced by ``rewrite(text)``, encoded the way the student's was -- raw text with
    the tokenizer (a stage without a chat renderer), or messages through the stage's renderer
    (a text prompt as a user turn, an example's ``messages``, an episode's first messages).

    ``earlier(text)``: chat turns put before that user message (e.g. the same request already
    answered by a demonstration, SDFT's ``demonstration_placement: earlier_turn``); only a chat
    prompt has turns, so a raw-text student cannot have them (``ValueError``)."""
    found = prompt_messages(sample)
    if found is None:
        if not context.chat_prompts:  # the student saw the raw text, so does the teacher
            if earlier is not None:
                raise ValueError("earlier turns need a chat prompt; this stage renders raw text (renderer: raw)")
            if tokenizer is None:
                raise ValueError("a raw-text prompt is encoded with the model's tokenizer; none was given")
            return encode_prompt(tokenizer, {"prompt": rewrite(str(sample.example["prompt"]))})
        found = user_turn(sample.example), sample.example.get("tools")
    messages, tools = found
    users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
    if not users:
        raise ValueError("the teacher's prompt needs a user message to rewrite; the student's prompt has none")
    last = users[-1]
    text = message_text(messages[last])
    messages[last]["content"] = rewrite(text)
    if earlier is not None:
        messages[last:last] = earlier(text)
    return list(context.renderer().render_prompt(messages, tools or None).tokens)


def message_text(message: Mapping[str, Any]) -> str:
    """A message's text: its ``content`` string, or the text parts of a content list."""
    content = message.get("content", "")
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text")
    return str(content or "")


def teacher_row(prefix: list[int], segment: Segment, start: int) -> Datum:
    """The teacher's row for a student row ``segment`` whose first ``start`` tokens are the
    student's prompt: ``prefix`` + the same continuation, loss weights on the same tokens."""
    tokens = list(prefix) + list(segment.tokens[start:])
    return Datum(tokens[:-1], tokens[1:], [0.0] * (len(prefix) - 1) + list(segment.weights[start:]))


# --------------------------------------------------------------------------- scoring and alignment
def attach_teacher(
    backend: Backend,
    batch: Batch,
    teacher_batch: Batch,
    kind: str,
    topk: int,
    teacher_kwargs: Mapping[str, Any] | None = None,
) -> None:
    """Score the teacher rows and put the values, aligned to the student's positions, in each
    student row's ``extra`` (row ``i`` of ``batch`` pairs with row ``i`` of ``teacher_batch``;
    each student row says how many of its last target positions are the continuation, as
    ``extra["completion_len"]``): ``teacher_token_logprobs`` always, plus ``teacher_logits``
    (``full``: ``(T, V)`` log-probabilities) or ``teacher_topk_logprobs`` / ``_ids``
    (``topk``: ``(T, K)``). A sampled token outside the teacher's top-k has no logprob: NaN."""
    import torch

    kw = dict(teacher_kwargs or {})  # {} = the live policy; {"reference": True}; {"weights": snapshot}
    if kind == "token":
        values = backend.logprobs(teacher_batch, **kw).result()
        for d, t in zip(batch.data, values):
            n = d.extra["completion_len"]
            d.extra[TEACHER_TOKEN_LOGPROBS] = [0.0] * (len(d.target_tokens) - n) + list(t[-n:])
        return
    dists = (
        cast(Distributions, backend).distributions(teacher_batch, topk=topk if kind == "topk" else None, **kw).result()
    )
    for d, dist in zip(batch.data, dists):
        n = d.extra["completion_len"]
        pad = len(d.target_tokens) - n
        targets = torch.tensor(d.target_tokens[pad:], dtype=torch.long)
        if kind == "full":
            full = dist[-n:]
            d.extra[TEACHER_LOGITS] = torch.cat([uniform_filler(pad, full.shape[-1], full.dtype), full], dim=0)
            token_lp = full.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        else:
            values, ids = dist[0][-n:], dist[1][-n:]
            filler_lp, filler_ids = topk_filler(pad, values.shape[-1], ids.dtype)
            d.extra[TEACHER_TOPK_LOGPROBS] = torch.cat([filler_lp, values], dim=0)
            d.extra[TEACHER_TOPK_IDS] = torch.cat([filler_ids, ids], dim=0)
            hit = ids == targets.unsqueeze(-1)  # a token outside the teacher's top-k: no value
            token_lp = torch.where(hit.any(-1), (values * hit).sum(-1), torch.full_like(values[:, 0], float("nan")))
        d.extra[TEACHER_TOKEN_LOGPROBS] = [0.0] * pad + token_lp.tolist()


def uniform_filler(rows: int, vocab: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``rows`` uniform log-distributions over ``vocab``: what positions without a teacher hold
    (a finite, valid distribution, so a masked divergence stays finite)."""
    import torch

    return torch.full((rows, vocab), -math.log(vocab), dtype=dtype or torch.float32)


def topk_filler(rows: int, k: int, ids_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` uniform top-k placeholders (values, ids) for positions without a teacher."""
    import torch

    return torch.full((rows, k), -math.log(k)), torch.zeros((rows, k), dtype=ids_dtype or torch.long)


def fill_without_teacher(datum: Datum, kind: str, width: int) -> None:
    """Placeholders for a row the teacher does not score (a batch's rows must all carry the
    same keys): token logprobs 0, uniform ``full`` distributions over ``width`` tokens or
    uniform ``topk`` entries of ``width``. The row's distillation mask must be 0 throughout."""
    n = len(datum.target_tokens)
    datum.extra[TEACHER_TOKEN_LOGPROBS] = [0.0] * n
    if kind == "full":
        datum.extra[TEACHER_LOGITS] = uniform_filler(n, width)
    elif kind == "topk":
        datum.extra[TEACHER_TOPK_LOGPROBS], datum.extra[TEACHER_TOPK_IDS] = topk_filler(n, width)


def teacher_divergence(
    logprobs: torch.Tensor,
    batch: Mapping[str, torch.Tensor],
    mode: str,
    alpha: float,
    topk: int,
    add_tail: bool,
    support: str,
) -> torch.Tensor:
    """The ``(B, T)`` per-token divergence of a logit mode between the student
    (``batch["logits"]``, at ``batch["logit_positions"]`` when present) and the teacher values
    :func:`attach_teacher` put in the batch; 0 where the logits were not computed.

    ``full_logits``: over the vocabulary; ``topk_logits`` on the student's top-k (``support``
    ``student``, needs the teacher's full distribution) or the teacher's (``teacher``, its
    top-k values and ids). See :mod:`tempering.rlmath.divergence`."""
    # torch on first use: validating a recipe imports this module and must not load torch
    from tempering.rlmath.divergence import full_logits_loss, topk_logits_loss

    positions = batch.get(LOGIT_POSITIONS)
    logits = batch[LOGITS].float()

    def teacher(key: str) -> torch.Tensor:
        return at_positions(batch[key], positions)

    if mode == "full_logits":
        per_token = full_logits_loss(logits, teacher(TEACHER_LOGITS).float(), alpha)
    elif support == "student":
        per_token = topk_logits_loss(logits, alpha, topk, add_tail, teacher_logits=teacher(TEACHER_LOGITS).float())
    else:
        per_token = topk_logits_loss(
            logits,
            alpha,
            topk,
            add_tail,
            teacher_topk_logprobs=teacher(TEACHER_TOPK_LOGPROBS),
            teacher_topk_ids=teacher(TEACHER_TOPK_IDS),
        )
    return from_positions(per_token, positions, logprobs.shape[-1])
