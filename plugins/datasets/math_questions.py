"""Arithmetic questions in natural language, for instruct models (the ``smollm2_math`` demo).

A pretrained instruct model already reads English, so the task is posed as a user would pose
it -- "What is 47 + 6?", "Lena has 12 shells and finds 7 more. How many shells does she have
now?" -- and scored on the last number of its answer (``math_answer``). SmolLM2-135M-Instruct
answers such questions right about a third of the time, often restating the sum wrongly
(``41 + 6 = 10``) or rambling past it: room for RL to show a gain on both accuracy and form.

Questions are drawn from a seeded generator; train and test are disjoint by construction (the
test split takes every question whose operands hash into its share), so no held-out question
is seen in training whatever the sizes.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Omar", "Lena", "Raj", "Zoe")
THINGS = ("apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles")
#: What each kind of question asks: (template, operation). ``{n}``/``{t}`` are a name and a thing.
TEMPLATES: dict[str, tuple[str, str]] = {
    "add": ("What is {a} + {b}?", "+"),
    "sub": ("What is {a} - {b}?", "-"),
    "more": ("{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?", "+"),
    "fewer": ("{n} has {a} {t} and gives away {b}. How many {t} does {n} have left?", "-"),
}
SUFFIX = " Reply with only the number."


def math_questions(
    split: str = "train",
    size: int | None = None,
    kinds: tuple[str, ...] | list[str] = ("add", "sub", "more", "fewer"),
    low: int = 2,
    high: int = 15,
    small: int = 9,
    test_share: float = 0.2,
    suffix: bool = True,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """``{"messages": [user question], "question", "answer"}`` rows for ``split`` in {train, test}.

    Each question combines a number in ``[low, high]`` with one in ``[2, small]`` by one of
    ``kinds`` (keys of :data:`TEMPLATES`); ``size`` rows (default: 2000 train, 200 test), in a
    fixed order given ``seed``. ``suffix`` appends "Reply with only the number."."""
    if split not in ("train", "test"):
        raise ValueError(f"math_questions: split must be 'train' or 'test', got {split!r}")
    unknown = [k for k in kinds if k not in TEMPLATES]
    if unknown or not kinds:
        raise ValueError(f"math_questions: unknown kinds {unknown}; choose from {sorted(TEMPLATES)}")
    if not (2 <= small and 2 <= low <= high):
        raise ValueError(
            f"math_questions: need 2 <= small and 2 <= low <= high, got small={small}, low={low}, high={high}"
        )
    want = size if size is not None else (2000 if split == "train" else 200)
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    # Unique (kind, a, b, name, thing) combinations exist in the tens of thousands; stop early when exhausted.
    for _ in range(want * 50):
        if len(rows) >= want:
            break
        kind = kinds[rng.randrange(len(kinds))]
        a, b = rng.randint(low, high), rng.randint(2, small)
        if TEMPLATES[kind][1] == "-" and b > a:  # no negative answers: "gives away" more than it has
            a, b = b, a
        n, t = NAMES[rng.randrange(len(NAMES))], THINGS[rng.randrange(len(THINGS))]
        key = (kind, a, b, n, t) if "{n}" in TEMPLATES[kind][0] else (kind, a, b)
        if key in seen or (_in_test(TEMPLATES[kind][1], a, b, test_share) != (split == "test")):
            continue
        seen.add(key)
        template, op = TEMPLATES[kind]
        question = template.format(a=a, b=b, n=n, t=t) + (SUFFIX if suffix else "")
        rows.append(
            {
                "messages": [{"role": "user", "content": question}],
                "question": question,
                "answer": str(a + b if op == "+" else a - b),
                "kind": kind,
            }
        )
    return rows


def _in_test(op: str, a: int, b: int, share: float) -> bool:
    """Whether a question belongs to the test split: a stable hash of ``(op, a, b)``, so a
    held-out sum is never asked in training, in any wording."""
    digest = hashlib.sha256(f"{op}:{a}:{b}".encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * 2**32
