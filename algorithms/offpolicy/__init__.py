"""Asynchronous, off-policy RL (``tempering.algorithms.offpolicy``).

- :mod:`tempering.algorithms.offpolicy.algorithm`: the ``offpolicy`` stage -- GRPO-style groups
  sampled concurrently with training (:mod:`tempering.rollouts.async_rollout`), up to
  ``max_steps_off_policy`` optimizer steps stale, corrected by importance ratios.
- :mod:`tempering.algorithms.offpolicy.loss`: ``ppo``, ``cispo``, ``tis`` and ``clipped_is``
  losses (sums over tokens, as Tinker's built-ins; their formulas and the ratio/ESS
  diagnostics are :mod:`tempering.rlmath`'s), sampler-matched (tempered) scoring and
  advantage capping.

This package's ``__init__`` imports nothing so that importing it stays cheap (no torch).
"""
