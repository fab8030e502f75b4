"""SFT stage: teacher-forced cross-entropy on (prompt, answer) rows or chat transcripts.

A row is either ``prompt`` text plus its answer (``completion_key``) -- one user and one
assistant turn when the stage has a chat renderer (:func:`tempering.rollouts.renderer.chat_text_prompts`),
else raw text -- or a ``messages`` transcript (with optional ``tools``). The stage's renderer
turns a conversation into training rows with weight on the assistant's tokens only -- tool
calls included, tool results and user turns excluded -- tokenized exactly as a rollout of the
same conversation would be (:func:`tempering.rollouts.trajectory.training_rows`). The loss is the token
mean over the batch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tempering.errors import ConfigError
from tempering.interfaces import Loss, model_renderer
from tempering.loss_contract import ROW_INPUTS
from tempering.rollouts.chat import check_messages
from tempering.rollouts.data import ExampleStream, encode_completion, encode_prompt, load_examples, user_turn
from tempering.rollouts.renderer import build_renderer, chat_text_prompts
from tempering.schema import Problem
from tempering.training.stage import Stage, check_stage
from tempering.types import Batch, Segment

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import RunContext


@dataclass
class SFT(Stage):
    """Train on ``dataset`` rows: ``prompt`` -> ``completion_key``, or ``messages`` (+ ``tools``)
    rendered by ``renderer`` (``auto``: the model's chat format). With a chat renderer a text
    ``prompt`` row is a user turn answered by an assistant turn, as RL samples it
    (``renderer: raw``: the raw text followed by the answer and EOS)."""

    dataset: Any = field(default_factory=lambda: {"name": "arithmetic"})
    completion_key: str = "answer"
    renderer: Any = "auto"
    batch_size: int = 64
    loss: Any = "cross_entropy"
    steps: int = 100
    optimizer: Any = field(default_factory=lambda: {"learning_rate": 1e-3})

    label = "sft"
    summary_keys = ("loss", "nll")

    @classmethod
    def check_config(cls, config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The stage's checks, then the batch size."""
        yield from super().check_config(config)
        if config["batch_size"] < 1:
            yield Problem("batch_size", f"must be >= 1, got {config['batch_size']}")

    def validate(self, ctx: RunContext) -> None:
        check_stage(ctx, self, columns={"prompt": {self.completion_key: "completion_key"}, "messages": {}})

    def batch_inputs(self, loss: Loss) -> frozenset[str]:
        """Rows and their weights (the loss contract's names): nothing sampled, no reference."""
        return ROW_INPUTS

    def setup(self, ctx: RunContext, state: Mapping[str, Any]) -> None:
        self.loss_fn = ctx.build("loss", self.loss, "loss")
        examples = load_examples(ctx, self.dataset, "dataset")
        first = examples[0] if examples else {}
        if "messages" not in first and self.completion_key not in first:
            raise ConfigError(
                f"rows have no '{self.completion_key}' and no 'messages' transcript (keys: {sorted(first)})",
                f"{ctx.path}.completion_key",
            )
        self.stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))
        self.backend = ctx.backend
        # A text prompt is a user turn (its answer the assistant's) where RL would render it so.
        self._chat_text = chat_text_prompts(self.renderer, ctx.backend.tokenizer, model_renderer(ctx.backend))
        self._renderer = build_renderer(ctx, self.renderer) if "messages" in first or self._chat_text else None

    def rows(self, example: Mapping[str, Any]) -> list[Segment]:
        """The training rows of one example (a transcript may give several)."""
        if "messages" in example:
            if self._renderer is None:
                raise ConfigError("a row has 'messages' but the first row did not: mix formats in separate stages")
            messages = check_messages(example["messages"], "dataset row messages")
            return [r.segment() for r in self._renderer.render_training(messages, example.get("tools"))]
        if self._chat_text:
            assert self._renderer is not None  # setup builds one for chat-text prompts
            answer = {"role": "assistant", "content": str(example[self.completion_key])}
            return [
                r.segment() for r in self._renderer.render_training([*user_turn(example), answer], example.get("tools"))
            ]
        tok = self.backend.tokenizer
        prompt = encode_prompt(tok, example)
        seg = Segment(prompt, [0.0] * len(prompt), [0.0] * len(prompt))
        seg.extend(encode_completion(tok, str(example[self.completion_key])), 1.0)
        return [seg]

    def loop_state(self) -> dict[str, Any]:
        return {"position": self.stream.position}

    def train_step(self, ctx: RunContext, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        segments = [seg for row in self.stream.take(self.batch_size) for seg in self.rows(row)]
        n_tokens = sum(seg.num_sampled for seg in segments)
        if n_tokens == 0:
            raise ConfigError(
                "a batch has no tokens to learn (empty answers, or transcripts without assistant turns)",
                f"{ctx.path}.dataset",
            )
        batch = Batch([seg.to_datum(weight=1.0 / n_tokens, logprobs=False) for seg in segments])
        fb = self.backend.forward_backward(batch, self.loss_fn)
        op = self.backend.optim_step(self.adam(step))
        metrics = {**fb.result(), **op.result(), "tokens": n_tokens}
        metrics["tokens_per_s"] = n_tokens / (time.perf_counter() - t0)
        return metrics
