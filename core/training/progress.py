"""Progress bars for long work (tqdm), quiet under pytest unless asked for.

A stage's bar counts training steps, and its time estimate is about training steps only: the
work between them that is not a step -- an evaluation -- runs inside :func:`paused`, which
names the phase on the bar (``[eval 64/200]``) and takes its time out of the bar's clock, so a
75 s evaluation neither freezes a silent bar nor inflates the remaining-time estimate. Before a
bar exists (building the model) :func:`phase` prints one line saying what is happening.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def enabled() -> bool:
    """``TEMPERING_PROGRESS=0`` turns bars and phase lines off (logs, CI)."""
    return os.environ.get("TEMPERING_PROGRESS", "1") != "0"


def progress(total: int, desc: str, initial: int = 0) -> Any:
    from tqdm.auto import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=desc,
        disable=not enabled(),
        dynamic_ncols=True,
        file=sys.stderr,
        mininterval=0.5,
    )


def phase(text: str) -> None:
    """One line on stderr naming a phase that has no bar yet (``loading the model ...``)."""
    if enabled():
        print(f"tempering: {text}", file=sys.stderr, flush=True)


@contextmanager
def paused(bar: Any, name: str) -> Iterator[Callable[[int, int], None]]:
    """Run non-training work (``name``: ``eval``) under ``bar``: the bar shows ``[name]``, then
    ``[name done/total]`` each time the yielded function is called, and the time spent is taken
    out of the bar's clock (its elapsed time and its rate), as if the bar had been paused."""
    if getattr(bar, "disable", True):
        yield lambda done, total: None
        return
    desc, start = bar.desc, bar._time()
    bar.set_description_str(f"{desc} [{name}]")

    def report(done: int, total: int) -> None:
        bar.set_description_str(f"{desc} [{name} {done}/{total}]")

    try:
        yield report
    finally:
        spent = bar._time() - start
        bar.start_t += spent  # tqdm's own unpause() does this for the time since its last print
        bar.last_print_t += spent
        bar.set_description_str(desc)
