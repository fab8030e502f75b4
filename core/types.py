"""The data that flows between sampler, reward, advantage estimator, loss and backend.

The shapes mirror Tinker's so that one recipe runs on both backends: a :class:`Datum` is an
``input_tokens``/``target_tokens`` pair shifted by one, with per-target ``weights`` (the loss
mask) and optional per-target ``sampler_logprobs`` and ``advantages`` -- exactly the fields of
``tinker.types.Datum.loss_fn_inputs``. Plain dataclasses with lists keep this module free of
torch; :meth:`Batch.to_tensors` pads into tensors when a local backend needs them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class SamplingParams:
    """How to sample. Same fields as ``tinker.types.SamplingParams``.

    ``top_k=0`` and ``top_p=1.0`` disable those filters. ``stop`` holds strings or token ids.
    """

    max_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] | list[int] = field(default_factory=list)
    seed: int | None = None


@dataclass
class AdamParams:
    """Optimizer step settings. Same fields as ``tinker.types.AdamParams``."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0


@dataclass
class Completion:
    """One sampled continuation of a prompt.

    ``logprobs[i]`` is the sampler's log-probability of ``tokens[i]`` under the distribution it
    actually sampled from (after temperature). ``policy_version`` is the number of optimizer
    steps the sampling weights had taken: the trainer compares it with its own step count to
    know how stale a rollout is.
    """

    prompt_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str = "length"  # "stop" (eos / stop sequence) or "length"
    text: str = ""
    policy_version: int = 0
    temperature: float = 1.0


@dataclass
class Segment:
    """One training row of a rollout, *unshifted*: every token the model saw or produced, in
    order, as it saw them.

    ``weights[i]`` is 1 where the model sampled ``tokens[i]`` and 0 on prompt, tool and
    observation tokens; ``logprobs[i]`` is the sampler's logprob of a sampled token (0
    elsewhere). Built by appending (:class:`tempering.rollouts.trajectory.TrajectoryBuilder`), never by
    re-tokenizing text, so training sees exactly what sampling saw.
    """

    tokens: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    def extend(self, tokens: list[int], weight: float, logprobs: list[float] | None = None) -> None:
        self.tokens += tokens
        self.weights += [weight] * len(tokens)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(tokens)

    @classmethod
    def from_completion(cls, completion: Completion) -> Segment:
        seg = cls(
            list(completion.prompt_tokens), [0.0] * len(completion.prompt_tokens), [0.0] * len(completion.prompt_tokens)
        )
        seg.extend(list(completion.tokens), 1.0, completion.logprobs)
        return seg

    @property
    def num_sampled(self) -> int:
        return sum(1 for w in self.weights if w)

    def to_datum(
        self, advantage: float | None = None, weight: float = 1.0, logprobs: bool = True, **extra: object
    ) -> Datum:
        """The shifted training row: sampled positions get ``weight`` and ``advantage``;
        ``logprobs=False`` leaves ``sampler_logprobs`` out (supervised rows have none)."""
        w = [weight if x else 0.0 for x in self.weights[1:]]
        adv = None if advantage is None else [float(advantage) if x else 0.0 for x in self.weights[1:]]
        lps = list(self.logprobs[1:]) if logprobs else None
        return Datum(self.tokens[:-1], self.tokens[1:], w, lps, adv, dict(extra))


@dataclass
class Sample:
    """A rollout of one example with the reward it earned.

    Single-turn samplers fill ``completion`` only; multi-turn ones also set ``trajectory``
    (:class:`tempering.rollouts.trajectory.Trajectory`: every turn, the transcript, the training rows)
    and ``completion`` is its last turn. ``failed`` marks a reward or episode that raised, timed
    out or returned NaN; ``masked`` one that hit a limit configured to mask. Either keeps the
    sample in its group (so counts stay honest) but out of the loss and the advantages.

    ``feedback``: what the environment or the reward said about this attempt in words (a tool's
    error, a failing test, "expected 42, got 41", a judge's critique), or ``None``. A scalar
    reward tells a model little when almost every attempt fails; feedback is the text a
    self-distillation teacher (SDPO) is re-prompted with.
    """

    example: dict[str, Any]
    completion: Completion
    reward: float = 0.0
    reward_info: dict[str, Any] = field(default_factory=dict)
    failed: bool = False
    error: str | None = None
    trajectory: Any = None
    masked: bool = False
    feedback: str | None = None

    def segments(self) -> list[Segment]:
        """The training rows: the trajectory's, or the single prompt + completion row."""
        if self.trajectory is not None:
            return list(self.trajectory.segments)
        return [Segment.from_completion(self.completion)]

    @property
    def policy_version(self) -> int:
        """The oldest weights any of its turns was sampled with: its staleness is that one's."""
        if self.trajectory is not None and self.trajectory.turns:
            versions: list[int] = [t.completion.policy_version for t in self.trajectory.turns]
            return min(versions)
        return self.completion.policy_version

    @property
    def num_generated(self) -> int:
        if self.trajectory is not None:
            return sum(len(t.completion.tokens) for t in self.trajectory.turns)
        return len(self.completion.tokens)

    @property
    def trainable(self) -> bool:
        return not (self.failed or self.masked)


