"""The ``completion`` sampler: one sampled completion per sample, scored by the stage's reward.

Examples with ``messages`` (and optional ``tools``) go through the stage's renderer, which
also parses the completion, so the reward sees the answer's text without chat markup or
reasoning. So do examples with ``prompt`` text when the stage has a chat renderer: the text is
one user turn (:func:`tempering.rollouts.renderer.chat_text_prompts`; an instruct model given the raw
text would end its turn at once). Otherwise -- ``renderer: raw``, or a model without a chat
format -- the text is encoded as it always was (the tokenizer with its BOS). Either way the
stop tokens are explicit: the renderer's, or the tokenizer's EOS.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from tempering.plugins.samplers.common import eos_ids, with_stops
from tempering.rollouts.chat import check_messages
from tempering.rollouts.data import encode_prompt, user_turn
from tempering.rollouts.rollout import Rollout, SamplerContext
from tempering.rollouts.scoring import ScoreStats
from tempering.types import Group, Sample, SamplingParams


@dataclass
class CompletionSampler:
    """Single-turn sampling (no config keys)."""

    context: SamplerContext | None = field(default=None, repr=False)

    @property
    def reward_runner(self) -> Any:
        return self.context.reward if self.context is not None else None

    def _encode(self, example: dict[str, Any]) -> tuple[list[int], Any]:
        assert self.context is not None
        if "messages" in example:
            messages = check_messages(example["messages"], "example.messages")
        elif self.context.chat_prompts:
            messages = user_turn(example)
        else:
            return encode_prompt(self.context.tokenizer, example), None
        prompt = self.context.renderer().render_prompt(messages, example.get("tools"))
        return prompt.tokens, prompt

    async def sample(
        self, client: Any, examples: list[dict[str, Any]], group_size: int, params: SamplingParams, first_id: int = 0
    ) -> Rollout:
        assert self.context is not None, "CompletionSampler needs its stage's context"
        encoded = [self._encode(e) for e in examples]
        chat = any(rendered is not None for _, rendered in encoded)
        stops = self.context.renderer().stop() if chat else []
        if any(rendered is None for _, rendered in encoded):
            stops = [*stops, *eos_ids(self.context.tokenizer)]
        params = with_stops(params, stops)
        t0 = time.perf_counter()
        completions = await asyncio.wrap_future(client.sample([p for p, _ in encoded], group_size, params))
        t1 = time.perf_counter()
        groups = []
        for i, (example, (_, rendered), comps) in enumerate(zip(examples, encoded, completions)):
            samples = []
            for c in comps:
                if rendered is not None:
                    response = rendered.parse(c.tokens)
                    c.text = response.text if response.parse_error is None else response.raw
                samples.append(Sample(example=dict(example), completion=c))
            groups.append(Group(dict(example), samples, group_id=first_id + i))
        stats = ScoreStats()
        if self.context.reward is not None:
            stats = await self.context.reward.ascore(s for g in groups for s in g.samples)
        return Rollout(groups, stats, {"time/sample": t1 - t0, "time/reward": time.perf_counter() - t1})
