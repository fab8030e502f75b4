"""The ``math_preferences`` dataset: DPO pairs on ``math_questions`` (examples/real_models/smollm2_dpo.yaml)."""

from __future__ import annotations

import re

import pytest

from tempering.plugins.datasets.math_preferences import math_preferences
from tempering.plugins.datasets.math_questions import math_questions


def test_pairs_keep_the_questions_split_and_answers() -> None:
    for split in ("train", "test"):
        pairs, questions = math_preferences(split, size=60), math_questions(split, size=60)
        assert [p["prompt"] for p in pairs] == [q["question"] for q in questions]
        assert all(p["chosen"] == p["answer"] == q["answer"] for p, q in zip(pairs, questions))
    train = {p["prompt"] for p in math_preferences("train")}
    assert not train & {p["prompt"] for p in math_preferences("test")}


def test_each_rejected_kind() -> None:
    mixed = math_preferences("test", size=30)
    assert [p["rejected_kind"] for p in mixed[:3]] == ["wrong", "verbose", "restated_wrong"]
    for p in mixed:
        a, b = re.findall(r"\d+", p["prompt"])[:2]
        if p["rejected_kind"] == "wrong":
            assert p["rejected"].isdigit() and p["rejected"] != p["answer"]
        elif p["rejected_kind"] == "verbose":
            assert p["rejected"].startswith(f"{a} ") and p["rejected"].endswith(f"answer is {p['answer']}.")
        else:
            left, right = p["rejected"].split(" = ")
            assert left.split()[::2] == [a, b] and right != p["answer"]
    assert {p["rejected_kind"] for p in math_preferences("test", size=10, rejected="verbose")} == {"verbose"}
    with pytest.raises(ValueError, match="rejected must be one of"):
        math_preferences(rejected="long")
