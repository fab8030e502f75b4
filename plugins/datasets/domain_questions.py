"""Unit conversions and capital cities asked in natural language, for instruct models: two of
the three domains of the ``smollm2_specialists`` recipe (the third is ``math_questions``).

Rows are ``{"prompt": question, "answer": reference}`` and every answer can be checked exactly.
The question ends with a reply instruction ("Reply with only the number.") so that a base
instruct model has a fair chance at an exact answer before any training.

* ``unit_conversions``: "How many grams are in 7 kilograms?" -> ``7000`` and back ("How many
  kilograms are 7000 grams?" -> ``7``), powers-of-ten conversions of length, mass and volume.
  A question's split is a stable hash of (pair, value, direction), as in ``math_questions``.
* ``capital_questions``: "What is the capital of France?" -> ``Paris`` from ``countries.csv``
  (100 countries). A capital is a fact a model knows or not, so the held-out split holds out
  *countries*: a test country is never asked in training, and the test measures what training
  does to recalling (and stating) facts the model learnt in pretraining.
"""

from __future__ import annotations

import csv
import hashlib
import random
from importlib import resources
from typing import Any

#: (small unit, big unit, big / small): every answer is an integer.
UNIT_PAIRS = (
    ("millimeters", "centimeters", 10),
    ("centimeters", "meters", 100),
    ("meters", "kilometers", 1000),
    ("grams", "kilograms", 1000),
    ("milligrams", "grams", 1000),
    ("milliliters", "liters", 1000),
)
NUMBER_SUFFIX = " Reply with only the number."
CITY_SUFFIX = " Reply with only the city name."
CAPITAL_TEMPLATES = (
    "What is the capital of {c}?",
    "Which city is the capital of {c}?",
    "Name the capital city of {c}.",
)
SPLITS = ("train", "test")


def _check_split(name: str, split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"{name}: split must be 'train' or 'test', got {split!r}")


def _in_test(key: str, share: float) -> bool:
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:4], "big") < share * 2**32


def unit_conversions(
    split: str = "train", size: int | None = None, high: int = 40, test_share: float = 0.2, seed: int = 0
) -> list[dict[str, Any]]:
    """Every conversion of a value in ``1..high`` big units (each pair, both ways) that falls in
    ``split`` (``test_share`` of them in test), shuffled with ``seed``; the first ``size``."""
    _check_split("unit_conversions", split)
    if high < 1:
        raise ValueError(f"unit_conversions: high must be >= 1, got {high}")
    rows = []
    for small, big, factor in UNIT_PAIRS:
        for v in range(1, high + 1):
            for direction, question, answer in (
                ("down", f"How many {small} are in {v} {big}?", v * factor),
                ("up", f"How many {big} are {v * factor} {small}?", v),
            ):
                if _in_test(f"{small}:{big}:{v}:{direction}", test_share) == (split == "test"):
                    rows.append({"prompt": question + NUMBER_SUFFIX, "answer": str(answer)})
    random.Random(seed).shuffle(rows)
    return rows[:size] if size is not None else rows


def read_countries() -> list[tuple[str, str]]:
    """(country, capital) pairs of the shipped ``countries.csv`` (100, each country once)."""
    text = resources.files(__package__).joinpath("countries.csv").read_text(encoding="utf-8")
    rows = [(r["country"].strip(), r["capital"].strip()) for r in csv.DictReader(text.splitlines())]
    if len({c for c, _ in rows}) != len(rows):
        raise ValueError("countries.csv: a country appears twice")
    return rows


def capital_questions(
    split: str = "train", size: int | None = None, test_countries: int = 40, seed: int = 0
) -> list[dict[str, Any]]:
    """Train: the countries not held out, each asked in every phrasing of
    :data:`CAPITAL_TEMPLATES`; test: ``test_countries`` others (a seeded draw), each asked in
    one phrasing. Shuffled with ``seed``; the first ``size``."""
    _check_split("capital_questions", split)
    countries = read_countries()
    if not 0 < test_countries < len(countries):
        raise ValueError(f"capital_questions: test_countries must be in 1..{len(countries) - 1}, got {test_countries}")
    order = list(countries)
    random.Random(20240808).shuffle(order)  # fixed: which countries are held out never depends on seed
    rng = random.Random(seed)
    if split == "test":
        rows = [
            {"prompt": CAPITAL_TEMPLATES[i % len(CAPITAL_TEMPLATES)].format(c=c) + CITY_SUFFIX, "answer": cap}
            for i, (c, cap) in enumerate(order[:test_countries])
        ]
    else:
        rows = [
            {"prompt": t.format(c=c) + CITY_SUFFIX, "answer": cap}
            for c, cap in order[test_countries:]
            for t in CAPITAL_TEMPLATES
        ]
    rng.shuffle(rows)
    return rows[:size] if size is not None else rows
