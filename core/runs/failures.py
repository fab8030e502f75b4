"""Failed samples: why each one failed, how many per step, and when a stage must stop.

A failed sample (a reward that raised, timed out or returned something that is not a finite
real number; an episode whose environment raised) stays in its group but out of the loss. That
keeps one bad call from killing a run -- and would let a run whose *every* reward fails train
on nothing and finish "Done". So failures are made loud here:

* each failure records its *cause* (:func:`mark_failed`), one of

  ========================  ====================================================================
  ``raised:<Exception>``    the reward raised (``raised:KeyError``, ``raised:RemoteRewardError``)
  ``timeout``               the reward took longer than ``reward_timeout`` (or its own timeout)
  ``not_a_number``          the reward returned something that is not a real number (a str,
                            None, a list, a tensor, ...)
  ``not_finite``            the reward returned NaN or an infinity
  ``bad_feedback``          the reward returned feedback that is not text (see :mod:`tempering.rollouts.feedback`)
  ``episode_error``         the environment raised during an episode
  ``env_timeout``           an environment call did not return within the sampler's ``env_timeout``
  ``group_reward``          the environment's ``group_reward`` raised or returned a wrong count
  ``no_reward``             the environment left the reward to the stage, which has none
  ``failed``                a sampler marked the sample failed without a cause
  ========================  ====================================================================

* :func:`failure_metrics` counts them per step (``failed/<cause>``) with the first error's text
  (``first_error/<cause>``); evaluation logs the same under ``eval/``;
* :class:`FailureWatch` prints the first error of each *new* cause once, above the progress
  bar, keeps that text in the step's logged row only the first time, and stops the stage
  (:class:`tempering.errors.StopRun`: the run checkpoints it as unfinished and ends with one
  line naming the cause) once more than ``max_failed_fraction`` of the samples of the last
  ``failure_window`` steps failed;
* tool calls that fail (``env/tool_errors``, timeouts included) or time out
  (``env/tool_timeouts``) are causes of their own, ``tool_error`` and ``tool_timeout``: printed
  once each like a sample cause, and, past ``max_tool_error_fraction`` of the tool calls of the
  window, they stop the stage the same way (a failing tool is the model's observation, not a
  failed sample, so ``max_failed_fraction`` never saw it);
* :meth:`FailureWatch.summary` sums every cause over the stage, for the stage's summary (what
  ``tempering run`` prints after "Done."): a partial failure is in the final lines, not only
  in the first step's.

A failure by exception (a reward, an environment, a group score that raised) keeps its
formatted traceback in ``reward_info["traceback"]`` (so in ``rollouts.jsonl``), trimmed to the
frames that are not tempering's harness or asyncio's -- the user's code; the first one of a
stage is printed with its cause's line. ``TEMPERING_DEBUG=1`` (``tempering run --debug``)
re-raises the first such exception instead (:func:`debug`): the run ends in it, under a
debugger if one is attached.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
import traceback as tb_module
from collections import deque
from collections.abc import Iterable, MutableMapping
from typing import Any

from tempering.errors import StopRun
from tempering.types import Sample

CAUSE_KEY = "failure"  # where a failed sample's cause is kept, in ``sample.reward_info``
FAILED_PREFIX = "failed/"
ERROR_PREFIX = "first_error/"
TRACEBACK_PREFIX = "first_traceback/"  # passed to FailureWatch in a row, never logged
TRACEBACK_KEY = "traceback"  # where a failure's formatted traceback is kept, in ``sample.reward_info``
DEBUG_ENV = "TEMPERING_DEBUG"
SAMPLES_KEY = "rollout/samples"


def raised(exc: BaseException) -> str:
    """The cause of a failure by exception: ``raised:<its type>``."""
    return f"raised:{type(exc).__name__}"


def debug() -> bool:
    """Whether a failure re-raises instead of being counted (``TEMPERING_DEBUG`` set and not 0)."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _harness_files() -> tuple[str, ...]:
    """Where the code that runs a user's environment or reward lives (prefixes of file names)."""
    # tempering.rollouts runs the user's code; named by path, since runs/ sits below rollouts/
    rollouts = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollouts")
    dirs = [os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (asyncio, concurrent.futures)]
    files = [os.path.join(rollouts, name) for name in ("episode.py", "scoring.py")]
    sampler = sys.modules.get("tempering.plugins.samplers.environment")
    if sampler is not None and sampler.__file__:
        files.append(os.path.abspath(sampler.__file__))
    return (*dirs, *files, os.path.abspath(threading.__file__ or ""))


