"""Divergences between two next-token distributions, for distillation (SDFT, SDPO; on-policy
distillation next).

Where the KL estimators of :mod:`tempering.rlmath.kl` see only the sampled token, these compare
whole distributions (or a top-k support of them) at each position, which is a lower-variance
signal when the teacher's logits are available.

Divergence ``D_alpha(S, T)`` between the student's and the teacher's next-token distributions
(log-probabilities ``s``, ``t`` over the same support), TRL 1.16's convention
(``trl.experimental.sdft``'s ``compute_divergence``):

* ``alpha = 0``: forward KL, ``KL(T || S) = sum p_t (t - s)``;
* ``alpha = 1``: reverse KL, ``KL(S || T) = sum p_s (s - t)``;
* otherwise the generalised Jensen-Shannon divergence with mixture
  ``M = (1 - alpha) S + alpha T``: ``(1 - alpha) KL(S || M) + alpha KL(T || M)`` (it tends to 0,
  not to the forward KL, as alpha -> 0: the end points are special-cased, as in TRL).

On a top-k support the two distributions are either renormalised on it, or given one more
category, the tail bucket, holding the leftover mass ``1 - sum`` (:func:`add_tail_bucket`), so
mass the student puts outside the support is still penalised.
"""

from __future__ import annotations

import math

import torch

__all__ = ["add_tail_bucket", "divergence", "full_logits_loss", "sampled_token_loss", "topk_logits_loss"]


def divergence(student_logp: torch.Tensor, teacher_logp: torch.Tensor, alpha: float) -> torch.Tensor:
    """``D_alpha(S, T)`` summed over the last dimension (see the module docstring)."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"divergence: alpha must be in [0, 1], got {alpha}")
    p_s, p_t = student_logp.exp(), teacher_logp.exp()
    if alpha == 0.0:
        return (p_t * (teacher_logp - student_logp)).sum(-1)
    if alpha == 1.0:
        return (p_s * (student_logp - teacher_logp)).sum(-1)
    mix = torch.logaddexp(student_logp + math.log(1.0 - alpha), teacher_logp + math.log(alpha))
    return ((1.0 - alpha) * p_s * (student_logp - mix) + alpha * p_t * (teacher_logp - mix)).sum(-1)


def add_tail_bucket(logp: torch.Tensor) -> torch.Tensor:
    """Append ``log(1 - sum exp(logp))`` (the mass outside the support) as one more category.
    The captured mass is capped just below 1 so the bucket stays finite."""
    captured = torch.logsumexp(logp, dim=-1, keepdim=True).clamp(max=-1e-7)
    return torch.cat([logp, torch.log1p(-captured.exp())], dim=-1)


def _on_support(
    student_logp: torch.Tensor, teacher_logp: torch.Tensor, add_tail: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both log-distributions restricted to a support: renormalised on it, or with the mass
    outside it as one more category (``add_tail``)."""
    if add_tail:
        return add_tail_bucket(student_logp), add_tail_bucket(teacher_logp)
    return (
        student_logp - torch.logsumexp(student_logp, -1, keepdim=True),
        teacher_logp - torch.logsumexp(teacher_logp, -1, keepdim=True),
    )


def full_logits_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-position ``D_alpha`` over the full vocabulary, ``(..., V) -> (...)``."""
    return divergence(torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1), alpha)


def topk_logits_loss(
    student_logits: torch.Tensor,
    alpha: float,
    k: int,
    add_tail: bool = False,
    teacher_logits: torch.Tensor | None = None,
    teacher_topk_logprobs: torch.Tensor | None = None,
    teacher_topk_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position ``D_alpha`` on a top-k support: the student's top-k (when
    ``teacher_logits`` is given) or the teacher's (``teacher_topk_logprobs`` + ``_ids``)."""
    student_logp = torch.log_softmax(student_logits, -1)
    if teacher_logits is not None:
        ids = torch.topk(student_logp, k=min(k, student_logp.size(-1)), dim=-1).indices
        s = student_logp.gather(-1, ids)
        t = torch.log_softmax(teacher_logits, -1).gather(-1, ids)
    else:
        if teacher_topk_logprobs is None or teacher_topk_ids is None:
            raise ValueError("topk_logits_loss: give teacher_logits, or teacher_topk_logprobs and teacher_topk_ids")
        ids = teacher_topk_ids.long()[..., :k]
        s = student_logp.gather(-1, ids)
        t = teacher_topk_logprobs.to(student_logp.dtype)[..., :k]
    s, t = _on_support(s, t, add_tail)
    return divergence(s, t, alpha)


def sampled_token_loss(logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """The per-token reverse KL seen through the sampled token only: ``sg(lp - lp_t) * lp``.

    Its value is a surrogate; its gradient ``(lp - lp_t) grad lp`` is the policy gradient of
    ``KL(student || teacher)`` estimated from the student's own sample (a REINFORCE step with
    advantage ``lp_t - lp``), which is why it needs no logits and only alpha = 1 makes sense.
    TRL 1.16's ``compute_sampled_token_self_distillation_loss`` (SDPO's default mode)."""
    return (logprobs - teacher_logprobs).detach() * logprobs
