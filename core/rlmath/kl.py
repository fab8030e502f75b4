"""KL estimators from sampled tokens.

With only the logprobs of the sampled tokens (no full distributions), KL is estimated per
token. Schulman's k3, ``exp(d) - d - 1`` with ``d = log(ref / pi)``, is unbiased for
``KL(pi || ref)`` on samples from ``pi``, non-negative and low-variance, which is why GRPO
(TRL, DeepSeekMath) penalises it. (The off-policy diagnostics' ``is/kl`` is the same estimator
of ``KL(q || pi)`` written on the log-ratio: :func:`tempering.rlmath.diagnostics.ratio_stats`.)
"""

from __future__ import annotations

import torch

from tempering.rlmath.masks import active

__all__ = ["k3_kl"]


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1``, ``d = ref - lp``.

    Non-negative, zero where the two agree. With ``mask``, masked positions get exactly 0 (and
    no gradient), so padding with arbitrary values cannot overflow ``exp``.
    """
    d = ref_logprobs - logprobs
    if mask is not None:
        d = torch.where(active(mask), d, torch.zeros_like(d))
    return torch.exp(d) - d - 1
