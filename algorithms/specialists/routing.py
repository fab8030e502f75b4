"""Routing and per-domain scoring, for any set of domains: which specialist answers a question,
how often a router picks the right one, and what a routed system scores.

Rows are dataset rows with a ``domain`` key. A router's choice is a domain name, or ``None``
when it named none (a misroute: the routed system scores 0 on that question).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def balanced_union(per_domain: Mapping[str, Sequence[Mapping[str, Any]]], seed: int = 0) -> list[dict[str, Any]]:
    """Every domain repeated up to the largest one's size, so that an epoch over the union (and
    hence, in expectation, every batch) is an equal share of each domain: a generalist then sees
    as many samples of a domain as that domain's specialist."""
    target = max(len(rows) for rows in per_domain.values())
    out: list[dict[str, Any]] = []
    rng = random.Random(seed)
    for rows in per_domain.values():
        copies = [dict(r) for r in rows]
        reps, rest = divmod(target, len(copies))
        out += copies * reps + rng.sample(copies, rest)
    return out


def router_rows(rows: Iterable[Mapping[str, Any]], prefix: str) -> list[dict[str, str]]:
    """A model router's SFT data: ``prefix + question`` -> the domain's name."""
    return [{"prompt": prefix + r["prompt"], "answer": r["domain"]} for r in rows]


def parse_domain(answer: str, domains: Sequence[str]) -> str | None:
    """A model router's answer -> a domain, or None if it named none (counted as a misroute)."""
    text = answer.strip().lower()
    return text if text in domains else None


def accuracy(
    routes: Sequence[str | None], rows: Sequence[Mapping[str, Any]], domains: Sequence[str]
) -> dict[str, float]:
    """Share of rows routed to their own domain, overall and per domain."""
    if len(routes) != len(rows):
        raise ValueError(f"{len(routes)} routes for {len(rows)} rows")
    out: dict[str, float] = {}
    for d in domains:
        idx = [i for i, r in enumerate(rows) if r["domain"] == d]
        out[d] = sum(routes[i] == d for i in idx) / len(idx) if idx else float("nan")
    out["overall"] = sum(p == r["domain"] for p, r in zip(routes, rows)) / max(len(rows), 1)
    return out


def confusion(
    routes: Iterable[str | None], rows: Iterable[Mapping[str, Any]], domains: Sequence[str]
) -> dict[str, dict[str, int]]:
    """true domain -> predicted domain (or ``none``) -> count."""
    out = {d: {p: 0 for p in (*domains, "none")} for d in domains}
    for p, r in zip(routes, rows):
        out[r["domain"]][p or "none"] += 1
    return out


def per_domain(correct: Sequence[float], rows: Sequence[Mapping[str, Any]], domains: Sequence[str]) -> dict[str, float]:
    """Accuracy per domain; ``overall`` the mean over questions, ``macro`` the mean over domains."""
    out = {}
    for d in domains:
        idx = [i for i, r in enumerate(rows) if r["domain"] == d]
        out[d] = sum(correct[i] for i in idx) / len(idx) if idx else float("nan")
    out["overall"] = sum(correct) / max(len(correct), 1)
    out["macro"] = sum(out[d] for d in domains) / len(domains)
    return out


def routed(choice: Sequence[str | None], correct_by_model: Mapping[str, Sequence[float]]) -> list[float]:
    """For each question, the correctness of the specialist chosen for it (0 if none)."""
    return [correct_by_model[c][i] if c is not None and c in correct_by_model else 0.0 for i, c in enumerate(choice)]


def first_domain_named(answer: str, domains: Sequence[str]) -> str | None:
    """An untrained router's answer -> the domain it names first (its name without a plural
    ``s``, any case: "Units." and "unit conversion" both name ``units``), or None."""
    text = answer.lower()
    found = [(text.find(d.lower().rstrip("s")), d) for d in domains]
    named = [(i, d) for i, d in found if i >= 0]
    return min(named)[1] if named else None
