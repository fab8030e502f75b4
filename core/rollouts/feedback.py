"""Feedback: what a reward or an environment says about an attempt, in words.

A scalar reward says *how good* an attempt was; when almost every attempt scores 0 it tells a
learner little. Feedback says *why*: ``expected '42', got '41'``, a tool's exception, a failing
test, a judge's critique. It ends up in :attr:`tempering.types.Sample.feedback` -- the text a
self-distillation teacher (SDPO) is re-prompted with -- in ``rollouts.jsonl`` (``feedback``)
and in ``tempering view``.

Where it comes from:

* a **reward** returns ``RewardResult(reward, info, feedback="...")``, a mapping with a
  ``"feedback"`` key beside ``"reward"``, or a :class:`Scored` float (for a reward whose
  callers use its return as a number: it stays one). The reward runner appends it to the
  sample's feedback (:func:`feedback_of`, :func:`join_feedback`); ``weighted`` joins its parts';
* an **environment**: each turn's failed tool calls (``StepResult.errors``, which name the tool:
  ``tool mul raised ValueError: ...``, ``tool mul timed out after 5s``) and its
  ``StepResult.feedback``, joined over the episode in order, then the group reward's and the
  stage reward's feedback when they score the episode.

Every part is clipped to :data:`MAX_CHARS` (a reward must never hand back a whole completion);
parts are joined one per line. ``None`` means nothing was said.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: The longest one part of feedback may be (longer text is cut, ending in "...").
MAX_CHARS = 500
#: The longest a quoted value (what a completion answered) may be inside a feedback text.
QUOTE_CHARS = 80
#: The key of a reward's mapping return that holds its feedback.
FEEDBACK_KEY = "feedback"


class Scored(float):
    """A reward value that is a float -- equal to, added and compared as the number -- and
    also carries ``feedback``. For rewards whose callers use the return value directly as a
    number (``float(exact_match(text, row))``): a :class:`~tempering.interfaces.RewardResult`
    would break them, this does not. Pickles with its feedback (process-pool rewards)."""

    feedback: str | None

    def __new__(cls, value: float, feedback: str | None = None) -> Scored:
        obj = super().__new__(cls, value)
        obj.feedback = feedback
        return obj

    def __repr__(self) -> str:
        return f"Scored({float(self)!r}, feedback={self.feedback!r})"


def clip(text: str, limit: int = MAX_CHARS) -> str:
    """``text`` cut to at most ``limit`` characters (ending in ``...`` when cut)."""
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """``value`` as text, clipped to ``limit`` characters and quoted as Python would
    (``'41'``): a feedback text shows what was answered, never a whole completion."""
    return repr(clip(str(value), limit))


def mismatch(expected: object, got: object) -> str:
    """The feedback of a wrong answer: ``expected '42', got '41'`` (``got nothing`` for an
    empty answer); both sides clipped (:func:`quote`)."""
    shown = quote(got) if str(got).strip() else "nothing"
    return f"expected {quote(expected)}, got {shown}"


def feedback_of(value: object, who: str = "reward") -> str | None:
    """The feedback a reward's (or an environment's) return carries: a mapping's ``"feedback"``
    key, else a ``feedback`` attribute (:class:`~tempering.interfaces.RewardResult`,
    :class:`Scored`, :class:`~tempering.rollouts.environment.StepResult`), else ``None``. Empty text is
    ``None``; anything but text raises ``TypeError`` naming ``who`` and the type."""
    if isinstance(value, Mapping):
        text = value.get(FEEDBACK_KEY)
    else:
        text = getattr(value, FEEDBACK_KEY, None)
    if text is None:
        return None
    if not isinstance(text, str):
        raise TypeError(
            f"{who} returned feedback {clip(repr(text), 60)} of type {type(text).__name__}, not text or None"
        )
    text = text.strip()
    return clip(text) if text else None


def join_feedback(parts: Iterable[str | None]) -> str | None:
    """The parts that say something (each clipped to :data:`MAX_CHARS`), one per line, in
    order; ``None`` when none does."""
    kept = [clip(p.strip()) for p in parts if p and p.strip()]
    return "\n".join(kept) if kept else None