def format_traceback(exc: BaseException) -> str:
    """``exc``'s traceback as Python prints it, without the frames of the harness that ran the
    user's code (the episode loop, the reward runner, asyncio, the thread hand-over): what is
    left points at the line of the environment or reward that raised."""
    harness = _harness_files()
    frames = [f for f in tb_module.extract_tb(exc.__traceback__) if not os.path.abspath(f.filename).startswith(harness)]
    head = "Traceback (most recent call last):\n" if frames else ""
    return head + "".join(tb_module.format_list(frames)) + "".join(tb_module.format_exception_only(type(exc), exc))


def mark_failed(sample: Sample, cause: str, message: str, exc: BaseException | str | None = None) -> None:
    """Fail ``sample``: reward 0 (never trained on), the error's text and its cause; ``exc``
    (the exception, or its already formatted traceback) keeps the traceback."""
    sample.reward, sample.failed, sample.error = 0.0, True, message
    sample.reward_info = {**(sample.reward_info or {}), CAUSE_KEY: cause}
    if exc is not None:
        sample.reward_info[TRACEBACK_KEY] = exc if isinstance(exc, str) else format_traceback(exc)


def failure_cause(sample: Sample) -> str:
    return str((sample.reward_info or {}).get(CAUSE_KEY) or "failed")


def failure_metrics(samples: Iterable[Sample], prefix: str = "", tracebacks: bool = False) -> dict[str, Any]:
    """``{prefix}failed/<cause>``: how many samples failed of each cause, and
    ``{prefix}first_error/<cause>``: the first error's text of each. ``tracebacks``: also
    ``{prefix}first_traceback/<cause>``, for a stage's :class:`FailureWatch` to print (it takes
    them out of the row: tracebacks belong in ``rollouts.jsonl``, not in the metrics)."""
    counts: dict[str, int] = {}
    first: dict[str, str] = {}
    trace: dict[str, str] = {}
    for s in samples:
        if s.failed:
            cause = failure_cause(s)
            counts[cause] = counts.get(cause, 0) + 1
            first.setdefault(cause, s.error or "(no error text)")
            if tracebacks and (s.reward_info or {}).get(TRACEBACK_KEY):
                trace.setdefault(cause, str(s.reward_info[TRACEBACK_KEY]))
    out: dict[str, Any] = {f"{prefix}{FAILED_PREFIX}{c}": float(n) for c, n in sorted(counts.items())}
    out.update({f"{prefix}{ERROR_PREFIX}{c}": text for c, text in sorted(first.items())})
    out.update({f"{prefix}{TRACEBACK_PREFIX}{c}": text for c, text in sorted(trace.items())})
    return out


def announce(message: str) -> None:
    """Print a line above any live progress bar (``tqdm.write`` moves the bar down)."""
    from tqdm.auto import tqdm

    tqdm.write(message, file=sys.stderr)


