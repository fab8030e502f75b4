"""``tempering.rlmath``: the shared RL maths stays below the algorithms and backends, and the
algorithms' old names are the shared functions, not copies of them.

The maths itself is tested where it is used: tests/test_grpo_math.py (advantages, GRPO loss,
aggregations, against TRL), tests/test_offpolicy.py (sum losses, ratio diagnostics, folded
normalisers), tests/test_sdft.py and tests/test_tinker_backend.py (Tinker's built-ins).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

RLMATH = Path(__file__).resolve().parents[1] / "core" / "rlmath"
MODULES = sorted(p.stem for p in RLMATH.glob("*.py") if p.stem != "__init__")


def test_rlmath_imports_neither_algorithms_nor_plugins():
    # every import statement, function-level ones included
    for path in RLMATH.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                upward = name.startswith(("tempering.algorithms", "tempering.plugins"))
                assert not upward, f"{path.name} imports {name}"
    # and what importing them pulls in
    code = (
        "import importlib, json, sys\n"
        f"for m in {MODULES!r}: importlib.import_module('tempering.rlmath.' + m)\n"
        "up = ('tempering.algorithms', 'tempering.plugins')\n"
        "print(json.dumps(sorted(n for n in sys.modules if n.startswith(up))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_rlmath_init_imports_nothing():
    out = subprocess.run(
        [sys.executable, "-c", "import sys, tempering.rlmath; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


_G, _S = "tempering.algorithms.grpo", "tempering.algorithms.sdft"
#: (old module, name there) -> (module in tempering.rlmath, name there)
REEXPORTS = [
    (f"{_G}.loss", "aggregate", "aggregation", "aggregate"),
    (f"{_G}.loss", "k3_kl", "kl", "k3_kl"),
    (f"{_G}.loss", "log_importance_weights", "ratios", "log_importance_weights"),
    (f"{_G}.loss", "clip_metrics", "diagnostics", "clip_metrics"),
    (f"{_G}.loss", "grpo_token_loss", "policy_loss", "grpo_token_loss"),
    (f"{_S}.loss", "fold_normaliser", "aggregation", "fold_normaliser"),
    (f"{_S}.loss", "aggregate", "aggregation", "aggregate_mean"),
    (f"{_S}.loss", "divergence", "divergence", "divergence"),
    (f"{_S}.loss", "topk_logits_loss", "divergence", "topk_logits_loss"),
]


@pytest.mark.parametrize(("old", "old_name", "new", "new_name"), REEXPORTS)
def test_old_names_are_the_shared_functions(old, old_name, new, new_name):
    import importlib

    shared = getattr(importlib.import_module(f"tempering.rlmath.{new}"), new_name)
    assert getattr(importlib.import_module(old), old_name) is shared
