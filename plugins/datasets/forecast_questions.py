"""Forecasting questions whose outcomes come from a known process (the ``smollm2_forecast`` demo).

Calibration can only be measured where the right probability is known. Each question states a
history -- "It rained on 7 of the last 10 days. Will it rain tomorrow?" -- and its outcome is
drawn, with a seeded generator, as a coin that comes up 1 with exactly the stated frequency
``rate = count / total``. So the best forecast of every row is its ``rate`` (kept in the row),
the best attainable Brier score is the mean of ``rate * (1 - rate)``, and a forecaster that
ignores the history and always says the base rate scores Brier skill 0: the gap between them
is what RL on the ``brier`` reward can win. With the default histories of 10 days (counts
uniform in 0..10) the best Brier is 0.15 against the base rate's 0.25: a ceiling of Brier
skill 0.40 (the Lightning Rod and Mantic teams reached 0.27 on real questions).

Prompts are short and the answer format fixed ("Answer with only a probability between 0 and
1.") so a 135M model can learn it. Train and test are disjoint by construction: a question's
wording (event, subject, count and total) hashes into the test share or not, so no held-out
question is asked in training, whatever the sizes.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

#: (history, question) per kind of event; ``{s}`` is a subject, ``{k}`` / ``{n}`` the counts.
TEMPLATES: dict[str, tuple[str, str]] = {
    "rain": ("It rained in {s} on {k} of the last {n} days.", "Will it rain in {s} tomorrow?"),
    "late": ("{s} was late to work on {k} of the last {n} days.", "Will {s} be late tomorrow?"),
    "win": ("The {s} won {k} of their last {n} games.", "Will the {s} win their next game?"),
    "bus": ("The {s} bus was on time on {k} of the last {n} days.", "Will the {s} bus be on time tomorrow?"),
}
#: Subjects per kind of event (a place, a person, a team, a bus line).
SUBJECTS: dict[str, tuple[str, ...]] = {
    "rain": ("Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Denver", "Dublin", "Perth"),
    "late": ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Omar", "Zoe"),
    "win": ("Tigers", "Hawks", "Lions", "Bears", "Wolves", "Eagles", "Sharks", "Owls"),
    "bus": ("number 5", "number 9", "number 12", "number 21", "red", "blue", "night", "airport"),
}
SUFFIX = " Answer with only a probability between 0 and 1."


def forecast_questions(
    split: str = "train",
    size: int | None = None,
    kinds: tuple[str, ...] | list[str] = ("rain", "late", "win", "bus"),
    totals: tuple[int, ...] | list[int] = (10,),
    test_share: float = 0.2,
    seed: int = 0,
    instruction: str = SUFFIX,
) -> list[dict[str, Any]]:
    """``{"messages": [user question], "question", "outcome", "rate", "count", "total", "kind"}``
    rows for ``split`` in {train, test}: ``size`` rows (default 2000 train, 200 test) in a fixed
    order given ``seed``.

    Each row picks a kind (of ``kinds``, keys of :data:`TEMPLATES`), a subject, a total (of
    ``totals``) and a count uniform in 0..total; ``outcome`` is 1 with probability
    ``rate = count / total``, drawn from the same seeded generator. The test split's rows
    reuse no training question's wording (see the module docs), though one question may recur
    within a split with different outcomes, as a real forecast would. ``instruction`` follows
    each question (the answer format asked for)."""
    if split not in ("train", "test"):
        raise ValueError(f"forecast_questions: split must be 'train' or 'test', got {split!r}")
    unknown = [k for k in kinds if k not in TEMPLATES]
    if unknown or not kinds:
        raise ValueError(f"forecast_questions: unknown kinds {unknown}; choose from {sorted(TEMPLATES)}")
    if not totals or any(int(n) < 1 for n in totals):
        raise ValueError(f"forecast_questions: totals must be whole numbers >= 1, got {list(totals)}")
    if not 0 < test_share < 1:
        raise ValueError(f"forecast_questions: test_share must be in (0, 1), got {test_share}")
    want = size if size is not None else (2000 if split == "train" else 200)
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(want * 50):  # the split's share of questions is drawn by rejection; bounded
        if len(rows) >= want:
            break
        kind = kinds[rng.randrange(len(kinds))]
        subject = SUBJECTS[kind][rng.randrange(len(SUBJECTS[kind]))]
        total = int(totals[rng.randrange(len(totals))])
        count = rng.randint(0, total)
        outcome = int(rng.random() < count / total)  # drawn before the split test: splits share one stream
        if _in_test(kind, subject, count, total, test_share) != (split == "test"):
            continue
        history, ask = TEMPLATES[kind]
        question = f"{history} {ask}".format(s=subject, k=count, n=total) + instruction
        rows.append(
            {
                "messages": [{"role": "user", "content": question}],
                "question": question,
                "outcome": outcome,
                "rate": count / total,
                "count": count,
                "total": total,
                "kind": kind,
            }
        )
    return rows


def _in_test(kind: str, subject: str, count: int, total: int, share: float) -> bool:
    """Whether a question belongs to the test split: a stable hash of its wording's parts."""
    digest = hashlib.sha256(f"{kind}:{subject}:{count}:{total}".encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * 2**32
