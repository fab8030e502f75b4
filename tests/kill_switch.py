"""A ``python`` reward for ``tests/test_vllm_torchrun.py``'s kill -9 test; not a test itself.

Killing a run from outside once it has checkpointed a step is a race: a step of the test's tiny
model takes ~0.1 s, less than one poll, and the run once finished before the kill came. This
reward kills from inside, at a fixed point: the first time it scores after the checkpoint of
global step ``N`` is listed in ``progress.json`` (so during step ``N + 1``), it SIGKILLs its
torchrun (its parent) and then its own rank. Armed by ``TEMPERING_TEST_KILL_AFTER=PATH:N`` (the
run's ``progress.json`` and N); without it, it is an ordinary reward.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

ARM = "TEMPERING_TEST_KILL_AFTER"


def checkpointed(progress: Path, step: int) -> bool:
    """``progress`` lists a checkpoint at global step ``step`` or later."""
    try:
        saved = json.loads(progress.read_text())["checkpoints"]
    except (OSError, ValueError, KeyError):  # not written yet, or being replaced
        return False
    return any(c["global_step"] >= step for c in saved)


def score(completion: str, example: dict) -> float:
    """1.0 when the completion has a digit (some groups vary, so GRPO has advantages), else 0.0;
    the kill, when armed and due."""
    armed = os.environ.get(ARM)
    if armed:
        path, step = armed.rsplit(":", 1)
        if checkpointed(Path(path), int(step)):
            os.kill(os.getppid(), signal.SIGKILL)  # torchrun: it must not restart the rank
            os.kill(os.getpid(), signal.SIGKILL)
    return float(any(ch.isdigit() for ch in completion))
