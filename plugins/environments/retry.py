"""``retry``: answer, wait for a slow checker, try again when it says no.

The shape of an agent task whose environment is slow and whose verdict comes back in words: a
test suite that runs for minutes, a remote grader, a browser. Each episode asks the example's
question (its ``messages`` or ``prompt``); every answer goes to the checker -- the reward named
by ``check`` (default ``math_answer``) -- which answers after ``latency_s`` seconds. A passing
answer ends the episode with the checker's reward; a failing one is answered with
``retry_message`` as a user turn, and the model tries again, up to ``attempts`` answers. A turn
the token limit cut is checked as written (rambling past ``max_tokens`` is a wrong answer, not
the end of the episode)::

    user: What is 47 + 6? Reply with only the number.
    assistant: 47 + 6 = 43                 (the checker: 0.0, after latency_s)
    user: That is not right. Try again. Reply with only the number.
    assistant: 53                          (the checker: 1.0 -> reward 1.0)

The episode's reward is its last answer's (so 1.0 for a pass at any attempt, else the last
failure's score), its feedback every failed answer's feedback in order. The wait is an
``asyncio.sleep`` on the environment's loop: no CPU is spent, the episodes of a batch wait
together, and an asynchronous producer (``offpolicy``, stale ``sdpo``) keeps waiting while the
trainer trains -- the setting where stale rollouts pay (``smollm2_stale_sdpo``).

Per episode, summed over a batch as ``env/<name>`` (``eval/<name>`` in evaluations):
``passed_first`` (the first answer passed) and ``retries`` (failed answers that were given
another try).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Iterator, Mapping
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse
from tempering.rollouts.environment import Environment, StepResult
from tempering.rollouts.episode import CUT_TURN
from tempering.rollouts.feedback import feedback_of
from tempering.schema import Problem, first_problem

RETRY_MESSAGE = "That is not right. Try again. Reply with only the number."


class Retry(Environment):
    """Config keys: ``check`` (a reward spec that scores each answer; default ``math_answer``),
    ``attempts`` (answers allowed, >= 1), ``latency_s`` (seconds the checker takes per answer,
    >= 0), ``retry_message`` (the user turn after a failed answer) and ``pass_reward`` (the
    checker's score at or above which an answer passes; 1.0)."""

    def __init__(
        self,
        check: object = "math_answer",
        attempts: int = 2,
        latency_s: float = 0.0,
        retry_message: str = RETRY_MESSAGE,
        pass_reward: float = 1.0,
    ) -> None:
        config = {"attempts": attempts, "latency_s": latency_s, "retry_message": retry_message}
        problem = first_problem(type(self), config)
        if problem is not None:  # a Python caller's error (the registry reports it at its key)
            raise ValueError(f"retry: {problem.key}: {problem.message}")
        self.check, self.attempts, self.latency_s = check, int(attempts), float(latency_s)
        self.retry_message, self.pass_reward = retry_message, float(pass_reward)
        self.example: dict[str, Any] = {}
        self.answers = 0

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The schema check (:mod:`tempering.schema`): the registry runs it when the sampler is
        built, so a bad key is one line at its path before anything trains."""
        if config["attempts"] < 1:
            yield Problem("attempts", f"must be >= 1 (answers per episode), got {config['attempts']}")
        if not 0 <= config["latency_s"] < math.inf:
            yield Problem("latency_s", f"must be a number of seconds >= 0 (0: no wait), got {config['latency_s']}")
        if not str(config["retry_message"]).strip():
            yield Problem("retry_message", "must be text: the model's next user turn after a failed answer")

    async def reset(self, example: dict[str, Any]) -> list[Message]:
        from tempering.plugins.rewards.common import resolve_reward

        self.example, self.answers = dict(example), 0
        self.checker = resolve_reward(self.check, path="environment.check")
        return await super().reset(example)

    async def step(self, response: ParsedResponse) -> StepResult:
        """Check the answer (after ``latency_s``); pass or out of attempts ends the episode. A
        turn cut at the token limit is an answer too (the checker sees what was written, as a
        grader would); any other malformed turn ends the episode (:class:`Environment`)."""
        if response.parse_error not in (None, CUT_TURN):
            return await super().step(response)
        from tempering.plugins.rewards.common import as_finite

        self.answers += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        value = self.checker(response.text, self.example)
        value = await value if inspect.isawaitable(value) else value
        score = as_finite(value, "retry: the checker")
        passed = score >= self.pass_reward
        feedback = None if passed else feedback_of(value, "retry: the checker")
        metrics = {"passed_first": float(passed and self.answers == 1)} if self.answers == 1 else {}
        if passed or self.answers >= self.attempts:
            return StepResult(reward=score, done=True, metrics=metrics, feedback=feedback)
        metrics["retries"] = 1.0
        again: list[Message] = [{"role": "user", "content": self.retry_message}]
        return StepResult(again, reward=0.0, metrics=metrics, feedback=feedback)
