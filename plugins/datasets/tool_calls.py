"""A new skill for SDFT vs SFT on an instruct model: answer a request with one tool call.

The ``smollm2_sdft`` / ``smollm2_sft_skill`` recipes teach SmolLM2-135M-Instruct a format it
does not produce (measured: 0 of 60 held-out requests exact, greedy): the user turn lists the
tools and asks for something -- "Tools: weather(city), timer(minutes), call(name). Request:
Will it rain in Oslo today?" -- and the answer is the call alone, ``weather(city="Oslo")``, as a
tool-calling harness would parse it (the paper's tool-use benchmark scores the call, not prose).
The demonstration is that call; ``answer`` is the same string, for ``exact_match``. Rows carry
the request as ``prompt`` text (a chat renderer makes it the user turn), not ``messages``: an
SFT stage reads a ``messages`` row as a whole transcript.

Rows are generated from word lists; the arguments are split by a stable hash, so no held-out
city, name or number of minutes is ever demonstrated in training (the test measures the
format on new arguments, not recall of seen pairs).

``next_number`` is a skill the base model already has (the number after 404), measured alongside
``math_questions`` to see what training on the new skill makes it forget.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

TOOLS = "Tools: weather(city), timer(minutes), call(name)."
CITIES = (
    "Paris", "London", "Oslo", "Rome", "Madrid", "Berlin", "Vienna", "Prague", "Lisbon", "Dublin",
    "Athens", "Warsaw", "Cairo", "Tokyo", "Seoul", "Delhi", "Lima", "Quito", "Nairobi", "Sydney",
    "Toronto", "Chicago", "Boston", "Denver", "Miami", "Dallas", "Seattle", "Austin", "Milan", "Munich",
    "Zurich", "Geneva", "Bergen", "Porto", "Naples", "Venice", "Kyoto", "Osaka", "Hanoi", "Manila",
)  # fmt: skip
NAMES = (
    "Anna", "Tom", "Sam", "Lily", "Ben", "Mia", "Omar", "Lena", "Raj", "Zoe", "Max", "Eva", "Leo",
    "Nina", "Hugo", "Ivy", "Noah", "Emma", "Liam", "Olga", "Paul", "Rosa", "Theo", "Vera", "Adam",
    "Clara", "David", "Ella", "Felix", "Grace", "Henry", "Iris", "Jack", "Kate", "Luke", "Maria",
)  # fmt: skip
#: Requests per tool: (phrasings, argument name, whether the argument is quoted in the call).
REQUESTS: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "weather": (
        ("What's the weather like in {x}?", "Will it rain in {x} today?", "How warm is it in {x} right now?"),
        "city",
        True,
    ),
    "timer": (
        ("Set a timer for {x} minutes.", "Start a {x} minute timer.", "Can you time {x} minutes for me?"),
        "minutes",
        False,
    ),
    "call": (("Call {x}.", "Please phone {x} for me.", "Ring {x} now."), "name", True),
}
ARGUMENTS: dict[str, tuple[str, ...]] = {
    "weather": CITIES,
    "timer": tuple(str(n) for n in range(2, 61)),
    "call": NAMES,
}


def tool_calls(
    split: str = "train", size: int | None = None, test_share: float = 0.3, seed: int = 0
) -> list[dict[str, Any]]:
    """``{"prompt", "demonstration", "answer", "tool"}`` rows for ``split`` in
    {train, test}: every (tool, phrasing, argument) of the split, shuffled by ``seed``, the
    first ``size`` (default all: about 330 train, 140 test)."""
    if split not in ("train", "test"):
        raise ValueError(f"tool_calls: split must be 'train' or 'test', got {split!r}")
    rows: list[dict[str, Any]] = []
    for tool, (phrasings, arg, quoted) in REQUESTS.items():
        for x in ARGUMENTS[tool]:
            if _in_test(f"{tool}:{x}", test_share) != (split == "test"):
                continue
            value = f'"{x}"' if quoted else x
            call = f"{tool}({arg}={value})"
            for phrasing in phrasings:
                prompt = f"{TOOLS}\nRequest: {phrasing.format(x=x)}"
                rows.append(
                    {
                        "prompt": prompt,
                        "demonstration": call,
                        "answer": call,
                        "tool": tool,
                    }
                )
    random.Random(seed).shuffle(rows)
    return rows[:size] if size is not None else rows


def next_number(split: str = "test", size: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """ "What number comes right after 404? Reply with only the number." rows (``messages``,
    ``answer``) for ``math_answer``: a prior skill to measure forgetting on (the base model
    answers 0.52 of the first 100 test rows right, greedy, often "The number that comes after 404 is 405."). Numbers
    10-999, split by a stable hash (30% test); ``size`` default 200."""
    if split not in ("train", "test"):
        raise ValueError(f"next_number: split must be 'train' or 'test', got {split!r}")
    numbers = [n for n in range(10, 1000) if _in_test(f"next:{n}", 0.3) == (split == "test")]
    random.Random(seed).shuffle(numbers)
    rows = []
    for n in numbers[: size if size is not None else 200]:
        question = f"What number comes right after {n}? Reply with only the number."
        rows.append({"messages": [{"role": "user", "content": question}], "question": question, "answer": str(n + 1)})
    return rows


def _in_test(key: str, share: float) -> bool:
    """A stable hash of ``key`` decides its split, so a held-out argument is never demonstrated."""
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * 2**32
