"""SDFT stage: on-policy self-distillation from a demonstration-conditioned teacher.

Each step: the student (the policy) rolls out the dataset's prompts alone, through the stage's
sampler -- single-turn completions by default, or multi-turn episodes of an environment; the
teacher -- the same model, conditioned on ``teacher_template`` (prompt + demonstration) --
scores those very tokens; the loss pulls the student's per-token distribution towards the
teacher's on the tokens the student produced (:mod:`tempering.algorithms.sdft.loss`).

Alignment: the student row is ``prompt_s + completion`` and the teacher row ``prompt_t +
completion``; the last ``L = len(completion)`` target positions of both predict the same
completion tokens, so the teacher's values for those positions are copied into the student
row's positions ``len(prompt_s) - 1 ...`` (prompt positions get placeholders the mask hides).

Teacher weights (``teacher``):

* ``base``: the backend's reference -- LoRA adapter disabled, or the frozen initial weights;
* ``stage_start``: the policy frozen as it was when this stage began (a weight snapshot);
* ``live``: the current policy;
* ``ema`` (default, the paper's): an exponential moving average of the policy that starts at
  the stage-start weights and moves by ``ema_rate`` after every optimizer step
  (``teacher = (1 - rate) teacher + rate policy``; the paper uses 0.01-0.05, TRL 0.05).

``stage_start`` and ``ema`` need a backend with weight snapshots
(:class:`~tempering.interfaces.WeightSnapshots`), ``ema`` one that averages them too
(:class:`~tempering.interfaces.EmaWeights`): the local one; checked before anything trains.
Snapshots are saved in checkpoints, so a stage resumes with the same teacher.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tempering.errors import ConfigError
from tempering.interfaces import Backend, Distributions, FullDistributions, Loss, LossLogits, RunContext, model_renderer
from tempering.loss_contract import ADVANTAGES, ROW_INPUTS, SAMPLER_LOGPROBS, TEACHER_TOKEN_LOGPROBS
from tempering.rlmath.aggregation import fold_normaliser
from tempering.rollouts.data import ExampleStream, load_examples
from tempering.rollouts.rollout import collect, recompute_sampler_logprobs, should_recompute
from tempering.schema import Problem
from tempering.training import teacher as shared
from tempering.training.evaluate import build_sampler, completion_sampler
from tempering.training.stage import Requirement, SamplingKeys, Stage, check_stage
from tempering.training.teacher import TEACHERS, TeacherWeights, teacher_needs
from tempering.types import Batch, Datum, SamplingParams

__all__ = ["DEFAULT_TEACHER_TEMPLATE", "PLACEMENTS", "SDFT", "TEACHERS", "teacher_prompt", "traj_ok"]
#: Where the teacher sees the demonstration (``demonstration_placement``).
PLACEMENTS = ("prompt", "earlier_turn")
#: The paper's teacher prompt (arXiv 2601.19897). ``{prompt}`` / ``{question}`` is the student's
#: prompt, ``{demonstration}`` / ``{demo}`` / ``{privileged_context}`` the demonstration.
DEFAULT_TEACHER_TEMPLATE = (
    "{prompt} This is an example for a response to the question: {demonstration} "
    "Now answer with a response of your own, including the thinking process."
)


def teacher_prompt(template: str, prompt: str, demonstration: str) -> str:
    return template.format(
        prompt=prompt,
        question=prompt,
        demonstration=demonstration,
        demo=demonstration,
        privileged_context=demonstration,
    )


@dataclass
class SDFT(SamplingKeys, Stage):
    """Self-distillation fine-tuning on rows with ``prompt`` and ``demonstration``.

    ``loss`` is a registered loss, default ``sdft`` (``{name: sdft, mode: topk_logits, topk:
    100, alpha: 0.5}``); its ``mode`` decides what the teacher provides (sampled-token
    logprobs, top-k or full logits). ``skip_first_tokens`` drops the first completion tokens
    from the loss (the paper skips 3, to ignore teacher-prompt artefacts such as "Sure, ...").

    ``demonstration_placement``: ``prompt`` puts the demonstration into the teacher's user turn
    through ``teacher_template`` (the paper's); ``earlier_turn`` shows it as the model's own
    answer to the same request one turn before (user: request, assistant: demonstration, user:
    ``teacher_template``), which a small model follows far more readily (SmolLM2-135M: the
    correct tool call's log-probability -9.9 -> -2.8, its greedy answer right 0/6 -> 3/6).
    ``demonstration_metrics`` logs, each step, the log-probability of each prompt's
    demonstration under the student and under the teacher (``sdft/demo_logprob_*``) and of its
    first token (``sdft/demo_first_prob_*``): whether the teacher knows the skill better than
    the student, and by how much, measured rather than guessed.
    """

    dataset: Any = None
    prompt_key: str = "prompt"
    demonstration_key: str = "demonstration"
    teacher: str = "ema"
    ema_rate: float = 0.05
    teacher_template: str = DEFAULT_TEACHER_TEMPLATE
    loss: Any = "sdft"
    sampler: Any = "completion"
    renderer: Any = "auto"
    prompts_per_step: int = 16
    samples_per_prompt: int = 1
    max_tokens: int = 32
    skip_first_tokens: int = 0
    recompute_logprobs: str = "auto"  # auto | always | never
    demonstration_placement: str = "prompt"  # prompt | earlier_turn
    demonstration_metrics: bool = False

    label = "sdft"
    summary_keys = ("loss", "sdft/distill_loss", "sdft/reverse_kl_sampled")
    postfix = {"loss": "loss", "kl": "sdft/reverse_kl_sampled"}

    def teacher_weights(self, stage_id: str = "") -> TeacherWeights:
        """The teacher's weights and snapshot lifecycle (:class:`tempering.training.teacher.TeacherWeights`)."""
        return TeacherWeights(self.teacher, self.ema_rate, f"{stage_id}/sdft_teacher")

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The stage's and the sampling keys' checks, then SDFT's keys, at their keys."""
        yield from super().check_config(config)
        c = config
        yield from TeacherWeights(c["teacher"], c["ema_rate"]).problems()
        if c["recompute_logprobs"] not in ("auto", "always", "never"):
            yield Problem("recompute_logprobs", f"use auto, always or never (got '{c['recompute_logprobs']}')")
        for key in ("prompts_per_step", "samples_per_prompt"):
            if c[key] < 1:
                yield Problem(key, f"must be >= 1, got {c[key]}")
        placement = c["demonstration_placement"]
        if placement not in PLACEMENTS:
            yield Problem("demonstration_placement", f"use one of {', '.join(PLACEMENTS)} (got '{placement}')")
        if placement == "earlier_turn" and c["renderer"] == "raw":
            yield Problem(
                "demonstration_placement",
                "earlier_turn needs chat turns, and renderer: raw has none; use renderer: auto "
                "(a chat model) or demonstration_placement: prompt",
            )
        if c["skip_first_tokens"] < 0:
            yield Problem("skip_first_tokens", f"must be >= 0, got {c['skip_first_tokens']}")
        if c["dataset"] is None:
            yield Problem("dataset", f"SDFT needs a dataset with '{c['prompt_key']}' and '{c['demonstration_key']}'")
        try:
            teacher_prompt(c["teacher_template"], "p", "d")
        except (KeyError, IndexError, ValueError) as err:
            yield Problem("teacher_template", f"bad placeholder {err}; use {{prompt}} and {{demonstration}}")

    def validate(self, ctx: RunContext) -> None:
        check_stage(
            ctx, self, columns={"": {self.prompt_key: "prompt_key", self.demonstration_key: "demonstration_key"}}
        )

    def required_capabilities(self) -> list[Requirement]:
        """A ``stage_start`` or ``ema`` teacher is a weight snapshot; ``ema`` moves it."""
        return [*super().required_capabilities(), *self.teacher_weights().requirements("teacher")]

    def loss_capabilities(self, loss: Loss) -> list[Requirement]:
        """What the loss's teacher input asks of the backend (:func:`tempering.training.teacher.teacher_needs`):
        the teacher's top-k or full distributions, and the student's logits in the loss."""
        kind = teacher_needs(loss).input
        if kind == "token":
            return []
        spec = self.loss
        written = isinstance(spec, Mapping) and "mode" in spec  # the key the user wrote, else the loss as a whole
        key, what = ("loss.mode", f"'{spec['mode']}'") if written else ("loss", f"the {type(loss).__name__} loss")
        dists = {"full": (FullDistributions, "full"), "topk": (Distributions, "top-k")}[kind]
        return [
            Requirement(
                dists[0],
                key,
                f"{what} needs the teacher's {dists[1]} next-token distributions, which this "
                "backend does not return; use mode: sampled_token",
            ),
            Requirement(
                LossLogits,
                key,
                f"{what} trains on the student's logits, which this backend does not give a loss "
                "(it returns per-token logprobs only); use mode: sampled_token (Tinker's importance_sampling)",
            ),
        ]

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """Each student row's tokens and weights, the sampler's logprobs and the teacher's
        values the loss asks for (:func:`tempering.training.teacher.teacher_needs`); the sampled-token
        advantages for the ``token`` input (the loss contract's names)."""
        needs = teacher_needs(loss)
        return ROW_INPUTS | {SAMPLER_LOGPROBS} | needs.keys | ({ADVANTAGES} if needs.input == "token" else set())

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        path = ctx.path
        self.loss_fn = ctx.build("loss", self.loss, "loss")
        self.needs = teacher_needs(self.loss_fn)
        self.kind = self.needs.input
        examples = load_examples(ctx, self.dataset, "dataset")
        for key in (self.prompt_key, self.demonstration_key):
            if examples and key not in examples[0]:
                raise ConfigError(f"rows have no '{key}' (keys: {sorted(examples[0])})", path)
        start = int(state.get("step", 0))
        self.backend = backend = ctx.backend
        self.weights = self.teacher_weights(ctx.stage_id)
        self.snap = self.weights.name
        self.weights.start(backend, resuming=start > 0, path=path)  # capabilities: checked by validate
        self.teacher_kwargs = self.weights.kwargs
        self.stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))
        self.sampling = self.sampling_params()
        self.recompute = should_recompute(self.recompute_logprobs, self.sampling)
        self.aggregation, self.topk = self.needs.aggregation, self.needs.topk
        # the one rollout path; unscored: the teacher is the signal
        self.student_sampler = build_sampler(ctx, self.sampler, "sampler", None, self.renderer)

    def loop_state(self) -> dict[str, Any]:
        return {"position": self.stream.position}

    def train_step(self, ctx: RunContext, step: int) -> dict[str, Any]:
        backend = self.backend
        t0 = time.perf_counter()
        batch, teacher_batch, info = self.sample_batch(backend, self.stream.take(self.prompts_per_step), self.sampling)
        t_sample = time.perf_counter() - t0
        if self.recompute:
            recompute_sampler_logprobs(backend, batch)
        self.attach_teacher(backend, batch, teacher_batch, self.kind, self.topk, self.teacher_kwargs)
        t_teacher = time.perf_counter() - t0 - t_sample
        info.update(self._sampled_kl(batch))
        if self.kind == "token":
            norm = fold_normaliser([d.weights for d in batch.data], self.aggregation)
            for d, n in zip(batch.data, norm):
                q, t = d.sampler_logprobs or [], d.extra[TEACHER_TOKEN_LOGPROBS]
                d.advantages = [-(qi - ti) * ni for qi, ti, ni in zip(q, t, n)]
        fb = backend.forward_backward(batch, self.loss_fn)
        op = backend.optim_step(self.adam(step))
        # FIFO: the EMA moves after the step and before any checkpoint of it
        ema = self.weights.after_step(backend, step)
        metrics = {**info, **fb.result(), **op.result(), "time/sample": t_sample, "time/teacher": t_teacher}
        if ema is not None:
            ema.result()
        return metrics

    def teardown(self, ctx: RunContext, finished: bool) -> None:
        if finished and "backend" in vars(self):  # setup ran
            self.weights.finish(self.backend)

    def eval_sampler(self) -> Any:
        return None

    # ------------------------------------------------------------------ batches
    def sample_batch(
        self, backend: Backend, rows: list[dict[str, Any]], sampling: SamplingParams
    ) -> tuple[Batch, Batch, dict[str, float]]:
        """Roll the students out through the stage's sampler (single-turn completions or
        multi-turn episodes); return the student batch (weights = loss mask, sampler logprobs)
        and the teacher batch (the demonstration-conditioned prompt + the same continuation)."""
        if getattr(self, "student_sampler", None) is None:  # used outside a run (tests, notebooks)
            self.student_sampler = completion_sampler(backend.tokenizer, model_renderer(backend), None)
        rollout = collect(
            self.student_sampler, backend, [self.student_example(r) for r in rows], self.samples_per_prompt, sampling
        )
        triples = [
            (row, self.teacher_prefix(backend, row, s), s) for row, g in zip(rows, rollout.groups) for s in g.samples
        ]
        student, teacher, info = self.build_pairs([(t, s) for _, t, s in triples])
        if self.demonstration_metrics:
            info.update(self.demonstration_logprobs(backend, triples))
        return student, teacher, info

    def student_example(self, row: dict[str, Any]) -> dict[str, Any]:
        """What the student sees: the row with its prompt under ``prompt`` (a ``messages`` row,
        or an environment, builds its own first messages)."""
        example = dict(row)
        if self.prompt_key in row:
            example["prompt"] = str(row[self.prompt_key])
        return example

    def teacher_prefix(self, backend: Backend | None, row: dict[str, Any], sample: Any) -> list[int]:
        """The teacher's prompt: the student's first prompt with the demonstration put in by
        ``teacher_template`` -- around the prompt text (raw, or a user turn where the student's
        was one), or around the last user message of a chat (the episode's first messages, for
        a trajectory), rendered by the same renderer (:func:`tempering.training.teacher.reprompted_prefix`)."""
        demo = str(row[self.demonstration_key])
        tokenizer = backend.tokenizer if backend is not None else None

        def earlier(text: str) -> list[dict[str, Any]]:
            return [{"role": "user", "content": text}, {"role": "assistant", "content": demo}]

        return shared.reprompted_prefix(
            self.student_sampler.context,
            tokenizer,
            sample,
            lambda text: teacher_prompt(self.teacher_template, text, demo),
            earlier if self.demonstration_placement == "earlier_turn" else None,
        )

    def demonstration_logprobs(
        self, backend: Backend, triples: list[tuple[dict[str, Any], list[int], Any]]
    ) -> dict[str, float]:
        """How likely each prompt's demonstration is under the student (its own prompt) and
        under the teacher (its prompt with the demonstration shown): the mean over prompts of
        the demonstration's summed log-probability and of its first token's probability. A
        teacher no more likely to give the demonstration than the student has nothing to
        teach; a first token the teacher does not favour means the student's answers start
        off the skill and the teacher then scores the wrong continuation."""
        student, teacher, lengths, seen = [], [], [], set()
        for row, t_prefix, sample in triples:
            if id(row) in seen:  # one per prompt, not per sample
                continue
            seen.add(id(row))
            demo = backend.tokenizer.encode(str(row[self.demonstration_key]), add_special_tokens=False)
            s_prefix = list(sample.segments()[0].tokens[: shared.prompt_start(sample)])
            student.append(demonstration_row(s_prefix, demo))
            teacher.append(demonstration_row(t_prefix, demo))
            lengths.append(len(demo))
        s_lp = backend.logprobs(Batch(student)).result()
        t_lp = backend.logprobs(Batch(teacher), **self.teacher_kwargs).result()
        out: dict[str, float] = {}
        for who, values in (("student", s_lp), ("teacher", t_lp)):
            out[f"sdft/demo_logprob_{who}"] = sum(sum(v[-n:]) for v, n in zip(values, lengths)) / len(lengths)
            out[f"sdft/demo_first_prob_{who}"] = sum(math.exp(v[-n]) for v, n in zip(values, lengths)) / len(lengths)
        return out

    def build_batches(
        self, teacher_prompts: list[list[int]], groups: list[list[Any]]
    ) -> tuple[Batch, Batch, dict[str, float]]:
        """:meth:`build_pairs` for single-turn completions: ``groups[i]`` are the completions
        of the prompt whose teacher prompt is ``teacher_prompts[i]``."""
        from tempering.types import Sample

        return self.build_pairs([(t, Sample({}, c)) for t, group in zip(teacher_prompts, groups) for c in group])

    def build_pairs(self, pairs: list[tuple[list[int], Any]]) -> tuple[Batch, Batch, dict[str, float]]:
        """Student rows and teacher rows, aligned on the continuation after the first prompt.

        The student row is a sample's training row (single turn: prompt + completion; a
        trajectory: its first row, observations inside at weight 0), with the first
        ``skip_first_tokens`` sampled tokens masked; the teacher row is the teacher prefix +
        the same continuation, so the last ``completion_len`` positions of both predict the
        same tokens. A trajectory's later rows (after a renderer rewrote history) do not start
        with the student's prompt and are left out (``sdft/rows_skipped``).
        """
        student, teacher = [], []
        lengths, stops, skipped = [], [], 0
        for t_prefix, sample in pairs:
            segments = sample.segments()
            skipped += len(segments) - 1
            start = shared.prompt_start(sample)
            seg = segments[0]
            if not shared.distillable(seg, start):
                continue
            d = seg.to_datum(weight=1.0, completion_len=len(seg.tokens) - start)
            first_sampled = [i for i, w in enumerate(d.weights) if w][: self.skip_first_tokens]
            for i in first_sampled:
                d.weights[i] = 0.0
            student.append(d)
            teacher.append(shared.teacher_row(t_prefix, seg, start))
            lengths.append(sample.num_generated)
            stops.append(sample.completion.stop_reason == "stop")
        if not student:
            raise RuntimeError("SDFT: every sampled completion was empty; raise max_tokens")
        info = {
            "completion/mean_len": sum(lengths) / len(lengths),
            "completion/stop_frac": sum(stops) / len(stops),
            "sdft/rows_skipped": float(skipped),
        }
        return Batch(student), Batch(teacher), info

    def attach_teacher(
        self,
        backend: Backend,
        batch: Batch,
        teacher_batch: Batch,
        kind: str,
        topk: int,
        teacher_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """Score the teacher rows and put the values, aligned to the student's positions, in
        each student row's ``extra`` (:func:`tempering.training.teacher.attach_teacher`)."""
        shared.attach_teacher(backend, batch, teacher_batch, kind, topk, teacher_kwargs)

    @staticmethod
    def _sampled_kl(batch: Batch) -> dict[str, float]:
        """Token mean of ``q - lp_teacher`` over loss tokens: a one-sample estimate of the
        per-token reverse KL(student || teacher) when sampling at temperature 1."""
        diffs = [
            q - t
            for d in batch.data
            for q, t, w in zip(d.sampler_logprobs or [], d.extra[TEACHER_TOKEN_LOGPROBS], d.weights)
            if w and not math.isnan(t)
        ]
        return {"sdft/reverse_kl_sampled": sum(diffs) / len(diffs) if diffs else 0.0}


def demonstration_row(prefix: list[int], demo: list[int]) -> Datum:
    """``prefix`` + ``demo`` as a row scored on the demonstration's tokens only."""
    tokens = prefix + demo
    return Datum(tokens[:-1], tokens[1:], [0.0] * (len(prefix) - 1) + [1.0] * len(demo))


def traj_ok(segment: Any, start: int) -> bool:
    """A row can be distilled when its first ``start`` tokens are the student's prompt (no
    sampled token among them) and something was sampled after (:func:`tempering.training.teacher.distillable`)."""
    return shared.distillable(segment, start)
