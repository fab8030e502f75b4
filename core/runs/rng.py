"""Every global RNG a run draws from (Python's, torch's, CUDA's, numpy's), captured and restored.

A checkpoint keeps them so a resumed run samples what an uninterrupted one would
(:mod:`tempering.plugins.backends.local.checkpoint`); :func:`kept_rng` leaves them as they were
around code that seeds them as a side effect -- building or loading a backend (the local one
seeds every RNG from its ``seed``) in a process whose run draws from them: the Tinker-protocol
server's models, a distillation teacher built after a resumed student restored its RNGs.

torch is imported inside the functions: importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Mapping
from typing import Any

__all__ = ["kept_rng", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, in a form ``torch.load(weights_only=True)`` accepts."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):
        import numpy as np

        legacy = np.random.get_state()  # a tuple for numpy's global MT19937 (a dict for other generators)
        if isinstance(legacy, tuple):
            name, keys, pos, has_gauss, cached = legacy
            state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Leave every global RNG as it was on entry: for code that builds or loads a backend (which
    seeds them) in a process that draws from them for other reasons."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)
