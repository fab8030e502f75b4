"""GRPO-style RL with verifiable rewards (``tempering.algorithms.grpo``).

- :mod:`tempering.algorithms.grpo.algorithm`: the ``grpo`` stage (the RL engine, on-policy).
- :mod:`tempering.algorithms.grpo.loss`: ``GRPOLoss``, the clipped-surrogate policy loss with the
  TRL 1.16 aggregation modes (``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``), k3 KL and GSPO
  sequence-level ratios, built from :mod:`tempering.rlmath`'s functions.
- The advantage estimators it uses live in :mod:`tempering.rlmath.advantages` (every RL stage's).

This package's ``__init__`` imports nothing so that importing it stays cheap (no torch).
"""