@dataclass
class Group:
    """All samples drawn for one prompt: the unit of group-relative advantages."""

    example: dict[str, Any]
    samples: list[Sample]
    group_id: int = 0

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def valid(self) -> list[Sample]:
        return [s for s in self.samples if s.trainable]


@dataclass
class Datum:
    """One training row, shifted like ``tinker.types.Datum``.

    ``input_tokens = tokens[:-1]`` and ``target_tokens = tokens[1:]``; every per-position list
    has the length of ``target_tokens``. ``weights`` is 0 on prompt positions, so the model is
    only trained on what it produced. ``extra`` carries per-row values a custom loss may need
    (e.g. ``ref_logprobs``, ``teacher_logprobs``, ``pair_id``).
    """

    input_tokens: list[int]
    target_tokens: list[int]
    weights: list[float]
    sampler_logprobs: list[float] | None = None
    advantages: list[float] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.target_tokens)
        if len(self.input_tokens) != n:
            raise ValueError(f"Datum: input_tokens has {len(self.input_tokens)} positions, target_tokens {n}")
        for name in ("weights", "sampler_logprobs", "advantages"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise ValueError(f"Datum.{name} has length {len(value)}, expected {n} (one per target token)")

    @classmethod
    def from_completion(
        cls,
        completion: Completion,
        advantage: float | None = None,
        weight: float = 1.0,
        **extra: Any,
    ) -> Datum:
        """Build the row that trains on ``completion`` given its prompt.

        The prompt's positions get weight 0 and logprob 0; each completion token gets
        ``weight`` and, if given, the sequence's ``advantage``.
        """
        return Segment.from_completion(completion).to_datum(advantage, weight, **extra)

    @property
    def num_loss_tokens(self) -> int:
        return sum(1 for w in self.weights if w != 0)


@dataclass
class Batch:
    """A list of rows trained on together, plus batch-level metadata."""

    data: list[Datum]
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.data)

    def to_tensors(self, pad_token_id: int = 0, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Right-pad into ``(B, T)`` tensors.

        Returns ``input_ids``, ``attention_mask``, ``target_ids``, ``weights`` and, when every
        row has them, ``sampler_logprobs`` and ``advantages``; per-position float lists in
        ``extra`` with the row's length are padded too (so losses can read e.g.
        ``ref_logprobs``), and so are per-position nested lists or tensors of shape
        ``(len(target_tokens), ...)`` (e.g. teacher top-k logprobs), zero-padded to ``(B, T, ...)``.
        """
        import torch

        if not self.data:
            raise ValueError("Batch.to_tensors: the batch is empty")
        width = max(len(d.input_tokens) for d in self.data)

        def pad(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([list(r) + [value] * (width - len(r)) for r in rows], dtype=dtype, device=device)

        out = {
            "input_ids": pad([d.input_tokens for d in self.data], pad_token_id, torch.long),
            "attention_mask": pad([[1] * len(d.input_tokens) for d in self.data], 0, torch.long),
            "target_ids": pad([d.target_tokens for d in self.data], pad_token_id, torch.long),
            "weights": pad([d.weights for d in self.data], 0.0, torch.float32),
        }
        for name in ("sampler_logprobs", "advantages"):
            rows = [getattr(d, name) for d in self.data]
            if all(r is not None for r in rows):
                out[name] = pad(rows, 0.0, torch.float32)
        keys = set.intersection(*(set(d.extra) for d in self.data))
        for key in sorted(keys):
            vals = [d.extra[key] for d in self.data]
            lengths = [len(d.target_tokens) for d in self.data]
            if all(isinstance(v, list) and len(v) == n for v, n in zip(vals, lengths)):
                if not any(v and isinstance(v[0], (list, tuple)) for v in vals):
                    out[key] = pad(vals, 0.0, torch.float32)
                    continue
                vals = [torch.tensor(v, dtype=torch.float32) for v in vals]  # (T, K) per row
            if all(isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == n for v, n in zip(vals, lengths)):
                # per-position tensors, e.g. (T, K) teacher top-k logprobs: zero-padded along T
                inner = {tuple(v.shape[1:]) for v in vals}
                if len(inner) == 1:
                    padded = vals[0].new_zeros((len(vals), width, *vals[0].shape[1:]))
                    for i, v in enumerate(vals):
                        padded[i, : v.shape[0]] = v
                    out[key] = padded.to(device) if device is not None else padded
        return out


def is_bad_number(x: Any) -> bool:
    """True for None, NaN and infinities: values that must never reach a loss."""
    try:
        return x is None or not math.isfinite(float(x))
    except (TypeError, ValueError):
        return True
