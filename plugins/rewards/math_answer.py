"""Numeric math answers: extract the model's final answer and compare it with the reference.

Extraction: the content of the last ``\\boxed{...}`` (nested braces allowed; ``\\fbox`` too),
else the last number in the text. Equivalence is numeric and exact (fractions, decimals,
``\\frac{a}{b}``, thousands separators, signs, percentages) up to ``abs_tol + rel_tol*|ref|``;
when either side is not a number, normalised strings are compared instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from tempering.interfaces import RewardResult
from tempering.plugins.rewards.common import NumberToken, find_numbers, parse_number
from tempering.rollouts.feedback import mismatch, quote

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` in ``text`` (braces balanced), else ``None``.

    An unclosed last box is skipped in favour of the previous complete one.
    """
    found = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            found = text[m.end() : i - 1]
    return found


def _brace_group(s: str, i: int) -> tuple[str, int] | None:
    """``s[i:]`` starts with ``{...}`` (balanced) or a single character: (content, end)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        return None
    if s[i] != "{":
        return s[i], i + 1
    depth, j = 1, i + 1
    while j < len(s) and depth:
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        j += 1
    return (s[i + 1 : j - 1], j) if depth == 0 else None


def _replace_fracs(s: str) -> str:
    """``\\frac{a}{b}`` (also ``\\frac12``, nested) -> ``a/b`` evaluated when both are numbers,
    else ``(a)/(b)``."""
    out, i = [], 0
    while True:
        j = s.find("\\frac", i)
        if j < 0:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j])
        num = _brace_group(s, j + 5)
        den = _brace_group(s, num[1]) if num else None
        if num is None or den is None:
            out.append(s[j:])
            return "".join(out)
        a, b = normalize_latex(num[0]), normalize_latex(den[0])
        ta, tb = parse_number(a), parse_number(b)
        if ta is not None and tb is not None and not ta.percent and not tb.percent and tb.value != 0:
            value = ta.value / tb.value
            out.append(
                f"{'-' if value < 0 else ''}{abs(value.numerator)}/{value.denominator}"
                if value.denominator != 1
                else str(value.numerator)
            )
        else:
            out.append(f"({a})/({b})")
        i = den[1]


_TEXT_CMD = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_DROP = [r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", r"\displaystyle", "$"]


def normalize_latex(s: str) -> str:
    """Light LaTeX clean-up so that numbers inside formulas can be read."""
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _TEXT_CMD.sub(r"\1", s)
    for tok in _DROP:
        s = s.replace(tok, "")
    s = s.replace("\\%", "%").replace("{,}", ",").replace("\\cdot", "*").replace("\\times", "*")
    s = re.sub(r"\^\s*\{?\\circ\}?", "", s)
    if "\\frac" in s:
        s = _replace_fracs(s)
    return s.strip()


def _norm_str(s: str) -> str:
    s = normalize_latex(s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if len(s) > 1 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    return s.lower()


@dataclass
class Extracted:
    """What :func:`extract_answer` found: the raw text, its number (if any) and how."""

    text: str | None
    number: NumberToken | None
    method: str  # "boxed", "last_number" or "none"


def extract_answer(text: str, mode: str = "auto") -> Extracted:
    """The final answer of ``text``.

    ``mode``: ``auto`` (last ``\\boxed{}``, else the last number), ``boxed`` (only a box) or
    ``last_number`` (ignore boxes).
    """
    if mode not in ("auto", "boxed", "last_number"):
        raise ValueError(f"extract: use auto, boxed or last_number (got '{mode}')")
    if mode in ("auto", "boxed"):
        boxed = extract_boxed(text)
        if boxed is not None:
            number = as_single_number(boxed)
            return Extracted(boxed.strip(), number, "boxed")
        if mode == "boxed":
            return Extracted(None, None, "none")
    numbers = find_numbers(normalize_latex(text))
    if numbers:
        return Extracted(numbers[-1].text, numbers[-1], "last_number")
    return Extracted(None, None, "none")


_ASSIGN = re.compile(r"^\s*[A-Za-z_][\w']*\s*=\s*")
_UNITS = re.compile(r"\s*[A-Za-z][A-Za-z .]*$")


def as_single_number(text: str) -> NumberToken | None:
    """``text`` as one number, allowing a leading ``x =`` and trailing unit words
    (``"x = 5"``, ``"12 cm"``, ``"\\frac{1}{2}"``); ``None`` for anything else (``"x+1"``,
    ``"(1, 2)"``)."""
    cleaned = _ASSIGN.sub("", normalize_latex(text))
    number = parse_number(cleaned)
    if number is None:
        number = parse_number(_UNITS.sub("", cleaned))
    return number


def _candidates(tok: NumberToken, percent: str) -> list[Fraction]:
    if not tok.percent or percent == "strip":
        return [tok.value]
    if percent == "fraction":
        return [tok.value / 100]
    return [tok.value, tok.value / 100]  # either


def numbers_equal(
    got: NumberToken, want: NumberToken, abs_tol: float = 1e-6, rel_tol: float = 0.0, percent: str = "strip"
) -> bool:
    """``got`` equals ``want`` within ``abs_tol + rel_tol*|want|``.

    ``percent`` says what ``50%`` means: ``strip`` -> 50, ``fraction`` -> 0.5, ``either`` -> both
    are accepted.
    """
    for a in _candidates(got, percent):
        for b in _candidates(want, percent):
            if abs(a - b) <= Fraction(abs_tol) + Fraction(rel_tol) * abs(b):
                return True
    return False


@dataclass
class MathAnswer:
    """1.0 if the completion's final answer equals ``example[answer_key]`` numerically, else 0.0.

    The reference is read as a number if it is one (``"3/4"``, ``"1,000"``, ``"\\frac{1}{2}"``,
    ``"x = 5"``, ``"12 cm"``), else from its own ``\\boxed{}`` or what follows its last
    ``####`` (a GSM8K solution), else it is compared as text. A completion without any answer
    scores ``wrong`` (the model did not answer; that is not a reward failure); a missing
    ``answer_key`` raises. ``info`` carries what was extracted; a wrong answer's feedback says
    what was expected and what was extracted (:meth:`feedback`).

    ``extract``: auto | boxed | last_number. ``percent``: strip | fraction | either.
    """

    column_keys: ClassVar[tuple[str, ...]] = ("answer_key",)  # config keys naming dataset columns it reads
    answer_key: str = "answer"
    extract: str = "auto"
    abs_tol: float = 1e-6
    rel_tol: float = 0.0
    percent: str = "strip"
    correct: float = 1.0
    wrong: float = 0.0

    def __post_init__(self) -> None:
        if self.extract not in ("auto", "boxed", "last_number"):
            raise ValueError(f"math_answer.extract: use auto, boxed or last_number (got '{self.extract}')")
        if self.percent not in ("strip", "fraction", "either"):
            raise ValueError(f"math_answer.percent: use strip, fraction or either (got '{self.percent}')")
        if self.abs_tol < 0 or self.rel_tol < 0:
            raise ValueError("math_answer: abs_tol and rel_tol must be >= 0")

    def reference(self, example: Mapping[str, Any]) -> Extracted:
        if self.answer_key not in example:
            raise KeyError(f"math_answer: the example has no '{self.answer_key}' key (keys: {sorted(example)})")
        raw = str(example[self.answer_key])
        number = as_single_number(raw)
        if number is not None:
            return Extracted(raw.strip(), number, "number")
        boxed = extract_boxed(raw)
        if boxed is not None:
            return Extracted(boxed.strip(), as_single_number(boxed), "boxed")
        if "####" in raw:  # GSM8K-style solution: the answer follows the last ####
            tail = raw.rsplit("####", 1)[1].strip()
            return Extracted(tail, as_single_number(tail), "number")
        return Extracted(raw.strip(), None, "text")

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        ref = self.reference(example)
        got = extract_answer(completion, self.extract)
        info: dict[str, Any] = {
            "extracted": got.text,
            "method": got.method,
            "value": float(got.number.value) if got.number is not None else None,
            "reference": ref.text,
        }
        if got.text is None:
            ok = False
        elif got.number is not None and ref.number is not None:
            ok = numbers_equal(got.number, ref.number, self.abs_tol, self.rel_tol, self.percent)
        else:  # at least one side is not a number: compare normalised text
            ok = ref.text is not None and _norm_str(got.text) == _norm_str(ref.text)
            info["compared"] = "text"
        return RewardResult(self.correct if ok else self.wrong, info, feedback=None if ok else self.feedback(got, ref))

    def feedback(self, got: Extracted, ref: Extracted) -> str:
        """What was wrong: ``expected '42', got '41'`` (the extracted answer, not the
        completion), or that no answer was found."""
        if got.text is None:
            where = " in a \\boxed{}" if self.extract == "boxed" else ""
            return f"no final answer found{where}; expected {quote(ref.text)}"
        return mismatch(ref.text, got.text)
