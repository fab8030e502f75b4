"""A two-skill toy task for SDFT on a character-level tiny model (tests and the example).

Skills over strings of ``letters`` (default ``abcdefgh``), lengths ``min_len..max_len``:

* ``reverse``: ``"R abcd="`` -> ``"dcba"``;
* ``shift``:   ``"S abcd="`` -> ``"bcde"`` (each letter moves one step on, cyclically);
* ``copy``:    ``"C abcd="`` -> ``"abcd"``;
* ``map``:     ``"M 0312="`` -> ``"adbc"`` (digit ``i`` spelt as the ``i``-th letter; inputs are digits);
* ``hint``: ``"{hint}|{T} {x}="`` -> ``"{hint}"`` for a random task letter ``T``, string ``x``
  and an unrelated random ``hint``: *in-context copying*.

Why ``hint``: SDFT's teacher is the model conditioned on a demonstration, so it needs the
in-context ability to use one; a pretrained LLM has it, a 100k-parameter model trained from
scratch does not. Pretraining on ``hint`` rows gives the toy model exactly that ability --
"if the context starts with an answer, give it" -- in the format of the teacher template
``"{demonstration}|{prompt}"`` (:data:`TOY_TEACHER_TEMPLATE`). Every row also carries
``demonstration`` (= ``answer``), so skill rows are SDFT rows as they are.

Strings are split into train and test by a hash of the string, so test strings are never
trained on. Use :data:`TOY_CHARS` as the tiny model's ``chars``.
"""

from __future__ import annotations

import random
import zlib
from typing import Any

TOY_LETTERS = "abcdefgh"
TOY_DIGITS = "01234567"
TOY_CHARS = TOY_LETTERS + TOY_DIGITS + "RSCM|=! "
TOY_TEACHER_TEMPLATE = "{demonstration}|{prompt}"
SKILLS = {"reverse": "R", "shift": "S", "copy": "C", "map": "M"}


def _answer(skill: str, x: str, letters: str) -> str:
    if skill == "reverse":
        return x[::-1]
    if skill == "shift":
        return "".join(letters[(letters.index(c) + 1) % len(letters)] for c in x)
    if skill == "copy":
        return x
    if skill == "map":
        return "".join(letters[TOY_DIGITS.index(c)] for c in x)
    raise ValueError(f"toy_skills: unknown skill '{skill}'; use one of {sorted(SKILLS)} or 'hint'")


def _is_test(x: str, test_frac: float) -> bool:
    return (zlib.crc32(x.encode()) % 1000) < test_frac * 1000


def toy_skills(
    skill: str = "reverse",
    split: str = "train",
    size: int = 1000,
    min_len: int = 3,
    max_len: int = 5,
    letters: str = TOY_LETTERS,
    test_frac: float = 0.2,
    seed: int = 0,
    demo_suffix: str = "",
    hint_letters: str | None = None,
) -> list[dict[str, Any]]:
    """``size`` rows ``{"prompt", "answer", "demonstration", "skill"}`` of ``skill`` (one of
    ``reverse``, ``shift``, ``copy``, ``map``, ``hint``) from ``split`` (``train`` or ``test``).

    ``demo_suffix`` is the demonstrator's style: ``demonstration = answer + demo_suffix``, and
    ``hint`` rows show their hint in that style while their answer is the bare hint.
    ``hint_letters`` is the alphabet of hints (default ``letters``)."""
    if split not in ("train", "test"):
        raise ValueError(f"toy_skills: split must be 'train' or 'test', got '{split}'")
    if skill != "hint" and skill not in SKILLS:
        raise ValueError(f"toy_skills: unknown skill '{skill}'; use one of {sorted(SKILLS)} or 'hint'")
    rng = random.Random(f"{seed}-{skill}-{split}")
    want_test = split == "test"

    source = TOY_DIGITS if skill == "map" else letters

    def draw() -> str:
        while True:
            x = "".join(rng.choice(source) for _ in range(rng.randint(min_len, max_len)))
            if _is_test(x, test_frac) == want_test:
                return x

    rows = []
    for _ in range(size):
        x = draw()
        if skill == "hint":
            hint = "".join(rng.choice(hint_letters or letters) for _ in range(rng.randint(min_len, max_len)))
            task = rng.choice(sorted(SKILLS.values()))
            prompt = TOY_TEACHER_TEMPLATE.format(demonstration=hint + demo_suffix, prompt=f"{task} {x}=")
            answer = hint
        else:
            prompt, answer = f"{SKILLS[skill]} {x}=", _answer(skill, x, letters)
        rows.append({"prompt": prompt, "answer": answer, "demonstration": answer + demo_suffix, "skill": skill})
    return rows


def toy_mixture(
    skills: dict[str, int] | None = None, split: str = "train", seed: int = 0, **kwargs: Any
) -> list[dict[str, Any]]:
    """Rows of several skills, e.g. ``{reverse: 1000, hint: 1000}`` (shuffled together). A
    name ``skill@alphabet`` draws its strings from ``alphabet`` (for ``hint``: its hints, e.g.
    ``hint@01234567``)."""
    skills = dict(skills or {"reverse": 1000, "hint": 1000})
    rows = []
    for name, n in skills.items():
        skill, _, alphabet = name.partition("@")
        extra = {("hint_letters" if skill == "hint" else "letters"): alphabet} if alphabet else {}
        rows += toy_skills(skill, split, n, seed=seed, **{**kwargs, **extra})
    random.Random(f"{seed}-mix").shuffle(rows)
    return rows
