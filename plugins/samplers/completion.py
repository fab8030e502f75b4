"""The ``completion`` sampler: one sampled completion per sample, scored by the stage's reward.

Examples with ``messages`` (and optional ``tools``) go through the stage's renderer, which
also parses the completion, so the reward sees the answer's text without chat markup or
reasoning. So do examples with ``prompt`` text when the stage has a chat renderer: the text is
one user turn (:func:`tempering.rollouts.renderer.chat_text_prompts`; an instruct model given the raw
text would end its turn at once). Otherwise -- ``renderer: raw``, or a model without a chat
format -- the text is encoded as it always was (the tokenizer with its BOS). Either way the
stop tokens are explicit: the renderer's, or the tokenizer's EOS.

The reward gets, with the batch's samples, the :class:`~tempering.interfaces.Policy` that
sampled them (:class:`BatchPolicy`): a reward that samples the policy too (``monitor``: on
counterfactual prompts) samples the same weights, through the same encoding, stops and parsing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.interfaces import SamplingClient
from tempering.plugins.samplers.common import eos_ids, with_stops
from tempering.rollouts.chat import check_messages
from tempering.rollouts.data import encode_prompt, user_turn
from tempering.rollouts.rollout import Rollout, SamplerContext
from tempering.rollouts.scoring import ScoreStats
from tempering.types import Completion, Group, Sample, SamplingParams


@dataclass
class CompletionSampler:
    """Single-turn sampling (no config keys)."""

    context: SamplerContext | None = field(default=None, repr=False)

    @property
    def reward_runner(self) -> Any:
        return self.context.reward if self.context is not None else None

    def _encode(self, example: Mapping[str, Any]) -> tuple[list[int], Any]:
        assert self.context is not None
        if "messages" in example:
            messages = check_messages(example["messages"], "example.messages")
        elif self.context.chat_prompts:
            messages = user_turn(example)
        else:
            return encode_prompt(self.context.tokenizer, example), None
        prompt = self.context.renderer().render_prompt(messages, example.get("tools"))
        return prompt.tokens, prompt

    async def complete(
        self, client: SamplingClient, examples: Sequence[Mapping[str, Any]], num_samples: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """``num_samples`` completions of each example in one ``client.sample`` call, their
        ``text`` parsed by the renderer where the prompt was rendered."""
        assert self.context is not None, "CompletionSampler needs its stage's context"
        encoded = [self._encode(e) for e in examples]
        chat = any(rendered is not None for _, rendered in encoded)
        stops = self.context.renderer().stop() if chat else []
        if any(rendered is None for _, rendered in encoded):
            stops = [*stops, *eos_ids(self.context.tokenizer)]
        completions = await asyncio.wrap_future(
            client.sample([p for p, _ in encoded], num_samples, with_stops(params, stops))
        )
        for (_, rendered), comps in zip(encoded, completions):
            if rendered is not None:
                for c in comps:
                    response = rendered.parse(c.tokens)
                    c.text = response.text if response.parse_error is None else response.raw
        return completions

    async def sample(
        self,
        client: SamplingClient,
        examples: list[dict[str, Any]],
        group_size: int,
        params: SamplingParams,
        first_id: int = 0,
    ) -> Rollout:
        assert self.context is not None, "CompletionSampler needs its stage's context"
        t0 = time.perf_counter()
        completions = await self.complete(client, examples, group_size, params)
        t1 = time.perf_counter()
        groups = []
        for i, (example, comps) in enumerate(zip(examples, completions)):
            samples = [Sample(example=dict(example), completion=c) for c in comps]
            groups.append(Group(dict(example), samples, group_id=first_id + i))
        stats = ScoreStats()
        if self.context.reward is not None:
            policy = BatchPolicy(self, client, params)
            stats = await self.context.reward.ascore((s for g in groups for s in g.samples), policy)
        metrics = {"time/sample": t1 - t0, "time/reward": time.perf_counter() - t1, **stats.metrics}
        return Rollout(groups, stats, metrics)


@dataclass
class BatchPolicy:
    """The :class:`~tempering.interfaces.Policy` of one batch: the client that sampled it, with
    the batch's sampling params as the default, through the sampler's encoding and parsing."""

    sampler: CompletionSampler
    client: SamplingClient
    params: SamplingParams

    async def complete(
        self, examples: Sequence[Mapping[str, Any]], num_samples: int, params: SamplingParams | None = None
    ) -> list[list[Completion]]:
        return await self.sampler.complete(self.client, examples, num_samples, params or self.params)
