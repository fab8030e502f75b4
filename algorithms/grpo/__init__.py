"""GRPO-style RL with verifiable rewards (``tempering.algorithms.grpo``).

- :mod:`tempering.algorithms.grpo.algorithm`: the ``grpo`` stage (the RL engine, on-policy).
- :mod:`tempering.algorithms.grpo.loss`: ``GRPOLoss``, the clipped-surrogate policy loss with the
  TRL 1.16 aggregation modes (``grpo``, ``dapo``, ``dr_grpo``, ``bnpo``), k3 KL and GSPO
  sequence-level ratios, built from :mod:`tempering.rlmath`'s functions.
- :mod:`tempering.algorithms.grpo.advantages`: re-exports the advantage estimators, which live
  in :mod:`tempering.rlmath.advantages`.

This package's ``__init__`` imports nothing so that importing it stays cheap (no torch).
"""
