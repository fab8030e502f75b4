"""Group-relative advantage estimators for RL with verifiable rewards (GRPO, Dr. GRPO, RLOO).

Shared by every RL stage: the RL engine (:mod:`tempering.training.rl`) turns a batch's rewards into
advantages with one of these, whichever algorithm runs (``grpo``, ``offpolicy``); the plugins
register them as ``group_norm``, ``dr_grpo`` and ``rloo``.

Every estimator is a small dataclass whose fields are its config keys and whose ``__call__``
has the :class:`tempering.interfaces.AdvantageEstimator` signature::

    estimator(rewards: Tensor[N] float, group_ids: Tensor[N] long) -> Tensor[N]

``rewards[i]`` belongs to the group ``group_ids[i]``. Group ids are arbitrary integers (not
necessarily contiguous, sorted or starting at 0) and groups may have different sizes: unlike
TRL, which reshapes rewards into ``(-1, num_generations)``, nothing here assumes equal groups.

Conventions (checked against ``trl.GRPOTrainer._generate_and_score_completions``, TRL 1.16):

- **Standard deviation is unbiased** (Bessel's correction, divide by ``n - 1``), as TRL's
  ``trl.trainer.utils.nanstd``. A group of one (or a batch of one, for ``scale="batch"``) has
  no defined std; we use 0, which gives advantage 0 because ``r - mean`` is 0 there too.
- **eps is added to the std**, not inside a square root: ``(r - mean_g) / (std + eps)`` with
  TRL's hard-coded ``eps = 1e-4``.
- ``scale="group"`` divides by the group's std, ``scale="batch"`` by the std of all rewards in
  the call (the "PPO Lite" / TRL ``scale_rewards="batch"`` mode; the mean stays per group),
  ``scale="none"`` only subtracts the group mean (Dr. GRPO; ``eps`` is then unused).
- **NaN rewards** (an unscorable completion) are left out of every mean and std, and get
  advantage 0, as TRL does with ``nanmean``/``nanstd`` and ``nan_to_num``.
- The output has the dtype and device of ``rewards``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tempering.schema import Problem, one_of, raise_problems

__all__ = [
    "GroupNormAdvantage",
    "MeanOnlyAdvantage",
    "RLOOAdvantage",
    "group_stats",
    "zero_variance_groups",
]

_SCALES = ("group", "batch", "none")


def _check(rewards: torch.Tensor, group_ids: torch.Tensor) -> None:
    if rewards.dim() != 1 or group_ids.dim() != 1 or rewards.shape != group_ids.shape:
        raise ValueError(
            f"advantages: rewards and group_ids must be 1-D of the same length, got {tuple(rewards.shape)} "
            f"and {tuple(group_ids.shape)}"
        )
    if not torch.is_floating_point(rewards):
        raise TypeError(f"advantages: rewards must be a float tensor, got {rewards.dtype}")


def group_stats(rewards: torch.Tensor, group_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per-element statistics of each element's group, ignoring NaN rewards.

    Returns ``(count, total, mean, std)``, each of shape ``(N,)``: the number of valid (non-NaN)
    rewards in the element's group, their sum, their mean and their unbiased std (0 for groups
    with fewer than two valid rewards; ``mean`` is 0 for a group with none).
    """
    _check(rewards, group_ids)
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    valid = ~torch.isnan(rewards)
    r = torch.where(valid, rewards, torch.zeros_like(rewards))
    zeros = torch.zeros(n_groups, dtype=rewards.dtype, device=rewards.device)
    count = zeros.clone().index_add_(0, inverse, valid.to(rewards.dtype))
    total = zeros.clone().index_add_(0, inverse, r)
    mean = total / count.clamp(min=1)
    dev2 = torch.where(valid, (r - mean[inverse]) ** 2, torch.zeros_like(r))
    sq = zeros.clone().index_add_(0, inverse, dev2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq))
    return count[inverse], total[inverse], mean[inverse], std[inverse]


def _batch_std(rewards: torch.Tensor) -> torch.Tensor:
    valid = rewards[~torch.isnan(rewards)]
    if valid.numel() < 2:
        return torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    return valid.std(unbiased=True)


def zero_variance_groups(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """``BoolTensor[N]``: True for every member of a group whose (non-NaN) rewards have zero
    spread -- all equal, a single valid reward, or none. Such groups give zero advantage and
    no policy-gradient signal, so a recipe may drop them ("drop zero-variance groups").

    "Zero" uses ``torch.isclose(std, 0)`` (default tolerances), like TRL's
    ``frac_reward_zero_std`` metric.
    """
    _, _, _, std = group_stats(rewards, group_ids)
    return torch.isclose(std, torch.zeros_like(std))


@dataclass
class GroupNormAdvantage:
    """GRPO advantage ``A_i = (r_i - mean_g) / (std + eps)``.

    ``scale``: ``"group"`` uses the group's unbiased std (TRL ``scale_rewards="group"``, the
    default), ``"batch"`` the unbiased std of all rewards in the call (TRL
    ``scale_rewards="batch"``), ``"none"`` no division: ``A_i = r_i - mean_g`` (Dr. GRPO, TRL
    ``scale_rewards="none"``). ``eps`` defaults to TRL's constant ``1e-4``.
    """

    eps: float = 1e-4
    scale: str = "group"

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The estimator's schema check (:mod:`tempering.schema`): the registry runs it before
        building, ``__post_init__`` too."""
        scale = config["scale"]
        yield one_of("scale", scale, _SCALES, f"GroupNormAdvantage.scale must be one of {_SCALES}, got {scale!r}")
        if config["eps"] < 0:
            yield Problem("eps", f"GroupNormAdvantage.eps must be >= 0, got {config['eps']}")

    def __post_init__(self) -> None:
        raise_problems(self)

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        _, _, mean, std = group_stats(rewards, group_ids)
        adv = rewards - mean
        if self.scale == "group":
            adv = adv / (std + self.eps)
        elif self.scale == "batch":
            adv = adv / (_batch_std(rewards) + self.eps)
        return torch.nan_to_num(adv, nan=0.0)


@dataclass
class MeanOnlyAdvantage:
    """Dr. GRPO advantage ``A_i = r_i - mean_g`` (no std division); the same as
    ``GroupNormAdvantage(scale="none")``."""

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        return GroupNormAdvantage(scale="none")(rewards, group_ids)


@dataclass
class RLOOAdvantage:
    """Leave-one-out baseline: ``A_i = r_i - mean_{j in g, j != i} r_j``, which equals
    ``n / (n - 1) * (r_i - mean_g)``. A member with no other valid member in its group
    (singleton group) gets 0; NaN rewards get 0 and are not part of anyone's baseline."""

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
        count, total, _, _ = group_stats(rewards, group_ids)
        others = count - 1
        baseline = (total - rewards) / others.clamp(min=1)
        adv = torch.where(others > 0, rewards - baseline, torch.zeros_like(rewards))
        return torch.nan_to_num(adv, nan=0.0)
