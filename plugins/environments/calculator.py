"""``calculator``: arithmetic the model cannot do in its head, done with a tool over two turns.

The bundled tool-use task (``tempering run tool_use``). Each episode asks for a product of two
two-digit numbers (``"37*84"``). A tiny character-level model cannot multiply, but it can copy
digits, so it succeeds only by using the tool: first call ``mul`` with the factors, then answer
with the number the tool returned::

    <|user|>37*84<|assistant|><|call|>mul(a=37,b=84)<eos><|tool|>3108<|assistant|>3108<eos>

The reward is exact match of the final answer; a wrong one's feedback says what was expected,
what came and how the tool was used (``expected '3108', got '3018'; the last tool result was
'3108'``), and a failing tool call is feedback too (``tool mul raised ValueError: ...``).
Each episode also counts how the model used the tool -- ``right_calls`` (calls equal to the
reference solution's call at that position) and ``copied_result`` (final answers that repeat
the last tool result) -- summed over a batch as ``env/right_calls`` and ``env/copied_result``
(``eval/...`` in evaluations), so a run shows which half of the skill training improved.
"""

from __future__ import annotations

from typing import Any

from tempering.rollouts.chat import ParsedResponse
from tempering.rollouts.environment import Environment, StepResult
from tempering.rollouts.feedback import Scored, mismatch, quote
from tempering.rollouts.tools import tool


class Calculator(Environment):
    """Example keys: ``question``, ``answer`` and, optionally, ``calls``: the reference
    solution as ``[[name, {arguments}], ...]``, for the ``right_calls`` metric (not reported
    for an example without it: a missing column is not a wrong call)."""

    def __init__(self) -> None:
        self.answer = ""
        self.reference: list[tuple[str, dict[str, Any]]] = []
        self.made: list[tuple[str, dict[str, Any]]] = []
        self.last_result: str | None = None

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        self.answer = str(example["answer"])
        self.reference = [(str(name), dict(args)) for name, args in example.get("calls", [])]
        return [{"role": "user", "content": str(example["question"])}]

    @tool
    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        return int(a) * int(b)

    async def step(self, response: ParsedResponse) -> StepResult:
        result = await super().step(response)
        right = 0
        for call in response.tool_calls:
            i = len(self.made)
            self.made.append((call.name, dict(call.arguments)))
            right += i < len(self.reference) and self.reference[i] == self.made[-1]
        if response.tool_calls and self.reference:  # without a reference solution there is nothing to compare
            result.metrics["right_calls"] = float(right)
        results = [m["content"] for m in result.messages if m.get("role") == "tool"]
        if results:
            self.last_result = results[-1]
        if result.done and response.parse_error is None:
            copied = self.last_result is not None and response.text.strip() == self.last_result
            result.metrics["copied_result"] = float(copied)
        return result

    async def score(self, response: ParsedResponse) -> float:
        """1.0 for the exact answer; a miss is 0.0 with feedback: what was expected and what
        came, and how the tool was (not) used."""
        got = response.text.strip()
        if got == self.answer:
            return 1.0
        notes = [mismatch(self.answer, got)]
        if not self.made:
            notes.append("mul was never called")
        elif self.last_result is not None and got != self.last_result:
            notes.append(f"the last tool result was {quote(self.last_result)}")
        return Scored(0.0, "; ".join(notes))
