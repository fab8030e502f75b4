"""Routers: which specialist should answer a question?

* :func:`keyword_route` -- the baseline: a few regular expressions per domain, the domain with the
  most matches wins. No training.
* the model router -- a small model asked ``"domain of: <question>"`` that answers with the
  domain's name (the generalist, fine-tuned for a few SFT steps on domain labels; see
  ``experiment.build_router_recipe``). :func:`parse_domain` reads its answer.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence

from make_data import DOMAINS, ROUTER_PREFIX

from tempering.algorithms.specialists import routing

UNIT = r"(?:mm|cm|m|km|mg|g|kg|ml|l)"

#: Domain -> patterns; each pattern that matches the question is one vote.
KEYWORDS: dict[str, tuple[re.Pattern[str], ...]] = {
    "arithmetic": (
        re.compile(r"\d\s*[-+*/x]\s*\d"),  # 23+45, 7 x 8
        re.compile(r"\b(?:plus|minus|sum|add|times)\b", re.I),
    ),
    "units": (
        re.compile(rf"\d\s*{UNIT}\b"),  # 5 km, 5km
        re.compile(rf"\bin\s+{UNIT}\s*(?:=|\?|$)"),  # ... in m=
        re.compile(r"\b(?:convert|meters?|metres?|grams?|lit(?:er|re)s?|kilo\w*|milli\w*|centi\w*)\b", re.I),
    ),
    "capitals": (
        re.compile(r"\bcapital\b", re.I),
        re.compile(r"\b(?:city|country|seat of government)\b", re.I),
    ),
}

#: With no vote at all: a question with letters is most likely about a country, else arithmetic.
FALLBACK_TEXT, FALLBACK_SYMBOLS = "capitals", "arithmetic"


def keyword_votes(question: str) -> dict[str, int]:
    return {d: sum(bool(p.search(question)) for p in pats) for d, pats in KEYWORDS.items()}


def keyword_route(question: str) -> str:
    """The domain with the most keyword matches (ties: the first in ``DOMAINS`` order)."""
    votes = keyword_votes(question)
    best = max(votes.values())
    if best == 0:
        return FALLBACK_TEXT if re.search(r"[A-Za-z]{3,}", question) else FALLBACK_SYMBOLS
    return next(d for d in DOMAINS if votes[d] == best)


def router_prompt(question: str) -> str:
    """What the model router is asked (and trained on)."""
    return ROUTER_PREFIX + question


def parse_domain(answer: str) -> str | None:
    """The model router's answer -> a domain, or None if it named none (counted as a misroute)."""
    return routing.parse_domain(answer, DOMAINS)


def accuracy(routes: Sequence[str | None], rows: Sequence[Mapping[str, str]]) -> dict[str, float]:
    """Share of rows routed to their own domain, overall and per domain."""
    return routing.accuracy(routes, rows, DOMAINS)


def confusion(routes: Iterable[str | None], rows: Iterable[Mapping[str, str]]) -> dict[str, dict[str, int]]:
    """true domain -> predicted domain (or ``none``) -> count."""
    return routing.confusion(routes, rows, DOMAINS)


def route_all(questions: Iterable[str], route: Callable[[str], str | None] = keyword_route) -> list[str | None]:
    return [route(q) for q in questions]
