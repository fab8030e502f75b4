"""The ``sdpo`` stage's config blocks from TRL-style flat names, for the tests.

The tests compare against TRL's ``SDPOConfig``, whose keys are flat (``distillation_mode``,
``reprompt_template``, ...). The stage takes them in three blocks (``distillation:``,
``reprompt:``, ``stale:``); :func:`sdpo_keys` nests a flat mapping the way the stage's
``moved_keys`` says, so a test can keep one table of TRL-named cases, and :func:`term` builds
the self-distillation term from the same names (what a test of the teachers needs, without a
stage)."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from tempering.algorithms.sdpo.context import Reprompt
from tempering.algorithms.sdpo.distillation import Distillation, SelfDistillation, distillation, reprompt
from tempering.training.stale import Staleness

DISTILLATION_KEYS = frozenset(f.name for f in fields(Distillation))
REPROMPT_KEYS = frozenset(f.name for f in fields(Reprompt))
STALE_KEYS = frozenset(f.name for f in fields(Staleness))


def block_of(key: str) -> tuple[str, str] | None:
    """``(block, key in it)`` for a flat name, None for a key of the stage itself."""
    if key.startswith("distillation_") and key.removeprefix("distillation_") in DISTILLATION_KEYS:
        return "distillation", key.removeprefix("distillation_")
    if key in ("teacher", "ema_rate", "ema_every"):
        return "distillation", key
    if key in REPROMPT_KEYS:
        return "reprompt", key
    if key in STALE_KEYS:
        return "stale", key
    return None


def sdpo_keys(**flat: Any) -> dict[str, Any]:
    """The stage keys for ``flat``: each moved key in its block, the others as they are."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        where = block_of(key)
        if where is None:
            out[key] = value
        else:
            out.setdefault(where[0], {})[where[1]] = value
    return out


def term(stage_id: str = "", **flat: Any) -> SelfDistillation:
    """The self-distillation term of the ``distillation:`` / ``reprompt:`` keys in ``flat``,
    each block checked as the stage checks it."""
    blocks = sdpo_keys(**flat)
    unknown = set(blocks) - {"distillation", "reprompt"}
    if unknown:
        raise TypeError(f"not keys of the self-distillation term: {sorted(unknown)}")
    return SelfDistillation(
        distillation(blocks.get("distillation", {}), "distillation"),
        reprompt(blocks.get("reprompt", {}), "reprompt"),
        stage_id,
    )
