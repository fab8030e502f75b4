"""``rollouts.jsonl``: what the model actually sampled, one JSON object per sample.

Metrics say *that* a reward went up; only the samples say *why* (or that the reward is being
gamed, or that every episode dies on a malformed tool call). Every RL stage and every
evaluation writes a share of its samples here -- by default the first
:data:`DEFAULT_GROUPS` groups of each step, plus every group with a failed sample (failures
are rare and are what one debugs) -- through :func:`log_groups`. The stage key
``log_rollouts`` sets the number of groups (0 = none, -1 = all).

The format is stable (``v`` says which version; docs/observability.md documents it). Each
line is one sample:

==================  ==============================================================================
``v``               format version (3: ``calls`` added; 2: ``feedback``)
``row``             index (0-based) of the ``metrics.jsonl`` row of the same step: the join key,
                    and what a resumed run cuts the file back by (:func:`rewind`)
``stage``, ``step`` the stage id and global optimizer step, as in ``metrics.jsonl``
``kind``            ``train`` (a training step's rollouts) or ``eval``
``group``,          the group id and the sample's index in its group
``sample``
``example``         the dataset row
``prompt``          the prompt text (text examples), else null
``messages``        the chat transcript (OpenAI format) for chat examples and episodes: the whole
                    multi-turn episode with tool calls and tool results, ending with the model's
                    last turn; null for text prompts
``completion``      the text of the model's (last) turn
``reward``,         the reward and its parts (``reward_info``: a reward's own diagnostics, the
``reward_info``     failure cause)
``advantage``       the advantage it trained with (train rows; null for a failed or masked sample
                    and when the step trained nothing)
``failed``,         whether it failed, the cause (``raised:KeyError``, ``timeout``, ... see
``failure``,        :mod:`tempering.runs.failures`) and the error's text; ``masked``: a limit
``error``,          configured to mask it
``masked``
``feedback``        what the reward or the environment said about the attempt in words
                    (``Sample.feedback``: a wrong answer's ``expected '42', got '41'``, a failed
                    tool call, a judge's critique; one line each), or null
``policy_version``  the optimizer step of the weights that sampled it (the oldest, over turns)
``staleness``       the trainer's step minus ``policy_version`` (0 on-policy)
``stop``            why it ended: ``stop``/``length`` (a completion), or the episode's stop
                    (``done``, ``max_turns``, ``context``, ``error``, ``parse_error``)
``tokens``,         tokens generated, model turns
``turns``
``calls``           every model call of an agent episode (the ``agent`` and ``verifiers``
                    samplers), in the order answered: the request's ``messages`` and ``tools``
                    (chat calls), the ``completion`` text, ``finish_reason``, ``tool_calls``,
                    ``n`` (the request's choices), ``trained`` (an ``n > 1`` choice no later
                    call continued is not), ``policy_version`` and -- unless the sampler's
                    ``log_token_ids`` is off -- ``prompt_ids``, ``completion_ids``,
                    ``logprobs``; null for other samples
==================  ==============================================================================

Loggers that can show rollouts (a tracker's table) implement the optional
``log_rollouts(records, step)``; they get the same records.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tempering.runs.failures import failure_cause
from tempering.runs.runfolder import is_primary_process
from tempering.types import Group, Sample

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import RunContext

FILENAME = "rollouts.jsonl"
#: Every record's keys, in order (the table above; tests hold the two together).
FIELDS = (
    "v",
    "row",
    "stage",
    "step",
    "kind",
    "group",
    "sample",
    "example",
    "prompt",
    "messages",
    "completion",
    "reward",
    "reward_info",
    "advantage",
    "failed",
    "failure",
    "error",
    "masked",
    "feedback",
    "policy_version",
    "staleness",
    "stop",
    "tokens",
    "turns",
    "calls",
)
FORMAT_VERSION = 3
#: Groups written per step when a stage does not say (``log_rollouts``).
DEFAULT_GROUPS = 4


def select_groups(groups: Sequence[Group], count: int) -> list[Group]:
    """The groups a step writes: the first ``count`` and every group with a failed sample
    (``count`` 0: none at all; -1: every group)."""
    if count == 0:
        return []
    if count < 0:
        return list(groups)
    return [g for i, g in enumerate(groups) if i < count or any(s.failed for s in g.samples)]


def sample_record(
    sample: Sample, group: Group, index: int, *, advantage: float | None = None, trainer_step: int = 0
) -> dict[str, Any]:
    """One sample as a line of ``rollouts.jsonl`` (without the step fields :func:`log_groups`
    adds)."""
    traj = sample.trajectory
    example = sample.example or group.example
    messages = None
    if traj is not None:
        messages = list(traj.messages)
    elif "messages" in example:
        messages = [*example["messages"], {"role": "assistant", "content": sample.completion.text}]
    return {
        "group": group.group_id,
        "sample": index,
        "example": jsonable(example),
        "prompt": str(example["prompt"])
        if traj is None and "messages" not in example and "prompt" in example
        else None,
        "messages": jsonable(messages),
        "completion": sample.completion.text,
        "reward": jsonable(float(sample.reward)),
        "reward_info": jsonable(dict(sample.reward_info or {})),
        "advantage": None if advantage is None else jsonable(float(advantage)),
        "failed": bool(sample.failed),
        "failure": failure_cause(sample) if sample.failed else None,
        "error": sample.error,
        "masked": bool(sample.masked),
        "feedback": sample.feedback,
        "policy_version": int(sample.policy_version),
        "staleness": int(trainer_step) - int(sample.policy_version),
        "stop": traj.stop if traj is not None else sample.completion.stop_reason,
        "tokens": int(sample.num_generated),
        "turns": len(traj.turns) if traj is not None else 1,
        "calls": jsonable(traj.calls) if traj is not None and traj.calls is not None else None,
    }


def log_groups(
    ctx: RunContext,
    groups: Sequence[Group],
    kind: str,
    step: int,
    count: int = DEFAULT_GROUPS,
    advantages: Sequence[float] | None = None,
) -> list[dict[str, Any]]:
    """Write the step's selected groups (:func:`select_groups`) to the run's
    ``rollouts.jsonl`` and hand them to every logger with ``log_rollouts``; returns the records.

    ``ctx`` is the stage's run context (its output folder, stage id, loggers, the metrics row
    this step will be logged as); ``advantages`` align with the samples of ``groups`` in order.
    Only the primary process writes (data-parallel ranks sample the same step)."""
    chosen = {id(g) for g in select_groups(groups, count)}
    if not chosen or not is_primary_process():
        return []
    backend = getattr(ctx, "backend", None)
    trainer_step = int(getattr(backend, "step", 0) or 0)
    head = {
        "v": FORMAT_VERSION,
        "row": getattr(ctx, "rows_logged", None),
        "stage": getattr(ctx, "stage_id", ""),
        "step": int(step),
        "kind": kind,
    }
    records = []
    flat = 0
    for g in groups:
        for i, s in enumerate(g.samples):
            if id(g) in chosen:
                adv = advantages[flat] if advantages is not None and s.trainable else None
                records.append({**head, **sample_record(s, g, i, advantage=adv, trainer_step=trainer_step)})
            flat += 1
    output_dir = getattr(ctx, "output_dir", None)
    if output_dir:
        append(os.path.join(output_dir, FILENAME), records)
    for logger in getattr(ctx, "loggers", ()) or ():
        if hasattr(logger, "log_rollouts"):  # optional, like ``rewind``
            logger.log_rollouts(records, int(step))
    return records


def append(path: str, records: Iterable[Mapping[str, Any]]) -> None:
    """Append records as lines (opened per call: a few writes per step, and a killed run
    leaves whole lines behind it)."""
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if lines:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(lines)


def rewind(output_dir: str, rows: int) -> None:
    """Cut ``rollouts.jsonl`` back to the records of the first ``rows`` metrics rows: a
    resumed run logs the later steps again, and each must be in the file once. Records are in
    row order, so the file is truncated at the first later one (or a line cut short by a kill)."""
    path = os.path.join(output_dir, FILENAME)
    if not os.path.exists(path):
        return
    keep = 0
    with open(path, "rb") as fh:
        for line in fh:
            if not line.endswith(b"\n"):
                break
            try:
                row = json.loads(line).get("row")
            except ValueError:
                break
            if isinstance(row, int) and row >= rows:
                break
            keep += len(line)
    os.truncate(path, keep)


def jsonable(value: object) -> Any:
    """``value`` as plain JSON: nested mappings and lists kept, non-finite floats as text
    (JSON has no NaN; ``"nan"`` stays visible), tensors and numpy scalars as numbers, anything
    else as its ``str``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return jsonable(value.item())
    if hasattr(value, "tolist"):
        return jsonable(value.tolist())
    return str(value)
