"""The ``forecast_questions`` dataset (issue 36 item 3): deterministic, splits disjoint in
wording, and outcomes drawn at exactly the stated rate, so the best forecast is known."""

from __future__ import annotations

import math
from collections import defaultdict

import pytest

from tempering.plugins.datasets.forecast_questions import forecast_questions
from tempering.registry import get_registry


def test_rows_are_deterministic_and_hold_the_process() -> None:
    rows = forecast_questions("train", size=50, seed=3)
    assert rows == forecast_questions("train", size=50, seed=3)
    assert rows != forecast_questions("train", size=50, seed=4)
    assert len(rows) == 50 and len(forecast_questions("test")) == 200 and len(forecast_questions()) == 2000
    for r in rows:
        assert r["rate"] == r["count"] / r["total"] and r["outcome"] in (0, 1)
        assert f"{r['count']} of the" in r["question"] and f"last {r['total']}" in r["question"]
        assert r["messages"] == [{"role": "user", "content": r["question"]}]
        assert r["question"].endswith("Answer with only a probability between 0 and 1.")
    assert {r["total"] for r in forecast_questions(size=200, totals=(10, 20))} == {10, 20}
    hinted = forecast_questions("train", size=50, seed=3, instruction=" Say 0.3 for 3 of 10.")
    assert [h["question"] for h in hinted] == [
        r["question"].replace(" Answer with only a probability between 0 and 1.", " Say 0.3 for 3 of 10.") for r in rows
    ]


def test_train_and_test_never_share_a_question() -> None:
    train = {r["question"] for r in forecast_questions("train", size=2000)}
    test = {r["question"] for r in forecast_questions("test", size=400)}
    assert train and test and not train & test
    assert len(test) > 40  # varied: not one question repeated


def test_outcomes_happen_at_the_stated_rate() -> None:
    """Per stated rate, the share of outcomes that happened is within 4 standard errors of it
    (a fixed seed: the test is deterministic); counts are spread over 0..10, so the best Brier
    (always saying the rate) is mean r(1 - r) = 0.15 against the base rate's 0.25."""
    rows = forecast_questions("train", size=20_000, seed=1)
    by_rate: dict[float, list[int]] = defaultdict(list)
    for r in rows:
        by_rate[r["rate"]].append(r["outcome"])
    assert sorted(by_rate) == [k / 10 for k in range(11)]
    for rate, outcomes in by_rate.items():
        assert len(outcomes) > 1200, rate  # about 20000/11 each: balanced
        share = sum(outcomes) / len(outcomes)
        assert abs(share - rate) <= 4 * math.sqrt(rate * (1 - rate) / len(outcomes)) + 1e-12, (rate, share)
    assert sum(r["rate"] * (1 - r["rate"]) for r in rows) / len(rows) == pytest.approx(0.15, abs=0.005)
    assert sum(r["outcome"] for r in rows) / len(rows) == pytest.approx(0.5, abs=0.015)


def test_registered_and_bad_input_is_one_line() -> None:
    rows = get_registry().build("dataset", {"name": "forecast_questions", "split": "test", "size": 3}, "dataset")
    assert rows == forecast_questions("test", size=3)
    for kwargs, message in [
        ({"split": "dev"}, "split must be 'train' or 'test'"),
        ({"kinds": ["snow"]}, "unknown kinds \\['snow'\\]"),
        ({"totals": [0]}, "totals must be whole numbers >= 1"),
        ({"test_share": 1.0}, "test_share must be in \\(0, 1\\)"),
    ]:
        with pytest.raises(ValueError, match=message):
            forecast_questions(**kwargs)
