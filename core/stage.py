"""Pieces every training stage shares: optimizer settings and held-out evaluation settings.

They are nested blocks of a stage's config (``optimizer: {...}``, ``eval: {...}``), validated
with their own schema so a misspelt key reports e.g. ``stages[1].optimizer.learnig_rate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from tempering.registry import validate_params
from tempering.schedule import lr_at
from tempering.types import AdamParams

T = TypeVar("T")


def sub_config(cls: type[T], value: Any, path: str) -> T:
    """Validate a nested config block against dataclass ``cls`` and build it."""
    if isinstance(value, cls):
        return value
    return cls(**validate_params(cls, dict(value or {}), path))


@dataclass
class OptimizerConfig:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip_norm: float = 1.0
    schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    final_ratio: float = 0.0

    def adam(self, step: int, total: int) -> AdamParams:
        lr = lr_at(step, total, self.learning_rate, self.schedule, self.warmup_steps, self.final_ratio)
        return AdamParams(lr, self.beta1, self.beta2, self.eps, self.weight_decay, self.grad_clip_norm)


@dataclass
class EvalConfig:
    """Held-out evaluation: ``dataset`` (null = none), scored by ``reward`` every ``every``
    steps (0 = only at the start and end of the stage)."""

    dataset: Any = None
    reward: Any = "exact_match"
    every: int = 0
    max_tokens: int = 8
    temperature: float = 0.0
    at_start: bool = True


def check_eval(ctx: Any, value: Any) -> EvalConfig:
    """Validate an ``eval:`` block and the components it names."""
    ev = sub_config(EvalConfig, value, f"{ctx.path}.eval")
    if ev.dataset is not None and not isinstance(ev.dataset, list):
        ctx.check("dataset", ev.dataset, "eval.dataset")
        ctx.check("reward", ev.reward, "eval.reward")
    return ev


def check_stage(ctx: Any, stage: Any, components: tuple[str, ...] = ("loss",)) -> None:
    """Validate the blocks every training stage has -- ``optimizer``, ``eval``, ``dataset`` --
    and its named components (attribute name = component kind), without building them."""
    sub_config(OptimizerConfig, stage.optimizer, f"{ctx.path}.optimizer")
    check_eval(ctx, stage.eval)
    for kind in components:
        ctx.check(kind, getattr(stage, kind), kind)
    if not isinstance(stage.dataset, list):
        ctx.check("dataset", stage.dataset, "dataset")
