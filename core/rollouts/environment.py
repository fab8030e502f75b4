"""Environments: multi-turn, message-level, async episodes (component kind ``environment``).

The shape is the one the peers converged on (tinker-cookbook's ``MessageEnv``, TRL's
``environment_factory``, verifiers' ``MultiTurnEnv``, SkyRL-gym): an episode starts from an
example (initial messages, tools offered), each model turn is answered with observation
messages, a reward, ``done`` and metrics, and a cleanup always runs. Unlike the peers,
environments are found by name through entry points, like every other component.

A registered environment is a *class* (or any factory) whose keyword arguments are its config
keys; the sampler builds **one instance per episode**, so an instance may keep episode state.
Subclass :class:`Environment` and write only what differs::

    class Calculator(Environment):
        async def reset(self, example):
            self.answer = example["answer"]
            return [{"role": "user", "content": example["question"]}]

        @tool
        def multiply(self, a: int, b: int) -> int:
            \"\"\"Multiply two integers.

            Args:
                a: the first factor
                b: the second factor
            \"\"\"
            return a * b

        async def score(self, response):
            return float(response.text.strip() == self.answer)

The default :meth:`Environment.step` runs the turn's tool calls (each a tool message back,
errors included) and ends the episode on a turn without tool calls, scored by :meth:`score`
(``None``: the stage's ``reward`` scores the final text instead).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse, tool_message
from tempering.rollouts.feedback import feedback_of
from tempering.rollouts.tools import Tool, ToolResult, tools_of


@dataclass
class StepResult:
    """What the environment answers a model turn with.

    ``reward`` is this turn's reward (an episode's reward is the sum over its turns, plus any
    group reward); ``None`` on the final turn asks the stage's ``reward`` component to score
    the final assistant text. ``errors`` are texts worth showing (a tool's exception).
    ``feedback``: what went wrong or right in words, for the learner rather than the model's
    next turn. The episode's ``Sample.feedback`` joins every turn's ``errors`` and
    ``feedback``, in order (:mod:`tempering.rollouts.feedback`).
    """

    messages: list[Message] = field(default_factory=list)
    reward: float | None = 0.0
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    feedback: str | None = None


class Environment:
    """Base class for tool-using environments (see the module docstring).

    Class attributes a subclass may set:

    * ``parse_errors``: what a turn that does not parse (a malformed tool call, a turn cut by
      the token limit) does: ``"end"`` (default: the episode ends with reward 0) or
      ``"feedback"`` (the model is told what was wrong, as a user message, and goes on).
    * ``tool_timeout``: seconds per tool call (the sampler's ``tool_timeout`` when None).
    * ``max_concurrent``: how many episodes of this environment may run at once (a server's
      session limit; None = no limit). The ``environment`` sampler starts no more than that:
      the others wait for a free slot before they join the batch.

    Optional: ``async group_reward(self, trajectories) -> list[float]``, called on the first
    episode of each group once all of the group's episodes ended (e.g. a judge ranking the
    group's answers); its values are added to the episodes' rewards.
    """

    parse_errors: str = "end"
    tool_timeout: float | None = None
    max_concurrent: int | None = None

    async def reset(self, example: dict[str, Any]) -> list[Message]:
        """The episode's first messages. Default: the example's ``messages``, else its
        ``prompt`` as one user message."""
        if "messages" in example:
            return [dict(m) for m in example["messages"]]
        if "prompt" in example:
            return [{"role": "user", "content": str(example["prompt"])}]
        raise KeyError(f"the example has neither 'messages' nor 'prompt' (keys: {sorted(example)})")

    def tools(self) -> list[Tool]:
        """The tools offered to the model: the ``@tool`` methods (built once per instance)."""
        cached = self.__dict__.get("_tempering_tools")
        if cached is None:
            cached = tools_of(self)
            self.__dict__["_tempering_tools"] = cached
        return cached

    async def step(self, response: ParsedResponse) -> StepResult:
        """Run the turn's tool calls, or end the episode on a final answer. A turn that does not
        parse says so in its feedback; the final answer's is :meth:`score`'s, when it returns a
        :class:`~tempering.rollouts.feedback.Scored` value."""
        if response.parse_error is not None:
            said = f"the turn could not be parsed: {response.parse_error}"
            if self.parse_errors == "feedback":
                text = f"Your last message could not be parsed ({response.parse_error}). Try again."
                return StepResult([{"role": "user", "content": text}], metrics={"parse_errors": 1.0}, feedback=said)
            return StepResult(reward=0.0, done=True, metrics={"parse_errors": 1.0}, feedback=said)
        if not response.tool_calls:
            score = await self.score(response)
            return StepResult(reward=score, done=True, feedback=feedback_of(score, "environment.score()"))
        results = await self.call_tools(response)
        messages = [tool_message(call, r.content) for call, r in zip(response.tool_calls, results)]
        return StepResult(
            messages,
            reward=0.0,
            done=False,
            metrics=tool_metrics(results),
            errors=[r.error for r in results if r.error],
        )

    async def call_tools(self, response: ParsedResponse) -> list[ToolResult]:
        """Run a turn's calls concurrently (results in call order); unknown tools, bad
        arguments, exceptions and timeouts come back as error results."""
        by_name = {t.name: t for t in self.tools()}

        async def one(call: Any) -> ToolResult:
            found = by_name.get(call.name)
            if found is None:
                known = ", ".join(sorted(by_name)) or "none"
                msg = f"unknown tool '{call.name}' (tools: {known})"
                return ToolResult(f"Error: {msg}", msg)
            return await found.call(call.arguments, self.tool_timeout)

        return list(await asyncio.gather(*(one(c) for c in response.tool_calls)))

    async def score(self, response: ParsedResponse) -> float | None:
        """Reward of the final answer; ``None`` (default) lets the stage's ``reward`` score it.
        A :class:`~tempering.rollouts.feedback.Scored` value carries feedback too."""
        return None

    def view(self, messages: list[Message]) -> list[Message]:
        """The history as the model sees it before its next turn. Default: all of it.

        An environment that manages the model's context -- drops the documents it pruned,
        summarises old turns -- rewrites it here and keeps the history itself intact (the
        transcript records what happened). Where the rewritten prompt no longer extends the
        previous one, the trajectory starts a new training row: no row holds a token the
        model did not see."""
        return messages

    async def cleanup(self) -> None:
        """Release what the episode holds (always called, also after an error)."""


def tool_metrics(results: Sequence[ToolResult]) -> dict[str, float]:
    """Counts of one turn's tool calls: calls, errors (timeouts included), timeouts."""
    return {
        "tool_calls": float(len(results)),
        "tool_errors": float(sum(r.error is not None for r in results)),
        "tool_timeouts": float(sum(r.timed_out for r in results)),
    }
