"""Feeding examples to a stage: a seeded, resumable stream, and prompt/answer encoding."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tempering.interfaces import ChatTemplateTokenizer, Tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import BuildContext


class ExampleStream:
    """Endless epochs over ``examples``, each reshuffled with ``seed + epoch``.

    The only state is ``position`` (examples handed out so far), so a resumed stage that
    restores it hands out exactly the examples an uninterrupted run would have.
    """

    def __init__(self, examples: Sequence[Mapping[str, Any]], seed: int = 0, shuffle: bool = True, position: int = 0):
        if not examples:
            raise ValueError("the dataset is empty: check its name, path or split")
        self.examples = list(examples)
        self.seed, self.shuffle, self.position = seed, shuffle, position
        self._epoch, self._order = -1, list(range(len(self.examples)))

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            self._order = list(range(len(self.examples)))
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(self._order)
            self._epoch = epoch
        return self._order

    def take(self, n: int) -> list[dict[str, Any]]:
        out = []
        for _ in range(n):
            epoch, idx = divmod(self.position, len(self.examples))
            out.append(dict(self.examples[self._order_for(epoch)[idx]]))
            self.position += 1
        return out


def encode_prompt(tokenizer: Tokenizer, example: Mapping[str, Any]) -> list[int]:
    """Token ids of an example's prompt: ``messages`` through the chat template when the
    tokenizer has one, else ``prompt`` text with the tokenizer's special tokens (BOS)."""
    if "messages" in example and isinstance(tokenizer, ChatTemplateTokenizer) and tokenizer.chat_template:
        ids = tokenizer.apply_chat_template(list(example["messages"]), add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
    return list(tokenizer(prompt_text(example), add_special_tokens=True)["input_ids"])


def prompt_text(example: Mapping[str, Any]) -> str:
    """An example's ``prompt`` text (a ``KeyError`` naming the columns when it has none)."""
    if "prompt" not in example:
        raise KeyError(f"the example has no 'prompt' (keys: {sorted(example)}); rename your column to 'prompt'")
    return str(example["prompt"])


def user_turn(example: Mapping[str, Any]) -> list[dict[str, Any]]:
    """An example's ``prompt`` text as the one user message a chat renderer renders (what a
    stage with a chat renderer does with a text prompt: :func:`tempering.rollouts.renderer.chat_text_prompts`)."""
    return [{"role": "user", "content": prompt_text(example)}]


def encode_completion(tokenizer: Tokenizer, text: str, add_eos: bool = True) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if add_eos and tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def load_examples(ctx: BuildContext, spec: object, key: str) -> list[dict[str, Any]]:
    """A dataset spec (name, mapping, or an already-built list of dicts) -> list of examples."""
    if isinstance(spec, list):
        return [dict(x) for x in spec]
    data = ctx.build("dataset", spec, key)
    return [dict(x) for x in data]
