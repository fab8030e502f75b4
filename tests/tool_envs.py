"""Environments shared by the multi-turn tests."""

from __future__ import annotations

from tempering.rollouts.environment import Environment
from tempering.rollouts.tools import tool


class WithAdd(Environment):
    """An environment that offers one tool, ``add``: subclasses write the episode."""

    @tool
    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first term
            b: the second term
        """
        return a + b
