"""GRPO-style RLVR: sample a group per prompt, score with a verifiable reward, train on
group-relative advantages with a clipped policy-gradient loss.

The stage is the core's policy-gradient stage as it is
(:class:`tempering.training.policy_gradient.PolicyGradient`: the RL engine's loop, on-policy rollouts
through the stage's sampler -- single-turn completions or multi-turn environment episodes --, the
ratio's "old" logprobs and the KL to a reference); what is GRPO's own is its loss
(:mod:`tempering.algorithms.grpo.loss`), registered with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tempering.training.policy_gradient import PolicyGradient

__all__ = ["GRPO"]


@dataclass
class GRPO(PolicyGradient):
    """On-policy GRPO (see :class:`~tempering.training.policy_gradient.PolicyGradient` for the keys
    besides the RL engine's: ``recompute_logprobs``, ``log_kl``, ``kl_every``, ``reference``)."""

    label = "grpo"
