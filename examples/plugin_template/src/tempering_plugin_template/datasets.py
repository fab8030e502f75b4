"""A dataset: what a dataset factory returns, in the three shapes tempering's stages read.

``unit_questions`` is registered as a function: its parameters are its config keys, and it
returns a list of dicts, one per example (``dataset: {name: unit_questions, kind: transcripts}``).
Rows are generated from ``seed``, so nothing is downloaded, and every text is lower case so the
tiny in-code chat model's character tokenizer can hold it.

- ``kind: tasks``: ``{"question", "answer"}`` rows for the ``unit_converter`` environment (RL:
  ``sampler: {name: environment, environment: unit_converter}``).
- ``kind: transcripts``: SFT transcripts of the solution, in the OpenAI chat format: the user's
  question, an assistant turn whose ``tool_calls`` call ``convert`` (``arguments`` a JSON
  *string*), the ``tool`` message answering it (``tool_call_id`` = the call's ``id``, ``name``
  = the tool's), the final answer; plus ``tools``, the tool specs an episode offers, taken from
  the environment so that SFT renders the same tokens an RL episode would.
- ``kind: pairs``: multi-turn DPO pairs: the shared history in ``messages`` (+ ``tools``), and
  ``chosen`` / ``rejected`` continuations, each a list of messages starting with an assistant
  turn: the right ``convert`` call over one with the units swapped.
"""

from __future__ import annotations

import json
import random
from typing import Any

from tempering_plugin_template.environments import METRES, UnitConverter

UNITS = ("mm", "cm", "m", "km")


def unit_questions(kind: str = "tasks", size: int = 64, seed: int = 0) -> list[dict[str, Any]]:
    """``size`` length-conversion examples as ``kind`` rows: tasks, transcripts or pairs."""
    if kind not in ("tasks", "transcripts", "pairs"):
        raise ValueError(f"unit_questions: kind must be tasks, transcripts or pairs, got '{kind}'")
    if size < 1:
        raise ValueError(f"unit_questions: size must be >= 1, got {size}")
    rng = random.Random(seed)
    rows = []
    for _ in range(size):
        unit, to = rng.sample(UNITS, 2)
        value = rng.randint(1, 9)
        answer = f"{value * METRES[unit] / METRES[to]:g}"
        task = {"question": f"how many {to} is {value} {unit}?", "answer": answer}
        if kind == "tasks":
            rows.append(task)
        elif kind == "transcripts":
            rows.append(transcript(task, value, unit, to))
        else:
            rows.append(pair(task, value, unit, to))
    return rows


def tool_specs() -> list[dict[str, Any]]:
    """The environment's tool specs (``{"type": "function", "function": {name, description,
    parameters}}``), exactly as an episode offers them."""
    return [t.spec() for t in UnitConverter().tools()]


def call(value: int, unit: str, to: str, call_id: str = "call_0_0") -> dict[str, Any]:
    """One OpenAI tool call: ``arguments`` is a JSON string, not a dict."""
    args = json.dumps({"value": value, "unit": unit, "to": to})
    return {"id": call_id, "type": "function", "function": {"name": "convert", "arguments": args}}


def transcript(task: dict[str, Any], value: int, unit: str, to: str) -> dict[str, Any]:
    result = UnitConverter().convert(value, unit, to)
    return {
        "messages": [
            {"role": "user", "content": task["question"]},
            {"role": "assistant", "content": "", "tool_calls": [call(value, unit, to)]},
            {"role": "tool", "tool_call_id": "call_0_0", "name": "convert", "content": result},
            {"role": "assistant", "content": task["answer"]},
        ],
        "tools": tool_specs(),
    }


def pair(task: dict[str, Any], value: int, unit: str, to: str) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": task["question"]}],
        "tools": tool_specs(),
        "chosen": [{"role": "assistant", "content": "", "tool_calls": [call(value, unit, to)]}],
        "rejected": [{"role": "assistant", "content": "", "tool_calls": [call(value, to, unit)]}],
    }
