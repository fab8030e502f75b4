"""An environment is a class whose instances play one multi-turn episode each.

``unit_converter`` asks for a length in another unit and offers the model one tool,
``convert``. Subclassing :class:`tempering.rollouts.environment.Environment` means writing only what is
this task's own -- the first messages (``reset``), the tools (``@tool`` methods: their type
hints and docstring *are* the schema the model is shown) and the final answer's reward
(``score``); the base class runs the tool calls, turns a tool's exception into an error
message the model reads on its next turn, and ends the episode on a turn without tool calls.

Registered as a dataclass, its fields are its config keys:
``sampler: {name: environment, environment: {name: unit_converter, rel_tol: 0.01}}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse
from tempering.rollouts.environment import Environment
from tempering.rollouts.tools import tool

#: Metres per unit.
METRES = {"mm": 0.001, "cm": 0.01, "m": 1.0, "km": 1000.0, "in": 0.0254, "ft": 0.3048, "mi": 1609.344}


@dataclass
class UnitConverter(Environment):
    """Examples have a ``question`` ("how many m is 3 km?") and a numeric ``answer``; the final
    answer earns 1.0 when it is within ``rel_tol`` (relative) of ``answer``, else 0.0."""

    rel_tol: float = 1e-3

    def __post_init__(self) -> None:
        if not self.rel_tol >= 0:
            raise ValueError(f"unit_converter: rel_tol must be >= 0, got {self.rel_tol}")

    async def reset(self, example: dict[str, Any]) -> list[Message]:
        self.answer = float(example["answer"])
        return [{"role": "user", "content": str(example["question"])}]

    @tool
    def convert(self, value: float, unit: str, to: str) -> str:
        """Convert a length from one unit to another.

        Args:
            value: the length, in `unit`
            unit: the unit of `value`: mm, cm, m, km, in, ft or mi
            to: the unit to convert to (same choices)
        """
        for u in (unit, to):
            if u not in METRES:
                raise ValueError(f"unknown unit '{u}': use one of {', '.join(METRES)}")
        return f"{value * METRES[unit] / METRES[to]:g}"

    async def score(self, response: ParsedResponse) -> float | None:
        try:
            got = float(response.text.strip())
        except ValueError:
            return 0.0
        return float(math.isclose(got, self.answer, rel_tol=self.rel_tol, abs_tol=1e-12))
