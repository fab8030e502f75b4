"""Sampler-side records for ``stable_reinforce``: what the server sampled, kept by
``sequence_id`` when a sampling request asks for ``record_stability_info``, and matched back to
a training datum through its provenance (``Datum.with_provenance``).

Tinker's documentation states the contract, which this module keeps: a recorded sequence
belongs to the session that sampled it and can be trained on for one day after sampling (each
training request that uses it restarts the day); a datum for ``stable_reinforce`` names the
sampled sequence behind every position (``PromptProvenanceSpan`` / ``SampledProvenanceSpan``
runs tiling its targets). What the loss then uses is the server's own logprob of each sampled
token -- the numbers it sampled with, not whatever the client sends back as ``logprobs``.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Recorded", "StabilityRecords", "session_of", "DAY_SECONDS"]

DAY_SECONDS = 24 * 3600


def session_of(identifier: str) -> str:
    """The client session an id belongs to: every id this server hands out starts with it
    (``<session>:train:<n>``, ``<session>:sample:<n>:<seq>:<i>``)."""
    return identifier.split(":", 1)[0]


@dataclass
class Recorded:
    """One sampled sequence: its prompt, tokens and the sampler's logprob of each token."""

    session: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    used: float = field(default_factory=time.monotonic)


class StabilityRecords:
    """Recorded sequences by ``sequence_id``, at most ``capacity`` (oldest dropped first) and
    none older than ``ttl_seconds`` since its last use."""

    def __init__(self, capacity: int = 200_000, ttl_seconds: float = DAY_SECONDS) -> None:
        self.capacity, self.ttl_seconds = capacity, ttl_seconds
        self._records: OrderedDict[str, Recorded] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def record(self, sequence_id: str, prompt: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float]) -> None:
        with self._lock:
            self._records[sequence_id] = Recorded(
                session_of(sequence_id), list(prompt), list(tokens), [float(x) for x in logprobs]
            )
            while len(self._records) > self.capacity:
                self._records.popitem(last=False)

    def drop_session(self, session: str) -> int:
        """Forget a finished session's records (only that session may train on them); returns
        how many."""
        with self._lock:
            gone = [sid for sid, rec in self._records.items() if rec.session == session]
            for sid in gone:
                del self._records[sid]
        return len(gone)

    def get(self, sequence_id: str, session: str) -> Recorded:
        """The record, its day restarted; a :class:`ValueError` says why there is none."""
        with self._lock:
            rec = self._records.get(sequence_id)
            if rec is not None and time.monotonic() - rec.used > self.ttl_seconds:
                del self._records[sequence_id]
                rec = None
            if rec is None:
                raise ValueError(
                    f"no recorded sequence {sequence_id!r}: sample with record_stability_info=True "
                    "(and train on it within a day, from the same server process)"
                )
            if rec.session != session:
                raise ValueError(
                    f"sequence {sequence_id!r} was sampled in session {rec.session!r}, not this run's "
                    f"session {session!r}: sample and train in the same session"
                )
            rec.used = time.monotonic()
            return rec

    def sampler_logprobs(
        self, datum: Any, targets: Sequence[int], session: str, needed: Sequence[bool] | None = None
    ) -> list[float | None]:
        """The recorded logprob of each target position (None where the position is a prompt
        token, which no sampler scored), after checking the datum's provenance: present, tiling
        its targets, each sampled run's tokens equal to what was recorded, and each prompt run's
        tokens where ``needed`` (positions the loss uses: advantage non-zero; all when None).
        The cookbook's own ``rl_loop`` puts 0s at the prompt positions it gives advantage 0,
        so those are not compared: they cannot change the loss."""
        spans = datum.loss_fn_input_spans
        if not spans:
            raise ValueError(
                "stable_reinforce needs provenance on every datum (Datum.with_provenance naming the "
                "sampled sequence behind each position)"
            )
        if sum(s.length for s in spans) != len(targets):
            raise ValueError(
                f"loss_fn_input_spans cover {sum(s.length for s in spans)} positions, target_tokens {len(targets)}"
            )
        out: list[float | None] = []
        for span in spans:
            rec = self.get(span.sequence_id, session)
            sampled = type(span).__name__ == "SampledProvenanceSpan"
            source = rec.tokens if sampled else rec.prompt
            pos = len(out)
            expected = source[span.offset : span.offset + span.length]
            given = list(targets[pos : pos + span.length])
            compared = [i for i in range(span.length) if sampled or needed is None or needed[pos + i]]
            if len(expected) != span.length or any(given[i] != expected[i] for i in compared):
                kind = "sampled tokens" if sampled else "prompt"
                raise ValueError(
                    f"target_tokens[{pos}:{pos + span.length}] differ from the {kind} of sequence "
                    f"{span.sequence_id!r} at offset {span.offset}"
                    + ("" if sampled else " (at positions with a non-zero advantage)")
                )
            out.extend(rec.logprobs[span.offset : span.offset + span.length] if sampled else [None] * span.length)
        return out
