"""KL estimators from sampled tokens.

With only the logprobs of the sampled tokens (no full distributions), KL is estimated per
token. Schulman's k3, ``exp(d) - d - 1`` with ``d = log(ref / pi)``, is unbiased for
``KL(pi || ref)`` on samples from ``pi``, non-negative and low-variance, which is why GRPO
(TRL, DeepSeekMath) penalises it. (The off-policy diagnostics' ``is/kl`` is the same estimator
of ``KL(q || pi)`` written on the log-ratio: :func:`tempering.rlmath.diagnostics.ratio_stats`.)

On-policy distillation needs the other direction and no estimator's correction: the sampled
token's ``log pi - log teacher`` is unbiased for ``KL(pi || teacher)`` on the student's own
samples, and its negation (optionally summed into a discounted return-to-go) is the per-token
advantage (:func:`sampled_reverse_kl`, :func:`discounted_future_sum`, :func:`reverse_kl_advantages`).
"""

from __future__ import annotations

import torch

from tempering.rlmath.masks import active

__all__ = ["discounted_future_sum", "k3_kl", "reverse_kl_advantages", "sampled_reverse_kl"]


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi || ref) per token: ``exp(d) - d - 1``, ``d = ref - lp``.

    Non-negative, zero where the two agree. With ``mask``, masked positions get exactly 0 (and
    no gradient), so padding with arbitrary values cannot overflow ``exp``.
    """
    d = ref_logprobs - logprobs
    if mask is not None:
        d = torch.where(active(mask), d, torch.zeros_like(d))
    return torch.exp(d) - d - 1


def sampled_reverse_kl(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The per-token reverse KL(student || teacher) seen through the sampled token:
    ``log p_student(x_t) - log p_teacher(x_t)``, ``x_t`` drawn from the student.

    Its expectation over the student's own samples is ``KL(student || teacher)`` at that
    position, which is why on-policy distillation (the tinker-cookbook's
    ``incorporate_kl_penalty``, Thinking Machines' "on-policy distillation") uses it, negated,
    as a per-token advantage. With ``mask``, masked positions are exactly 0."""
    d = logprobs - teacher_logprobs
    return d if mask is None else torch.where(active(mask), d, torch.zeros_like(d))


def discounted_future_sum(values: torch.Tensor, discount: float) -> torch.Tensor:
    """``out[..., t] = sum_{k >= 0} discount**k * values[..., t + k]`` along the last dimension:
    the return-to-go of per-token penalties, so a token is also blamed for the divergence of
    what follows it (``discount`` in [0, 1]; 0 leaves ``values`` as they are, 1 sums the rest
    of the row). One backward pass over the positions."""
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"discounted_future_sum: discount must be in [0, 1], got {discount}")
    if discount == 0.0:
        return values.clone()
    out = torch.empty_like(values)
    running = torch.zeros_like(values[..., 0])
    for t in range(values.shape[-1] - 1, -1, -1):
        running = values[..., t] + discount * running
        out[..., t] = running
    return out


def reverse_kl_advantages(
    logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor, coef: float, discount: float = 0.0
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation: ``-coef * (lp - lp_teacher)`` on the
    mask (0 elsewhere), discounted into a return-to-go when ``discount > 0`` (the cookbook's
    ``kl_penalty_coef`` and ``kl_discount_factor``). A token the teacher finds likelier than
    the student does gets a positive advantage."""
    return discounted_future_sum(-coef * sampled_reverse_kl(logprobs, teacher_logprobs, mask), discount)
