"""Count the annotated parameters whose type is a bare ``Any``, outside the tests.

Why: a bare ``Any`` on a parameter turns the type checker off exactly where data crosses from
one part to another, which is where a contract is most worth checking. The count is printed by
CI so that it is seen on every run, and ``--max-share`` fails the run past a ceiling (the
ratchet: lower it as boundaries get their protocols, never raise it).

Counted: every parameter with an annotation (``self`` and ``cls`` excluded, ``*args`` and
``**kwargs`` included) in core/, algorithms/ and plugins/. Bare means the annotation is the
name ``Any`` or ``typing.Any`` (``Mapping[str, Any]`` or ``Any | None`` are not bare: they say
what the outer value is).

    python .ci/bare_any.py [--max-share 0.05] [--top 10]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOTS = ("core", "algorithms", "plugins")


def is_bare_any(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Name):
        return annotation.id == "Any"
    if isinstance(annotation, ast.Attribute):
        return annotation.attr == "Any" and isinstance(annotation.value, ast.Name) and annotation.value.id == "typing"
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return annotation.value.strip() in ("Any", "typing.Any")
    return False


def parameters(tree: ast.AST) -> list[tuple[int, ast.arg]]:
    """(line, parameter) for every annotated parameter of every function in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        every = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        every += [a for a in (args.vararg, args.kwarg) if a is not None]
        found += [(node.lineno, a) for a in every if a.annotation is not None and a.arg not in ("self", "cls")]
    return found


def count(root: Path) -> tuple[int, Counter[str]]:
    """Annotated parameters in all, and the bare-``Any`` ones per file."""
    total, bare = 0, Counter[str]()
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            params = parameters(ast.parse(path.read_text(), str(path)))
            total += len(params)
            hits = sum(1 for _, a in params if a.annotation is not None and is_bare_any(a.annotation))
            if hits:
                bare[str(path.relative_to(root))] = hits
    return total, bare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-share", type=float, default=None, help="fail above this share of bare Any")
    parser.add_argument("--top", type=int, default=10, help="list the files with the most")
    args = parser.parse_args(argv)
    total, bare = count(Path(__file__).resolve().parent.parent)
    n = sum(bare.values())
    share = n / total if total else 0.0
    print(f"bare Any: {n} of {total} annotated parameters ({share:.1%}) in {', '.join(ROOTS)}")
    for path, hits in bare.most_common(args.top):
        print(f"  {hits:4d}  {path}")
    if args.max_share is not None and share > args.max_share:
        print(f"bare Any: {share:.1%} is above the ceiling {args.max_share:.1%} (--max-share)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
