"""Capping per-token advantages at a multiple of their running mean ``|A|``.

Part of the stale-rollout recipe ("clipped importance ratios and capped advantages"): a stale
batch whose group happened to be extreme cannot push the policy harder than ``multiple`` times
what a typical token does. Pure Python over lists (the batch's rows as the stage holds them),
so the same numbers go to every backend, Tinker's built-in losses included.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["AdvantageCap", "CapsAdvantages", "cap_advantages"]


def cap_advantages(rows: list[list[float]], weights: list[list[float]], cap: float) -> tuple[list[list[float]], int]:
    """Clamp every loss token's advantage to ``[-cap, cap]``; returns the new rows and how many
    tokens were capped. Off-mask positions are left as they are."""
    n = 0
    out = []
    for adv, w in zip(rows, weights):
        row = []
        for a, m in zip(adv, w):
            if m != 0 and abs(a) > cap:
                a = cap if a > 0 else -cap
                n += 1
            row.append(a)
        out.append(row)
    return out, n


@runtime_checkable
class CapsAdvantages(Protocol):
    """A loss that asks its stage to cap its advantages (the ``offpolicy`` losses): a cap at
    ``advantage_cap`` times the running mean ``|A|`` (``None``: off), whose mean moves with
    ``advantage_cap_momentum``. Read by the stage, typed, instead of probed."""

    advantage_cap: float | None
    advantage_cap_momentum: float


class AdvantageCap:
    """Caps per-token ``|A|`` at ``multiple`` x its running mean (the stale-rollout recipe).

    The running mean is an exponential moving average (``momentum``) of each batch's mean
    ``|A|`` over loss tokens with a non-zero advantage (zero-variance groups would otherwise
    drag it down and cap the rare informative group); the first batch initialises it. The
    cap for a batch uses the mean *including* that batch. ``multiple=None`` disables it.
    """

    def __init__(self, multiple: float | None, momentum: float = 0.9, mean: float | None = None) -> None:
        if multiple is not None and multiple <= 0:
            raise ValueError(f"AdvantageCap: multiple must be > 0 (or None), got {multiple}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"AdvantageCap: momentum must be in [0, 1), got {momentum}")
        self.multiple, self.momentum, self.mean = multiple, momentum, mean

    @classmethod
    def for_loss(cls, loss: object, mean: float | None = None) -> AdvantageCap:
        """The cap ``loss`` asks for (:class:`CapsAdvantages`); none for any other loss."""
        if isinstance(loss, CapsAdvantages):
            return cls(loss.advantage_cap, loss.advantage_cap_momentum, mean)
        return cls(None, 0.9, mean)

    def __call__(
        self, rows: list[list[float]], weights: list[list[float]]
    ) -> tuple[list[list[float]], dict[str, float]]:
        if self.multiple is None:
            return rows, {}
        values = [abs(a) for adv, w in zip(rows, weights) for a, m in zip(adv, w) if m != 0 and a != 0]
        if not values:
            return rows, {
                "advantage/cap": float("inf") if self.mean is None else self.multiple * self.mean,
                "advantage/capped_frac": 0.0,
            }
        batch_mean = sum(values) / len(values)
        self.mean = batch_mean if self.mean is None else self.momentum * self.mean + (1 - self.momentum) * batch_mean
        cap = self.multiple * self.mean
        rows, n = cap_advantages(rows, weights, cap)
        return rows, {"advantage/cap": cap, "advantage/capped_frac": n / len(values)}
