"""TRL's real ``GRPOTrainer`` learns the calculator tool-use task through tempering's environment.

Runs ``examples/trl_tool_use.py``'s pieces: the ``tool_use`` recipe's SFT warmup (it stops at
30% held-out accuracy), exported to a Hugging Face folder; then 20 steps of ``trl.GRPOTrainer``
with ``environment_factory=environment_factory("calculator")`` and
``reward_funcs=[environment_reward]``; both policies measured by ``tempering eval``'s code on the
same 300 held-out episodes. The comparison with tempering's own ``grpo`` stage on the same data
is the example's table (docs/agents.md); that stage's learning is tests/test_tool_use_learning.py.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

#: Held-out accuracy TRL must add to the warmup's in 20 steps. Measured (seed 0, this 2-core
#: machine): 33.0% -> 45.0% in this test and in the example (+12 points; training reward 0.13 ->
#: 0.25), 33.0% -> 51.0% in an earlier scratch run; seeds 1 and 2 in the example +20.7 and +32.7
#: points (docs/agents.md); a run whose weights do not move gains exactly
#: 0 (greedy evaluation of the same weights is deterministic). The test took 448 s at a load
#: average of ~15 (four jobs on two cores): warmup ~200 s, TRL's 20 steps ~120 s.
MIN_GAIN = 0.05
STEPS = 20


def example() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "examples" / "trl_tool_use.py"
    spec = importlib.util.spec_from_file_location("trl_tool_use_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trl_grpo_learns_tool_use_through_the_calculator_environment(tmp_path: Path) -> None:
    ex = example()
    warm = ex.warmup(str(tmp_path))
    assert 0.2 <= warm["accuracy"] <= 0.7 and warm["steps"] < 1500, "the warmup should stop early, at a modest accuracy"
    # the exported folder, evaluated as the TRL policy will be, scores what the recipe's evaluation said
    assert ex.held_out_accuracy(warm["hf"], str(tmp_path / "warm_eval")) == pytest.approx(warm["accuracy"])

    trl = ex.train_trl(warm["hf"], str(tmp_path / "trl"), STEPS)
    rewards = trl["rewards"]
    print(
        f"TRL: held-out {warm['accuracy']:.3f} -> {trl['accuracy']:.3f} in {STEPS} steps ({trl['seconds']:.0f} s); "
        f"training reward {sum(rewards[:5]) / 5:.2f} -> {sum(rewards[-5:]) / 5:.2f}"
    )
    assert len(rewards) == STEPS
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5  # the training reward rises
    assert trl["accuracy"] >= warm["accuracy"] + MIN_GAIN, f"TRL should beat the warmup ({trl['accuracy']:.3f})"
    assert os.path.isfile(os.path.join(trl["model"], "config.json"))
