"""The ``tool_calls`` and ``next_number`` datasets (the ``smollm2_sdft`` recipes' new and prior skills)."""

from __future__ import annotations

import re

import pytest

from tempering.plugins.datasets.tool_calls import next_number, tool_calls

CALL = re.compile(r'^(weather\(city="[A-Z][a-z]+"\)|timer\(minutes=\d+\)|call\(name="[A-Z][a-z]+"\))$')


def argument(call: str) -> str:
    return call.split("=", 1)[1].rstrip(")")


def test_tool_calls_are_one_canonical_call_and_held_out_arguments_are_never_demonstrated() -> None:
    train, test = tool_calls("train"), tool_calls("test")
    assert (len(train), len(test)) == (261, 144)
    for row in train + test:
        assert CALL.match(row["demonstration"]) and row["answer"] == row["demonstration"]
        assert row["prompt"].startswith("Tools: weather(city), timer(minutes), call(name).\nRequest: ")
        assert row["demonstration"].startswith(row["tool"] + "(")
        assert argument(row["demonstration"]).strip('"') in row["prompt"]  # the argument is in the request
        assert "messages" not in row  # an SFT stage would read it as a whole transcript
    seen = {(r["tool"], argument(r["demonstration"])) for r in train}
    assert not seen & {(r["tool"], argument(r["demonstration"])) for r in test}
    assert {r["tool"] for r in test} == {"weather", "timer", "call"}
    assert tool_calls("test", size=5, seed=3) == tool_calls("test", size=5, seed=3) != tool_calls("test", size=5)


def test_next_number_asks_for_the_successor_and_splits_are_disjoint() -> None:
    test, train = next_number("test", size=None), next_number("train", size=None)
    assert len(test) == 200
    for row in test:
        (n,) = map(int, re.findall(r"\d+", row["question"]))
        assert row["answer"] == str(n + 1) and 10 <= n <= 999
        assert row["messages"] == [{"role": "user", "content": row["question"]}]
    numbers = lambda rows: {int(re.findall(r"\d+", r["question"])[0]) for r in rows}
    assert not numbers(test) & numbers(train)


def test_bad_split_is_named() -> None:
    with pytest.raises(ValueError, match="tool_calls: split must be 'train' or 'test'"):
        tool_calls("dev")
    with pytest.raises(ValueError, match="next_number: split must be"):
        next_number("dev")
