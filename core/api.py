"""The public import surface: what a user or a plugin author imports, in one place.

Why one module: the parts live where they belong (a recipe in ``tempering.training``, a loss's
batch names in ``tempering.loss_contract``, the RL maths in ``tempering.rlmath``, ...), which a
reader of the code needs; a *writer* of a recipe or a plugin should not have to learn that map
first. Everything here is re-exported from its home, unchanged, and the package root re-exports
it too, lazily (``from tempering import Recipe``), so ``import tempering`` stays cheap.

- Running: :class:`Recipe`.
- Writing a plugin: :data:`hookimpl`; stages (:class:`Stage`, :class:`RLStage`,
  :class:`PolicyGradient`, the :class:`RunContext` they receive) and the parts a stage composes
  (:class:`StaleRollouts` with its :class:`Staleness` block, :class:`TeacherWeights`,
  :func:`sub_config` for a block of one's own); losses (:class:`LossOutput`, the batch names a loss reads:
  :data:`WEIGHTS`, :data:`ADVANTAGES`, :data:`SAMPLER_LOGPROBS`, :data:`REF_LOGPROBS`,
  :data:`TARGET_IDS`; :func:`aggregate` and :data:`LOSS_TYPES`); rewards
  (:class:`RewardResult`); environments (:class:`Environment`, :func:`tool`, :class:`Scored`,
  :func:`mismatch`, :func:`quote`); config checks (:class:`Problem`, :func:`one_of`).
- The data that crosses between parts: :class:`Sample`, :class:`Group`, :class:`Datum`,
  :class:`Batch`, :class:`Completion`, :class:`SamplingParams`, :class:`AdamParams`.
- Errors: :class:`ConfigError`, :class:`PluginError`, :class:`TemperingError`,
  :class:`UnknownComponentError`.

Tests of a plugin import :mod:`tempering.testing` (``make_registry``, ``FakeBackend``,
``check_plugin``): the second and last module a plugin needs.
"""

from __future__ import annotations

from tempering.errors import ConfigError, PluginError, TemperingError, UnknownComponentError
from tempering.hookspecs import hookimpl
from tempering.interfaces import LossOutput, RewardResult, RunContext
from tempering.loss_contract import ADVANTAGES, REF_LOGPROBS, SAMPLER_LOGPROBS, TARGET_IDS, WEIGHTS
from tempering.rlmath.aggregation import LOSS_TYPES, aggregate
from tempering.rollouts.environment import Environment
from tempering.rollouts.feedback import Scored, mismatch, quote
from tempering.rollouts.tools import tool
from tempering.schema import Problem, one_of
from tempering.training.policy_gradient import PolicyGradient
from tempering.training.recipe import Recipe
from tempering.training.rl import RLStage
from tempering.training.stage import Stage, sub_config
from tempering.training.stale import Staleness, StaleRollouts
from tempering.training.teacher import TeacherWeights
from tempering.types import AdamParams, Batch, Completion, Datum, Group, Sample, SamplingParams

__all__ = [
    "ADVANTAGES",
    "LOSS_TYPES",
    "REF_LOGPROBS",
    "SAMPLER_LOGPROBS",
    "TARGET_IDS",
    "WEIGHTS",
    "AdamParams",
    "Batch",
    "Completion",
    "ConfigError",
    "Datum",
    "Environment",
    "Group",
    "LossOutput",
    "PluginError",
    "PolicyGradient",
    "Problem",
    "RLStage",
    "Recipe",
    "RewardResult",
    "RunContext",
    "Sample",
    "SamplingParams",
    "Scored",
    "Stage",
    "StaleRollouts",
    "Staleness",
    "TeacherWeights",
    "TemperingError",
    "UnknownComponentError",
    "aggregate",
    "hookimpl",
    "mismatch",
    "one_of",
    "quote",
    "sub_config",
    "tool",
]
