"""On-policy distillation from a teacher model (``tempering.algorithms.distill``).

- :mod:`~tempering.algorithms.distill.algorithm`: the ``distill`` stage (the RL engine holding a
  teacher and a KL term).
- :mod:`~tempering.algorithms.distill.teacher`: which model teaches, loaded by a backend, and
  the same-vocabulary check.
- :mod:`~tempering.algorithms.distill.kl`: the ``kl:`` block: sampled-token reverse KL as
  advantages (the cookbook's), or a top-k / full-vocabulary reverse KL loss.
- :mod:`~tempering.algorithms.distill.loss`: that loss (TRL's GKD with beta = 1, lambda = 1).

This package's ``__init__`` imports nothing so that importing it stays cheap (no torch).
"""
