"""Writes ``data/capitals_{train,test}.jsonl`` for the SFT-vs-SDFT recipes: ``python make_capitals.py``.

The new skill is a fixed answer format: "What is the capital of France?" answered as the JSON
``{"capital": "Paris"}`` (the question does not ask for JSON; the demonstrations show it). The
countries are the ``capital_questions`` dataset's ``countries.csv`` (100), split 70 / 30 by a seeded
shuffle, so the held-out countries are never demonstrated. Rows: ``prompt``, ``demonstration``
and ``answer`` (= the demonstration, for ``exact_match``), ``capital``.
"""

from __future__ import annotations

import json
import os
import random

from tempering.plugins.datasets.domain_questions import read_countries

HERE = os.path.dirname(os.path.abspath(__file__))
TEST_SIZE = 30


def rows() -> list[dict[str, str]]:
    pairs = read_countries()
    random.Random(0).shuffle(pairs)
    return [
        {
            "prompt": f"What is the capital of {country}?",
            "demonstration": json.dumps({"capital": capital}),
            "answer": json.dumps({"capital": capital}),
            "capital": capital,
        }
        for country, capital in pairs
    ]


def main() -> None:
    data = rows()
    os.makedirs(os.path.join(HERE, "data"), exist_ok=True)
    for split, part in (("test", data[:TEST_SIZE]), ("train", data[TEST_SIZE:])):
        with open(os.path.join(HERE, "data", f"capitals_{split}.jsonl"), "w", encoding="utf-8") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in part)


if __name__ == "__main__":
    main()
