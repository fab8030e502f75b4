"""Filtering the rollouts browser's records (server-side: a long run's ``rollouts.jsonl`` has
tens of thousands of lines, the page shows one page of them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from tempering.errors import ConfigError

FAILED_CHOICES = ("any", "yes", "no")
NUMBERS = {"step_min": float, "step_max": float, "reward_min": float, "reward_max": float, "offset": int, "limit": int}


@dataclass
class RolloutQuery:
    """What the browser's filter bar asks for; empty means "no filter"."""

    stage: str = ""
    kind: str = ""  # train | eval
    step_min: float | None = None
    step_max: float | None = None
    reward_min: float | None = None
    reward_max: float | None = None
    failed: str = "any"  # any | yes | no
    cause: str = ""
    text: str = ""  # a substring of the prompt, transcript, completion, error or feedback (case-insensitive)
    offset: int = 0
    limit: int = 50

    @classmethod
    def from_params(cls, params: Mapping[str, Sequence[str]]) -> RolloutQuery:
        """From a URL's query (``urllib.parse.parse_qs``); a bad value is a ConfigError
        naming the parameter."""
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            values = params.get(f.name)
            if not values or values[0] == "":
                continue
            raw = values[0]
            try:
                kwargs[f.name] = NUMBERS[f.name](raw) if f.name in NUMBERS else raw
            except ValueError:
                raise ConfigError(f"expected a number, got '{raw}'", f.name) from None
        query = cls(**kwargs)
        if query.failed not in FAILED_CHOICES:
            raise ConfigError(f"use one of {', '.join(FAILED_CHOICES)} (got '{query.failed}')", "failed")
        query.limit = max(1, min(query.limit, 500))
        query.offset = max(0, query.offset)
        return query

    def matches(self, r: Mapping[str, Any]) -> bool:
        if self.stage and r.get("stage") != self.stage:
            return False
        if self.kind and r.get("kind") != self.kind:
            return False
        if not _within(r.get("step"), self.step_min, self.step_max):
            return False
        if (self.reward_min is not None or self.reward_max is not None) and not _within(
            r.get("reward"), self.reward_min, self.reward_max
        ):
            return False
        if self.failed != "any" and bool(r.get("failed")) != (self.failed == "yes"):
            return False
        if self.cause and r.get("failure") != self.cause:
            return False
        return not self.text or self.text.lower() in searchable(r)


def _within(value: object, low: float | None, high: float | None) -> bool:
    if low is None and high is None:
        return True
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False  # a failed sample's reward text ("nan") matches no range
    return (low is None or value >= low) and (high is None or value <= high)


def searchable(r: Mapping[str, Any]) -> str:
    """The text a search looks in: prompt, every message, the completion, the error and the
    feedback."""
    parts = [str(r.get(k) or "") for k in ("prompt", "completion", "error", "feedback")]
    for m in r.get("messages") or []:
        parts.append(str(m.get("content") or ""))
        parts += [str(c) for c in m.get("tool_calls") or []]
    return "\n".join(parts).lower()


def run_query(records: Sequence[Mapping[str, Any]], query: RolloutQuery) -> dict[str, Any]:
    """One page of matching records, newest step first, with the total count and the values
    the filter bar offers (stages, kinds, failure causes, the step range)."""
    hits = [r for r in records if query.matches(r)]
    hits.sort(
        key=lambda r: (-(r.get("step") or 0), r.get("kind") != "train", r.get("group") or 0, r.get("sample") or 0)
    )
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    return {
        "total": len(hits),
        "offset": query.offset,
        "records": hits[query.offset : query.offset + query.limit],
        "facets": {
            "stages": list(dict.fromkeys(str(r.get("stage", "")) for r in records)),  # run order
            "kinds": sorted({str(r.get("kind", "")) for r in records}),
            "causes": sorted({str(r["failure"]) for r in records if r.get("failure")}),
            "steps": [min(steps), max(steps)] if steps else [],
        },
    }
