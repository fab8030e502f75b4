"""The component interfaces. A plugin implements one of these and registers a factory for it.

They are :class:`typing.Protocol` classes, so a component needs no base class: any object with
the right methods fits. Factories are called with the component's config keys as keyword
arguments (see :mod:`tempering.registry`), which is why none of these define ``__init__``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tempering.types import AdamParams, Batch, Completion, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    import torch


# --------------------------------------------------------------------------- backend
@runtime_checkable
class Backend(Protocol):
    """Tinker-like training primitives. Every call returns a future so that a loop can submit
    ``forward_backward`` and ``optim_step`` back to back, and sample while it trains.

    ``step`` is the number of optimizer steps taken: samplers stamp it on completions as
    ``policy_version`` so staleness can be measured.

    Optional capabilities, used when present: ``snapshot(name)`` keeps the current weights
    under a name that ``logprobs(batch, weights=name)`` scores with (GRPO's stage-start KL
    reference, SDFT's teacher), ``distributions(batch, topk=K)`` (logit distillation) and
    ``close()`` (called by ``run_recipe`` for a backend it built).
    """

    tokenizer: Any
    step: int

    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        """``num_samples`` completions for each prompt, with per-token sampler logprobs."""
        ...

    def logprobs(self, batch: Batch, reference: bool = False) -> Future[list[list[float]]]:
        """Per-target-token logprobs of each row (forward only). ``reference=True`` scores
        with the reference policy (LoRA adapter disabled, or a frozen copy)."""
        ...

    def forward_backward(self, batch: Batch, loss: Loss) -> Future[dict[str, float]]:
        """Accumulate gradients of ``loss`` over ``batch``; returns the loss's metrics."""
        ...

    def optim_step(self, params: AdamParams) -> Future[dict[str, float]]:
        """Apply (and clear) the accumulated gradients."""
        ...

    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """Save weights, optimizer state and ``extra`` (loop position, RNG) under ``path``."""
        ...

    def load(self, path: str) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; returns its ``extra``."""
        ...


# --------------------------------------------------------------------------- rewards
@dataclass
class RewardResult:
    """What a reward returns when a bare float is not enough."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Reward(Protocol):
    """Scores one completion of one example. May be sync or ``async def``; may return a float
    or a :class:`RewardResult`. A reward that raises, times out or returns NaN is recorded as a
    failure by the runner, never crashes the run."""

    def __call__(
        self, completion: str, example: Mapping[str, Any]
    ) -> float | RewardResult | Awaitable[float | RewardResult]: ...


# --------------------------------------------------------------------------- advantages
@runtime_checkable
class AdvantageEstimator(Protocol):
    """Maps rewards to advantages. Pure: ``rewards[i]`` belongs to group ``group_ids[i]``."""

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor: ...


# --------------------------------------------------------------------------- losses
@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Loss(Protocol):
    """A pure function of the model's per-token logprobs (``(B, T)``) and the padded batch
    (:meth:`tempering.types.Batch.to_tensors`).

    Positions: a backend may compute logprobs only at the target positions where some row has
    a non-zero ``batch["weights"]`` (the local one does: the LM head never runs on prompts);
    elsewhere ``logprobs`` holds 0 and has no gradient, so a loss reads only what its mask
    keeps (every built-in masks with ``weights != 0``). A loss that needs every position sets
    ``needs_all_positions = True`` (optional attribute; False when absent).

    Losses that need logits set ``needs_logits = True`` and read ``batch["logits"]``: the
    logits at every target position, ``(B, T, V)``, or -- when ``batch["logit_positions"]`` is
    present -- at those ``K`` positions only, ``(B, K, V)`` (sorted, the same for every row).
    :func:`at_positions` selects those columns of any ``(B, T, ...)`` batch tensor and
    :func:`from_positions` places ``(B, K)`` results back at their positions.

    ``tinker_builtin`` names the Tinker loss that computes exactly this (or ``None``): the
    Tinker backend then sends the batch to it instead of paying for a custom-loss forward.
    """

    needs_logits: bool
    tinker_builtin: str | None

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput: ...


def at_positions(tensor: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The columns ``positions`` of a ``(B, T, ...)`` batch tensor (``batch.get("logit_positions")``
    for the columns ``batch["logits"]`` covers); ``tensor`` itself for ``None``."""
    return tensor if positions is None else tensor[:, positions]


def from_positions(values: torch.Tensor, positions: torch.Tensor | None, width: int, fill: Any = 0) -> torch.Tensor:
    """The inverse of :func:`at_positions`: ``(B, K, ...)`` values placed at ``positions`` of a
    ``(B, width, ...)`` tensor holding ``fill`` elsewhere (differentiable in ``values``)."""
    if positions is None:
        return values
    out = values.new_full((values.shape[0], width, *values.shape[2:]), fill)
    return out.index_copy(1, positions, values)


# --------------------------------------------------------------------------- samplers
@runtime_checkable
class Sampler(Protocol):
    """Turns a batch of examples into groups of scored samples (see :mod:`tempering.rollout`).

    ``client`` is what to sample with: the backend, or a sampling client of a weight snapshot
    (``sample(prompts, n, params) -> Future``; completions carry ``policy_version``). The
    groups come back in the order of ``examples`` with ``group_id = first_id + i``. Built with
    its config keys and ``context`` (a :class:`tempering.rollout.SamplerContext`).
    """

    async def sample(
        self, client: Any, examples: list[dict[str, Any]], group_size: int, params: SamplingParams, first_id: int = 0
    ) -> Any: ...


# --------------------------------------------------------------------------- the rest
@runtime_checkable
class Dataset(Protocol):
    """Examples as dicts. ``prompt`` is the text to sample from; other keys are for rewards."""

    def __iter__(self) -> Any: ...
    def __len__(self) -> int: ...


@runtime_checkable
class Logger(Protocol):
    """Receives metrics per step; ``close`` writes what needs the whole run (a plot)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...
    def close(self) -> None: ...


@runtime_checkable
class Algorithm(Protocol):
    """A training stage: a bundle of components and the loop that drives them.

    ``run`` receives the shared :class:`tempering.recipe.RunContext` (backend, loggers,
    checkpoint dir, registry) and returns the stage's final metrics.
    """

    def run(self, ctx: Any) -> dict[str, Any]: ...


@runtime_checkable
class ModelBuilder(Protocol):
    """Builds ``(model, tokenizer)`` for the local backend (e.g. a tiny Llama built in code)."""

    def __call__(self) -> tuple[Any, Any]: ...


Examples = Iterable[Mapping[str, Any]]
