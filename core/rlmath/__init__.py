"""The shared RL maths (``tempering.rlmath``): pure torch functions, no stages, no backends.

Every algorithm and backend that needs an advantage, an importance ratio, a policy-gradient
loss, a normaliser or a KL estimate takes it from here, so each formula is written once and a
reader finds it in one hop. Nothing here imports :mod:`tempering.algorithms` or
:mod:`tempering.plugins`, holds state across calls (except the estimators' config fields) or
knows which backend runs it. New algorithms (SDPO, distillation) plug their maths in here.

Modules:

- :mod:`~tempering.rlmath.masks`: the loss-mask convention (``active``, ``masked``).
- :mod:`~tempering.rlmath.advantages`: group-relative advantage estimators (GRPO, Dr. GRPO,
  batch-std, RLOO), group statistics and the zero-variance-group test.
- :mod:`~tempering.rlmath.ratios`: log-importance weights (token / GSPO sequence level) and
  Tinker's GSPO-token ratio.
- :mod:`~tempering.rlmath.kl`: KL estimators from sampled tokens (Schulman's k3; the sampled
  reverse KL and its discounted return-to-go, on-policy distillation's advantages).
- :mod:`~tempering.rlmath.divergence`: divergences between whole next-token distributions
  (forward / reverse KL, generalised JSD; full vocabulary or top-k with a tail bucket), for
  distillation.
- :mod:`~tempering.rlmath.policy_loss`: policy-gradient losses: the clipped surrogate (PPO /
  GRPO, with INTELLECT-2's two-sided cap), GRPO's per-token loss with its k3 term, and the
  sum-over-tokens losses Tinker builds in (importance sampling, PPO, CISPO, TIS, DRO).
- :mod:`~tempering.rlmath.aggregation`: turning a per-token loss into a scalar (TRL's
  ``grpo``/``bnpo``/``dapo``/``dr_grpo``, ``seq_mean``/``token_mean``), and folding such a
  normaliser into the advantages of a sum loss (``fold_normaliser``,
  ``aggregation_coefficients``).
- :mod:`~tempering.rlmath.diagnostics`: clip fractions, ratio statistics, effective sample size.

Conventions, shared by every function: per-position tensors are ``(B, T)`` over *target*
positions as :meth:`tempering.types.Batch.to_tensors` pads them; a ``mask`` (the batch's
``weights``) is non-zero on the tokens that count, and masked positions may hold anything
(NaN, huge logprobs): functions *select* (``torch.where``) rather than multiply, because
``0 * NaN`` is NaN in a value and in a gradient.

The component registry (:mod:`tempering.registry`, filled by the algorithm plugins) is where
these become named components (``group_norm``, ``grpo``, ``ppo``, ...); this package has no
registry of its own, so there is one place a name is bound.

This ``__init__`` imports nothing (no torch), so importing the package stays cheap.
"""
