"""Products ``a*b`` for the ``calculator`` environment: the ``tool_use`` demo's data.

Every row is generated in code from a seed, so nothing is downloaded or shipped. The test
split is the first ``test_size`` distinct pairs of one seeded stream; the train split the first
``train_size`` distinct pairs of another stream that are not in the test split, so held-out
questions are never seen in training.

A row is a task for the environment -- ``{"question": "37*84", "answer": "3108", "calls":
[["mul", {"a": 37, "b": 84}]]}``, ``calls`` being the reference solution -- or, with
``transcripts: true``, the supervised transcript of that solution for an SFT warmup
(``{"messages": [...], "tools": [...]}``). The transcript's tool results are computed by the
environment's own tools and its ``tools`` are the environment's tool specs, so SFT renders
exactly the tokens an RL episode of the same task produces.
"""

from __future__ import annotations

import json
import random
from functools import lru_cache
from typing import Any

from tempering.rollouts.tools import format_result


def tool_use(
    split: str = "train",
    size: int | None = None,
    low: int = 10,
    high: int = 99,
    test_size: int = 500,
    train_size: int = 5000,
    transcripts: bool = False,
    seed: int = 4321,
) -> list[dict[str, Any]]:
    """Tasks (or, with ``transcripts``, SFT transcripts of their solutions) for ``split`` in
    {train, test}; ``size`` keeps the first rows."""
    if split not in ("train", "test"):
        raise ValueError(f"tool_use: split must be 'train' or 'test', got '{split}'")
    if not 0 <= low <= high:
        raise ValueError(f"tool_use: need 0 <= low <= high, got low={low}, high={high}")
    n = (high - low + 1) ** 2
    if test_size + train_size > n:
        raise ValueError(
            f"tool_use: test_size + train_size = {test_size + train_size} exceeds the {n} pairs in [{low}, {high}]"
        )
    test = _pairs(random.Random(seed), low, high, test_size, set())
    chosen = test if split == "test" else _pairs(random.Random(seed + 1), low, high, train_size, set(test))
    if size is not None:
        chosen = chosen[:size]
    tasks = [task(a, b) for a, b in chosen]
    return [transcript(t) for t in tasks] if transcripts else tasks


def _pairs(rng: random.Random, low: int, high: int, count: int, exclude: set[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    seen = set(exclude)
    while len(out) < count:
        t = (rng.randint(low, high), rng.randint(low, high))
        if t not in seen:
            seen.add(t)
            out.append(t)
    return out


def task(a: int, b: int) -> dict[str, Any]:
    """The task ``a*b`` with its answer and reference solution (one ``mul`` call)."""
    return {"question": f"{a}*{b}", "answer": str(a * b), "calls": [["mul", {"a": a, "b": b}]]}


def transcript(t: dict[str, Any]) -> dict[str, Any]:
    """The reference solution of task ``t`` as a chat: one assistant turn per call, each
    answered by the tool's result, then the final answer."""
    env = _environment()
    messages: list[dict[str, Any]] = [{"role": "user", "content": t["question"]}]
    for i, (name, args) in enumerate(t["calls"]):
        call_id = f"call_{i}_0"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        result = format_result(getattr(env, name)(**args))
        messages.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": result})
    messages.append({"role": "assistant", "content": t["answer"]})
    return {"messages": messages, "tools": calculator_tools()}


@lru_cache(maxsize=1)
def _environment() -> Any:
    from tempering.plugins.environments.calculator import Calculator

    return Calculator()


def calculator_tools() -> list[dict[str, Any]]:
    """The ``calculator`` environment's tool specs, exactly as an episode offers them."""
    return [t.spec() for t in _environment().tools()]
