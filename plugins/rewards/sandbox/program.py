"""The host's side of a code test: the program taken out of a completion, the tests taken
apart into what the sandbox evaluates and what the host expects, and the comparison.

A test is an ``assert`` statement, as unit tests are written (``assert add(2, 3) == 5``).
``assert EXPR == LITERAL`` (either side literal) is split: the sandbox evaluates ``EXPR`` and
reports its ``repr``; the host reads that back with :func:`ast.literal_eval` and compares it
with ``LITERAL``, which never enters the sandbox. An object that claims to equal everything
(``__eq__`` returning True) therefore cannot pass: its ``repr`` is not the expected value. Any
other assert (``assert is_even(4)``, ``assert f(x) != 3``) is evaluated whole in the sandbox as
``bool(...)``, expected ``True`` -- the program's own objects decide that truth, so write tests
as ``==`` against a literal where that matters.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any

from tempering.plugins.rewards.sandbox.harness import REPR_CAP

#: A fenced block: ```lang ... ``` (an unclosed last fence runs to the end: a completion cut
#: at ``max_tokens`` keeps what it wrote).
FENCE = re.compile(r"```[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)(?:```|\Z)", re.DOTALL)
PYTHON_TAGS = ("python", "py", "python3")
EXTRACT_MODES = ("auto", "fenced", "raw")


def extract_program(completion: str, mode: str = "auto") -> str | None:
    """The program in ``completion``: the first ```python block (else the first untagged
    block); ``auto`` falls back to the whole completion when it has no block, ``fenced``
    returns ``None`` then, ``raw`` always takes the whole completion."""
    if mode == "raw":
        return completion
    blocks = [(m.group("lang").lower(), m.group("body")) for m in FENCE.finditer(completion)]
    for wanted in (PYTHON_TAGS, ("",)):
        for lang, body in blocks:
            if lang in wanted:
                return body
    return completion if mode == "auto" else None


@dataclass(frozen=True)
class CodeTest:
    """One test: ``expression`` is what the sandbox evaluates, ``expected`` what its value must
    equal (read on the host); ``source`` the assert as written."""

    source: str
    expression: str
    expected: Any


def _literal(node: ast.expr) -> tuple[bool, Any]:
    try:
        return True, ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False, None


def parse_test(source: str) -> CodeTest:
    """``source`` (one ``assert`` statement) as a :class:`CodeTest`; a ``ValueError`` of one
    line when it is not an assert."""
    try:
        tree = ast.parse(source.strip())
    except SyntaxError as exc:
        raise ValueError(f"test {source!r} is not valid Python ({exc.msg})") from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.Assert):
        raise ValueError(f"test {source!r} is not one assert statement (write e.g. 'assert add(2, 3) == 5')")
    test = tree.body[0].test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        left, right = test.left, test.comparators[0]
        for evaluated, other in ((left, right), (right, left)):
            is_literal, value = _literal(other)
            if is_literal:
                return CodeTest(source, ast.unparse(evaluated), value)
    return CodeTest(source, f"bool({ast.unparse(test)})", True)


def parse_tests(tests: object, key: str) -> list[CodeTest]:
    """An example's ``tests`` (a list of assert strings, or one string of assert lines) as
    :class:`CodeTest` s; a ``ValueError`` naming the example's ``key`` for anything else."""
    if isinstance(tests, str):
        tests = [line for line in tests.splitlines() if line.strip()]
    if not isinstance(tests, (list, tuple)) or not tests or not all(isinstance(t, str) for t in tests):
        raise ValueError(
            f"the example's '{key}' must be a non-empty list of assert strings "
            f"(e.g. ['assert add(2, 3) == 5']), got {type(tests).__name__}"
        )
    return [parse_test(t) for t in tests]


def passed(test: CodeTest, report: object) -> bool:
    """Whether the sandbox's ``report`` for ``test`` (``["ok", repr]`` or ``["error", text]``)
    shows the expected value. A ``repr`` that is not a literal, or too long, fails."""
    if not (isinstance(report, list) and len(report) == 2 and report[0] == "ok" and isinstance(report[1], str)):
        return False
    if len(report[1]) > REPR_CAP:
        return False
    try:
        value = ast.literal_eval(report[1])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    try:
        return bool(value == test.expected)
    except Exception:  # noqa: BLE001 - comparing two literals should not raise; be safe
        return False
