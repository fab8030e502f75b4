"""GRPO-style RL with verifiable rewards (``tempering.algorithms.grpo``).

- :mod:`tempering.algorithms.grpo.advantages`: group-relative advantage estimators
  (GRPO / Dr. GRPO / batch-std / RLOO) and the zero-variance-group helper.
- :mod:`tempering.algorithms.grpo.loss`: the clipped-surrogate policy loss with the TRL 1.16
  aggregation modes (``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``), k3 KL and GSPO
  sequence-level ratios.

This package's ``__init__`` imports nothing so that importing it stays cheap (no torch).
"""