class FailureWatch:
    """A stage's failure bookkeeping (see the module docs).

    ``max_failed_fraction`` None (or a stage without the key) never stops; a window is judged
    once it holds ``window`` steps, or at the stage's last step when the stage is shorter, so a
    single bad step does not end a long run but a short run whose every reward fails does.
    """

    TOOL_KEYS = ("env/tool_calls", "env/tool_errors", "env/tool_timeouts")

    def __init__(
        self,
        label: str,
        path: str,
        max_failed_fraction: float | None = None,
        window: int = 1,
        max_tool_error_fraction: float | None = None,
    ) -> None:
        self.label, self.path = label, path
        self.limit = max_failed_fraction
        self.tool_limit = max_tool_error_fraction
        self.tools: deque[tuple[float, float]] = deque(maxlen=max(1, int(window)))  # (errors, calls) per step
        self.totals: dict[str, float] = {}
        self.window: deque[tuple[float, float, dict[str, float]]] = deque(maxlen=max(1, int(window)))
        self.seen: set[str] = set()
        self.first: dict[str, str] = {}
        self.traceback_shown = False

    def observe(self, metrics: MutableMapping[str, Any], where: str = "") -> None:
        """Take one logged row (in place): announce each new cause's first error and drop the
        texts of causes already announced; count the training samples for :meth:`check`. The
        first traceback (``first_traceback/<cause>``) is printed under its cause's line."""
        traces = {
            k.replace(TRACEBACK_PREFIX, ERROR_PREFIX): metrics.pop(k)
            for k in [k for k in metrics if TRACEBACK_PREFIX in k]
        }
        for key in [k for k in metrics if ERROR_PREFIX in k]:
            text = metrics[key]
            if key in self.seen:
                del metrics[key]
                continue
            self.seen.add(key)
            prefix, _, cause = key.partition(ERROR_PREFIX)
            self.first.setdefault(key, str(text))
            scope = "evaluation samples" if prefix else "samples"
            n = metrics.get(f"{prefix}{FAILED_PREFIX}{cause}")
            count = f"{int(n)} " if isinstance(n, float) else ""
            announce(f"tempering: {self.label}{where}: {count}{scope} failed [{cause}]: {text}")
            if key in traces and not self.traceback_shown:
                self.traceback_shown = True
                announce(
                    str(traces[key]).rstrip()
                    + f"\n(every failure's traceback is in rollouts.jsonl, reward_info.traceback; "
                    f"{DEBUG_ENV}=1 or tempering run --debug re-raises the first)"
                )
        if SAMPLES_KEY in metrics:
            causes = {k[len(FAILED_PREFIX) :]: float(v) for k, v in metrics.items() if k.startswith(FAILED_PREFIX)}
            self.window.append((sum(causes.values()), float(metrics[SAMPLES_KEY]), causes))
            for key in (SAMPLES_KEY, *(FAILED_PREFIX + c for c in causes), *self.TOOL_KEYS):
                if isinstance(metrics.get(key), float):
                    self.totals[key] = self.totals.get(key, 0.0) + float(metrics[key])
            calls = float(metrics.get("env/tool_calls", 0.0) or 0.0)
            if calls:
                self.tools.append((float(metrics.get("env/tool_errors", 0.0) or 0.0), calls))
        self._announce_tools(metrics, where)

    def _announce_tools(self, metrics: MutableMapping[str, Any], where: str) -> None:
        """Print the first failing and the first timed-out tool calls once each (training steps
        log them as ``env/tool_*``, evaluations as ``eval/tool_*``)."""
        for scope, keys in (("tool calls", "env/"), ("evaluation tool calls", "eval/")):
            for cause, what in (("tool_error", "failed"), ("tool_timeout", "timed out")):
                n = metrics.get(f"{keys}{cause}s")
                if not isinstance(n, float) or n <= 0 or f"{keys}{cause}" in self.seen:
                    continue
                self.seen.add(f"{keys}{cause}")
                text = metrics.get("env/first_error") if keys == "env/" else None
                announce(
                    f"tempering: {self.label}{where}: {int(n)} {scope} {what} [{cause}]: "
                    f"{text or '(each error text is in rollouts.jsonl)'}"
                )

    def summary(self) -> dict[str, float]:
        """Failed samples per cause (``failed/<cause>``) of every training step this stage ran,
        with the step's samples (``rollout/samples``) and tool calls, errors and timeouts
        (``env/tool_*``), when anything failed; empty otherwise."""
        failed = any(k.startswith(FAILED_PREFIX) and v for k, v in self.totals.items())
        tools = self.totals.get("env/tool_errors", 0.0) > 0
        return dict(sorted(self.totals.items())) if failed or tools else {}

    def check(self, last: bool = False) -> None:
        """Raise :class:`~tempering.errors.StopRun` when too many samples (or tool calls) failed lately."""
        self._check_tools(last)
        if self.limit is None or not self.window or (len(self.window) < (self.window.maxlen or 1) and not last):
            return
        failed = sum(f for f, _, _ in self.window)
        total = sum(n for _, n, _ in self.window)
        if not total or failed / total <= self.limit:
            return
        causes: dict[str, float] = {}
        for _, _, per in self.window:
            for cause, n in per.items():
                causes[cause] = causes.get(cause, 0.0) + n
        cause, n = max(causes.items(), key=lambda kv: kv[1]) if causes else ("failed", failed)
        text = self.first.get(f"{ERROR_PREFIX}{cause}", "")
        steps = len(self.window)
        raise StopRun(
            f"{self.path}: {int(failed)} of {int(total)} samples failed in the last {steps} step{'s' * (steps > 1)} "
            f"(more than max_failed_fraction={self.limit:g}); cause {cause} ({int(n)}x): {text or '(no text)'}. "
            f"Fix the cause, or raise {self.path}.max_failed_fraction (1 never stops)"
        )

    def _check_tools(self, last: bool) -> None:
        if self.tool_limit is None or not self.tools or (len(self.tools) < (self.tools.maxlen or 1) and not last):
            return
        errors = sum(e for e, _ in self.tools)
        calls = sum(c for _, c in self.tools)
        if not calls or errors / calls <= self.tool_limit:
            return
        steps = len(self.tools)
        raise StopRun(
            f"{self.path}: {int(errors)} of {int(calls)} tool calls failed in the last {steps} step{'s' * (steps > 1)} "
            f"(more than max_tool_error_fraction={self.tool_limit:g}; errors and timeouts, see env/first_error in "
            f"metrics.jsonl). Fix the tools, or raise {self.path}.max_tool_error_fraction (1 never stops)"
        )
