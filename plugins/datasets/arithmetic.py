"""Synthetic addition problems: the bundled CPU demo's task.

Pairs ``a + b`` with ``a, b`` in ``[low, high]`` are split into train and test by a seeded
shuffle of *all* pairs, so the test questions are never seen in training.

``feedback_frac`` puts feedback on a wrong earlier answer in front of that share of the rows'
prompts -- ``expected '46', got '45' 12+34=`` with the answer unchanged, in the words of the
``exact_match`` reward's feedback (:func:`tempering.rollouts.feedback.mismatch`). SFT on such rows teaches
a model to *use* feedback, which SDPO's teacher (the model re-prompted with its feedback) needs:
a model that cannot read its context gives a teacher no better than the student (docs/sdpo.md).
"""

from __future__ import annotations

import random
from typing import Any

from tempering.rollouts.feedback import mismatch


def all_pairs(low: int, high: int) -> list[tuple[int, int]]:
    return [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]


def arithmetic(
    split: str = "train",
    size: int | None = None,
    low: int = 0,
    high: int = 99,
    test_size: int = 500,
    seed: int = 1234,
    feedback_frac: float = 0.0,
) -> list[dict[str, Any]]:
    """``{"prompt": "23+45=", "answer": "68"}`` rows for ``split`` in {train, test};
    ``feedback_frac`` of them with feedback in front of the prompt (module docstring)."""
    if split not in ("train", "test"):
        raise ValueError(f"arithmetic: split must be 'train' or 'test', got '{split}'")
    pairs = all_pairs(low, high)
    if test_size >= len(pairs):
        raise ValueError(f"arithmetic: test_size {test_size} leaves no training pairs (only {len(pairs)} exist)")
    random.Random(seed).shuffle(pairs)
    chosen = pairs[:test_size] if split == "test" else pairs[test_size:]
    if not 0.0 <= feedback_frac <= 1.0:
        raise ValueError(f"arithmetic: feedback_frac must be in [0, 1], got {feedback_frac}")
    if size is not None:
        chosen = chosen[:size]
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in chosen]
    rng = random.Random(seed + 1)  # its own stream: the pairs and their split do not depend on it
    for row in rows:
        if feedback_frac and rng.random() < feedback_frac:
            row["prompt"] = f"{mismatch(row['answer'], wrong_answer(int(row['answer']), rng))} {row['prompt']}"
    return rows


def wrong_answer(right: int, rng: random.Random) -> str:
    """A plausible wrong answer to show in feedback: off by 1-10 (often), another number, a
    digit too few, or nothing (as a model's early attempts are)."""
    kind = rng.random()
    if kind < 0.1:
        return ""
    if kind < 0.3 and right >= 10:
        return str(right)[:-1]
    if kind < 0.8:
        delta = rng.randint(1, 10) * rng.choice([-1, 1])
        return str(right + delta if right + delta >= 0 else right - delta)
    other = rng.randint(0, 198)
    return str(other if other != right else other + 1)
