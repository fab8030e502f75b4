"""DPO stage: preference pairs -> one optimizer step per batch of pairs.

A pair is single-turn -- ``prompt`` (or ``messages``) and two completion texts -- or
multi-turn: ``messages`` (the shared history), ``tools`` and two *continuations*, each a list
of messages starting with an assistant turn (or one assistant message), e.g. the same search
agent's preferred and rejected next tool call::

    {"messages": [{"role": "user", "content": "country of kam olo?"}, ...],
     "tools": [{"type": "function", "function": {"name": "search", ...}}, ...],
     "chosen": [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "search",
                 "arguments": "{\"query\": \"tes\"}"}}]}],
     "rejected": [{"role": "assistant", "content": "", "tool_calls": [...]}]}

A single-turn pair with a text ``prompt`` is one user turn and two assistant turns when the
stage has a chat renderer (:func:`tempering.rollouts.renderer.chat_text_prompts`: as RL samples that
prompt), else raw text with each completion followed by EOS (``renderer: raw``).
A multi-turn side is rendered by the stage's ``renderer`` (``auto``: the model's chat format)
as history + continuation, tokenized exactly as an episode of those turns would be, with
weight on the continuation's assistant tokens only: the shared history's assistant turns are
context (``"weight": 0``), tool results and user turns never train. Where the format rewrites
history inside a continuation, a side is several rows; the loss sums a side over its rows.

Reference policy (``reference`` x ``reference_model``):

* ``reference: live`` (default) scores each batch with the reference at every step;
  ``precomputed`` scores the whole dataset once at stage start (one forward per row, no
  reference forward during training), caches it in ``<output_dir>/dpo/<stage>_reference.json``
  and reloads that cache when the stage resumes mid-way.
* ``reference_model: stage_start`` (default) is the policy as it was when this stage began: a
  weight snapshot (saved in checkpoints) with ``live``, the policy's own scores at the start with
  ``precomputed``. That is TRL's reference -- the model handed to the trainer -- translated to
  staged recipes: after an SFT stage it is the SFT model. ``base`` is the backend's reference
  instead: the LoRA adapter disabled, or (full fine-tuning) the frozen initial weights. When DPO
  is the first stage the two are the same model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from tempering.errors import ConfigError
from tempering.interfaces import Loss, RunContext, Tokenizer, WeightSnapshots, model_renderer
from tempering.loss_contract import DPO_SLOT, REF_LOGPROBS, ROW_INPUTS
from tempering.rollouts.chat import Message, check_messages
from tempering.rollouts.data import ExampleStream, encode_completion, encode_prompt, load_examples, user_turn
from tempering.rollouts.renderer import Renderer, build_renderer, chat_text_prompts
from tempering.rollouts.trajectory import as_context
from tempering.schema import Problem
from tempering.training.stage import Requirement, Stage, check_stage
from tempering.types import Batch, Datum

REFERENCES = ("live", "precomputed")
REFERENCE_MODELS = ("base", "stage_start")
_REF_C, _REF_R = "_ref_chosen", "_ref_rejected"


SLOT = DPO_SLOT  # Datum.extra: pair i's chosen rows hold 2i, its rejected rows 2i + 1 (multi-row sides)


def completion_datum(prompt: list[int], completion: list[int], **extra: object) -> Datum:
    """A row that scores ``completion`` after ``prompt``: weight 1 on completion targets."""
    tokens = prompt + completion
    return Datum(tokens[:-1], tokens[1:], [0.0] * (len(prompt) - 1) + [1.0] * len(completion), extra=dict(extra))


def is_multi_turn(row: Mapping[str, Any], key: str) -> bool:
    """Whether ``row[key]`` is a continuation (messages) rather than a completion text."""
    return isinstance(row.get(key), (list, tuple, Mapping))


def continuation(value: object, where: str) -> list[Message]:
    """A side of a multi-turn pair as messages: a list starting with an assistant turn."""
    messages = check_messages([value] if isinstance(value, Mapping) else value, where)
    if not messages or messages[0].get("role") != "assistant":
        raise ValueError(
            f"{where}: a continuation starts with an assistant message (the turn the pair prefers or rejects)"
        )
    return messages


def turn_rows(renderer: Renderer, history: list[Message], side: list[Message], tools: Any) -> list[Datum]:
    """The rows of one side: ``history`` + ``side`` rendered for training, weight on the
    side's assistant tokens only (the history's assistant turns are context)."""
    rows = [r for r in renderer.render_training([*as_context(history), *side], tools) if any(r.weights)]
    return [r.segment().to_datum(weight=1.0, logprobs=False) for r in rows]


@dataclass
class DPO(Stage):
    """Direct preference optimisation on ``dataset`` rows with ``prompt``/``chosen``/``rejected``.

    ``batch_size`` counts pairs (the backend sees ``2 x batch_size`` rows, chosen and rejected
    interleaved, see :mod:`tempering.algorithms.dpo.loss`). ``loss`` is a registered loss
    (default ``dpo``: ``{name: dpo, loss_type: sigmoid, beta: 0.1}``).
    """

    dataset: Any = field(default_factory=lambda: {"name": "synthetic_preferences"})
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    batch_size: int = 16
    loss: Any = "dpo"
    reference: str = "live"
    reference_model: str = "stage_start"
    precompute_batch_size: int = 64
    renderer: Any = "auto"

    label = "dpo"
    summary_keys = ("loss",)
    summary_prefixes = ("eval/", "rewards/")
    postfix = {"loss": "loss", "margin": "rewards/margins"}

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The stage's checks, then the reference's choices and the batch sizes."""
        yield from super().check_config(config)
        c = config
        if c["reference"] not in REFERENCES:
            yield Problem("reference", f"use one of {', '.join(REFERENCES)} (got '{c['reference']}')")
        if c["reference_model"] not in REFERENCE_MODELS:
            yield Problem("reference_model", f"use one of {', '.join(REFERENCE_MODELS)} (got '{c['reference_model']}')")
        if c["batch_size"] < 1:
            yield Problem("batch_size", f"must be >= 1 (pairs per step), got {c['batch_size']}")
        if c["precompute_batch_size"] < 1:
            yield Problem("precompute_batch_size", f"must be >= 1, got {c['precompute_batch_size']}")

    def validate(self, ctx: RunContext) -> None:
        pair = {self.chosen_key: "chosen_key", self.rejected_key: "rejected_key"}
        columns = {"": {self.prompt_key: "prompt_key", **pair}}
        if self.prompt_key == "prompt":  # a chat prompt instead
            columns = {"messages": pair, **columns}
        check_stage(ctx, self, columns=columns)

    def required_capabilities(self) -> list[Requirement]:
        """A live stage-start reference is a weight snapshot."""
        needs = super().required_capabilities()
        if self.reference == "live" and self.reference_model == "stage_start":
            needs.append(
                Requirement(
                    WeightSnapshots,
                    "reference_model",
                    "'stage_start' with reference 'live' needs a backend with weight snapshots (e.g. "
                    "local); use reference: precomputed, or reference_model: base",
                )
            )
        return needs

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """Interleaved pairs' rows, the reference policy's logprobs and, for sides of several
        rows, each row's slot (the loss contract's names)."""
        return ROW_INPUTS | {REF_LOGPROBS, DPO_SLOT}

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        path = ctx.path
        self.loss_fn = ctx.build("loss", self.loss, "loss")
        examples = load_examples(ctx, self.dataset, "dataset")
        for key_name in ("prompt_key", "chosen_key", "rejected_key"):
            key = getattr(self, key_name)
            if examples and key not in examples[0] and not (key == "prompt" and "messages" in examples[0]):
                raise ConfigError(f"rows have no '{key}' (keys: {sorted(examples[0])})", f"{path}.{key_name}")
        start = int(state.get("step", 0))
        self.backend = backend = ctx.backend
        multi = any(is_multi_turn(r, self.chosen_key) or is_multi_turn(r, self.rejected_key) for r in examples)
        self._chat_text = chat_text_prompts(self.renderer, backend.tokenizer, model_renderer(backend))
        self._renderer = build_renderer(ctx, self.renderer) if multi or self._chat_text else None
        self.snap = f"{ctx.stage_id}/dpo_reference"
        self.live_snapshot = self.reference == "live" and self.reference_model == "stage_start"
        if self.live_snapshot:  # WeightSnapshots: required_capabilities, checked by validate
            assert isinstance(backend, WeightSnapshots)
            if start == 0:
                backend.snapshot(self.snap).result()
            elif self.snap not in backend.snapshot_names():
                raise RuntimeError(f"{path}: resuming, but the checkpoint has no '{self.snap}' snapshot")
        if self.reference == "precomputed":
            self._precompute(ctx, examples, resuming=bool(state))
        self.stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))

    def loop_state(self) -> dict[str, Any]:
        return {"position": self.stream.position}

    def train_step(self, ctx: RunContext, step: int) -> dict[str, Any]:
        batch = self.build_batch(self.backend.tokenizer, self.stream.take(self.batch_size))
        if self.reference == "live":
            kwargs = {"weights": self.snap} if self.live_snapshot else {"reference": True}
            for d, lp in zip(batch.data, self.backend.logprobs(batch, **kwargs).result()):
                d.extra[REF_LOGPROBS] = list(lp)
        fb = self.backend.forward_backward(batch, self.loss_fn)
        op = self.backend.optim_step(self.adam(step))
        return {**fb.result(), **op.result()}

    def teardown(self, ctx: RunContext, finished: bool) -> None:
        if getattr(self, "live_snapshot", False) and finished:  # kept while the stage may still resume
            cast(WeightSnapshots, self.backend).drop_snapshot(self.snap).result()

    def eval_sampler(self) -> Any:
        return None

    # ------------------------------------------------------------------ batches
    def encode(self, tokenizer: Tokenizer, row: dict[str, Any]) -> tuple[list[int], list[int], list[int]]:
        """A single-turn pair's tokens: prompt, chosen completion, rejected completion."""
        prompt = encode_prompt(tokenizer, self.prompt_example(row))
        chosen = encode_completion(tokenizer, str(row[self.chosen_key]))
        rejected = encode_completion(tokenizer, str(row[self.rejected_key]))
        return prompt, chosen, rejected

    def prompt_example(self, row: dict[str, Any]) -> dict[str, Any]:
        """The row with its prompt under ``prompt`` (``prompt_key`` may name another column)."""
        example = dict(row)
        if self.prompt_key != "prompt" and self.prompt_key in row:
            example["prompt"] = row[self.prompt_key]
        return example

    def sides(
        self, tokenizer: Tokenizer, row: dict[str, Any], renderer: Renderer | None = None
    ) -> tuple[list[Datum], list[Datum]]:
        """The rows of a pair's chosen and rejected side (one each for a single-turn pair). A
        text prompt with a chat renderer (``_chat_text``, set by :meth:`setup`) is one user turn
        and each completion one assistant turn, as RL samples them."""
        multi = is_multi_turn(row, self.chosen_key) or is_multi_turn(row, self.rejected_key)
        chat_text = not multi and getattr(self, "_chat_text", False) and "messages" not in row
        if not (multi or chat_text):
            prompt, chosen, rejected = self.encode(tokenizer, row)
            return [completion_datum(prompt, chosen)], [completion_datum(prompt, rejected)]
        renderer = renderer if renderer is not None else getattr(self, "_renderer", None)
        if renderer is None:
            raise ValueError("a multi-turn DPO pair needs the stage's renderer (build_batch(..., renderer=...))")
        if multi and "messages" not in row:
            raise ValueError(f"a multi-turn pair needs 'messages', the shared history (keys: {sorted(row)})")
        history = user_turn(self.prompt_example(row)) if chat_text else check_messages(row["messages"], "pair messages")
        out = []
        for key in (self.chosen_key, self.rejected_key):
            side = (
                [{"role": "assistant", "content": str(row[key])}]
                if chat_text
                else continuation(row[key], f"pair {key}")
            )
            data = turn_rows(renderer, history, side, row.get("tools"))
            if not data:
                raise ValueError(f"pair {key}: no assistant tokens to score")
            out.append(data)
        return out[0], out[1]

    def build_batch(self, tokenizer: Tokenizer, rows: list[dict[str, Any]], renderer: Renderer | None = None) -> Batch:
        """Interleaved rows: ``2i`` = pair i's chosen, ``2i + 1`` its rejected, when every side
        is one row; otherwise each side's rows in turn, each carrying its slot (``extra["dpo_slot"]``:
        ``2i`` or ``2i + 1``) so the loss sums a side over its rows. Precomputed reference
        logprobs (if any) ride along as ``extra["ref_logprobs"]``; ``meta["slots"]`` is each
        row's slot."""
        data, slots = [], []
        for i, row in enumerate(rows):
            for side, (datums, ref_key) in enumerate(zip(self.sides(tokenizer, row, renderer), (_REF_C, _REF_R))):
                refs = _ref_rows(row.get(ref_key))
                if refs is not None and len(refs) != len(datums):
                    raise RuntimeError(f"pair {i}: {len(refs)} cached reference rows for {len(datums)} rows")
                for j, d in enumerate(datums):
                    if refs is not None:
                        d.extra[REF_LOGPROBS] = list(refs[j])
                    data.append(d)
                    slots.append(2 * i + side)
        if len(data) != 2 * len(rows):
            for d, slot in zip(data, slots):
                d.extra[SLOT] = [float(slot)] * len(d.target_tokens)
        return Batch(data, meta={"num_pairs": len(rows), "slots": slots})

    # ------------------------------------------------------------------ precomputed reference
    def _cache_path(self, ctx: RunContext) -> str:
        return os.path.join(ctx.output_dir, "dpo", f"{ctx.stage_id.replace('/', '_')}_reference.json")

    def _precompute(self, ctx: RunContext, examples: list[dict[str, Any]], resuming: bool) -> None:
        """Reference logprobs of every example's chosen and rejected rows, stored on the rows.

        A resumed stage reads them back from the cache written at its start: with
        ``reference_model: stage_start`` the policy has moved since, so recomputing would
        give a different reference than the uninterrupted run used.
        """
        cache = self._cache_path(ctx)
        if resuming and os.path.exists(cache):
            with open(cache, encoding="utf-8") as fh:
                refs = json.load(fh)
            if len(refs) != len(examples):
                raise RuntimeError(f"{cache}: {len(refs)} cached rows, the dataset has {len(examples)}")
        else:
            if resuming and self.reference_model == "stage_start":
                raise RuntimeError(f"{ctx.path}: resuming, but the precomputed reference cache {cache} is missing")
            refs = []
            tok = ctx.backend.tokenizer
            kwargs = {"reference": True} if self.reference_model == "base" else {}
            for start in range(0, len(examples), self.precompute_batch_size):
                chunk = examples[start : start + self.precompute_batch_size]
                batch = self.build_batch(tok, chunk)
                lps = ctx.backend.logprobs(batch, **kwargs).result()
                pairs: list[list[list[list[float]]]] = [[[], []] for _ in chunk]
                for slot, lp in zip(batch.meta["slots"], lps):
                    pairs[slot // 2][slot % 2].append(list(lp))
                refs += [[_flat(c), _flat(r)] for c, r in pairs]
            os.makedirs(os.path.dirname(cache), exist_ok=True)
            tmp = cache + ".tmp"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(refs, fh)
            os.replace(tmp, cache)
        for row, (c, r) in zip(examples, refs):
            row[_REF_C], row[_REF_R] = c, r


def _flat(rows: list[list[float]]) -> Any:
    """A side's reference logprobs as cached: one row's list, or a list of rows."""
    return rows[0] if len(rows) == 1 else rows


def _ref_rows(value: Any) -> list[list[float]] | None:
    """Cached reference logprobs of a side as a list of rows (see :func:`_flat`)."""
    if value is None:
        return None
    value = list(value)
    return value if value and isinstance(value[0], (list, tuple)) else [value]
