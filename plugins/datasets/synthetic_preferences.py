"""``synthetic_preferences``: a synthetic preference dataset for tests and the toy DPO -> RL example.

Pairs are 2-digit additions split into train and test exactly like the ``arithmetic`` dataset
(same ``low``/``high``/``test_size``/``seed`` give the same split), so a recipe can warm up with
DPO on the train pairs and be evaluated -- or continue with GRPO -- on ``arithmetic``'s held-out
test questions. ``chosen`` is the correct sum; ``rejected`` is, depending on ``rejected``:

* ``wrong``: a near miss, the sum plus or minus 1..10 (never negative, never the sum itself);
* ``malformed``: the right digits in a broken format -- trailing junk (``"68 3"``), a
  repetition (``"68+68"``) or a dropped digit (``"6"``): the "well-formed tool call vs. broken
  call" shape of the tool-use story at toy scale;
* ``mixed`` (default): half of each, alternating by row.

Every row also has ``answer`` (the correct sum), so the same rows work with ``exact_match``.
"""

from __future__ import annotations

import random
from typing import Any

from tempering.plugins.datasets.arithmetic import arithmetic

REJECTED_KINDS = ("wrong", "malformed", "mixed")


def near_miss(answer: int, rng: random.Random) -> str:
    """A wrong answer close to ``answer``: it plus or minus 1..10, never negative, never itself
    (also ``math_preferences``' ``wrong`` kind)."""
    while True:
        cand = answer + rng.choice([-1, 1]) * rng.randint(1, 10)
        if cand >= 0 and cand != answer:
            return str(cand)


def _malformed(answer: str, rng: random.Random) -> str:
    kind = rng.randrange(3)
    if kind == 0:
        return f"{answer} {rng.randint(0, 9)}"
    if kind == 1:
        return f"{answer}+{answer}"
    return answer[:-1] if len(answer) > 1 else f"{answer}{answer}"


def synthetic_preferences(
    split: str = "train",
    size: int | None = None,
    rejected: str = "mixed",
    low: int = 0,
    high: int = 99,
    test_size: int = 500,
    seed: int = 1234,
) -> list[dict[str, Any]]:
    """``{"prompt": "23+45=", "chosen": "68", "rejected": "71", "answer": "68"}`` rows."""
    if rejected not in REJECTED_KINDS:
        raise ValueError(f"synthetic_preferences: rejected must be one of {REJECTED_KINDS}, got '{rejected}'")
    rows = arithmetic(split=split, size=size, low=low, high=high, test_size=test_size, seed=seed)
    rng = random.Random(f"{seed}-{split}-{rejected}")
    out = []
    for i, row in enumerate(rows):
        kind = rejected if rejected != "mixed" else ("wrong" if i % 2 == 0 else "malformed")
        answer = row["answer"]
        bad = near_miss(int(answer), rng) if kind == "wrong" else _malformed(answer, rng)
        out.append({"prompt": row["prompt"], "chosen": answer, "rejected": bad, "answer": answer})
    return out
