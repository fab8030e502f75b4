"""Preference pairs over :mod:`math_questions <tempering.plugins.datasets.math_questions>`, for DPO
on an instruct model (``examples/real_models/smollm2_dpo.yaml``).

Each question keeps its split (train and test are disjoint by ``(op, a, b)``, as in
``math_questions``), its ``answer`` and ``kind``, so the same rows serve a ``math_answer``
evaluation. ``chosen`` is the bare correct number -- what "Reply with only the number." asks
for; ``rejected`` is what SmolLM2-135M-Instruct tends to write instead, by ``rejected``:

* ``wrong``: a bare near miss (the answer +-1..10, never negative);
* ``verbose``: the right answer, restated and padded (``"7 + 5 = 12. So the answer is 12."``);
* ``restated_wrong``: a restatement with a wrong result (``"41 + 6 = 10"``), the base model's
  most common error;
* ``mixed`` (default): the three in turn, by row.

Rows carry the question as a text ``prompt`` (no ``messages``), so a chat stage renders it as
one user turn -- the tokens a ``grpo`` stage or an evaluation of ``math_questions`` samples after.
"""

from __future__ import annotations

import random
import re
from typing import Any

from tempering.plugins.datasets.math_questions import TEMPLATES, math_questions
from tempering.plugins.datasets.synthetic_preferences import near_miss

REJECTED_KINDS = ("wrong", "verbose", "restated_wrong", "mixed")
_MIXED = ("wrong", "verbose", "restated_wrong")


def math_preferences(
    split: str = "train",
    size: int | None = None,
    rejected: str = "mixed",
    kinds: tuple[str, ...] | list[str] = ("add", "sub", "more", "fewer"),
    low: int = 2,
    high: int = 15,
    small: int = 9,
    test_share: float = 0.2,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """``{"prompt", "chosen", "rejected", "answer", "kind", "rejected_kind"}`` rows for the
    ``math_questions`` of ``split`` with the same ``size``, ``kinds``, ``low``, ``high``,
    ``small``, ``test_share`` and ``seed`` (so the same questions, in the same order)."""
    if rejected not in REJECTED_KINDS:
        raise ValueError(f"math_preferences: rejected must be one of {REJECTED_KINDS}, got '{rejected}'")
    rows = math_questions(
        split=split, size=size, kinds=kinds, low=low, high=high, small=small, test_share=test_share, seed=seed
    )
    rng = random.Random(f"{seed}-{split}-{rejected}")
    out = []
    for i, row in enumerate(rows):
        kind = rejected if rejected != "mixed" else _MIXED[i % len(_MIXED)]
        out.append(
            {
                "prompt": row["question"],
                "chosen": row["answer"],
                "rejected": _rejected(row, kind, rng),
                "answer": row["answer"],
                "kind": row["kind"],
                "rejected_kind": kind,
            }
        )
    return out


def _rejected(row: dict[str, Any], kind: str, rng: random.Random) -> str:
    answer = int(row["answer"])
    if kind == "wrong":
        return near_miss(answer, rng)
    a, b = re.findall(r"\d+", row["question"])[:2]  # every template names a before b
    sum_ = f"{a} {TEMPLATES[row['kind']][1]} {b}"
    if kind == "verbose":
        return f"{sum_} = {answer}. So the answer is {answer}."
    return f"{sum_} = {near_miss(answer, rng)}"
