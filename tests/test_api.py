"""The public import surface (issue 38): ``tempering.api`` holds what a user or a plugin author
imports, the package root re-exports it lazily, and ``import tempering`` stays cheap."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tempering
from tempering import api


def test_the_root_gives_the_api_names_lazily() -> None:
    from tempering import Recipe, RLStage
    from tempering.training.recipe import Recipe as home
    from tempering.training.rl import RLStage as rl_home

    assert Recipe is home and RLStage is rl_home
    assert set(api.__all__) <= set(dir(tempering))
    with pytest.raises(AttributeError, match="no attribute 'Recipes'"):
        _ = tempering.Recipes  # type: ignore[attr-defined]


def test_every_api_name_is_defined() -> None:
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert missing == []


def test_importing_the_package_imports_no_torch_and_no_training() -> None:
    code = "import sys, tempering; print('torch' in sys.modules, 'tempering.training.recipe' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]
