"""Tinker's built-in losses, computed as Tinker's documentation defines them.

One function, :func:`builtin_loss`, gives the loss of *one datum* (Tinker's losses are sums over
a datum's positions, with no mask): ``lp`` is the trainer's logprob of each target token
(``(N,)``, or ``(N, K)`` for 2-D ``target_tokens``), ``inputs`` the datum's ``loss_fn_inputs``
as tensors. With ``r = exp(lp - q)`` (``q`` the ``logprobs`` input, the sampler's):

* ``cross_entropy``: ``-sum(weights * lp)`` (``weights`` absent: zeros, as the SDK's forward);
* ``importance_sampling``: ``-sum(r * A)``;
* ``ppo``: ``-sum(min(r * A, clip(r, lo, hi) * A))``;
* ``cispo``: ``-sum(sg(clip(r, lo, hi)) * lp * A)``;
* ``dro``: ``-sum(lp * A - beta / 2 * (lp - q)**2)``;
* ``stable_reinforce``: ``-sum(sg(min(r, C)) * lp * A)`` with ``C`` = :data:`STABLE_REINFORCE_CAP`,
  where ``q`` is not the client's ``logprobs`` input but what the *server* recorded when it
  sampled the token (``record_stability_info``; the service substitutes it, matched through the
  datum's provenance). Tinker documents the loss's interface (recorded sequences named by
  ``sequence_id``, provenance on every datum) but not its formula: this is our reading -- a
  truncated-importance-weighted REINFORCE on the sampler's own numbers, which stays bounded
  however stale the sample -- not a copy of the service's;
* ``gspo`` (GSPO-token): every token carries the value of the sequence ratio
  ``s = exp(mean over sequence_ratio_mask of (lp - q))`` with the gradient of its own
  logprob, ``s_t = sg(s) * exp(lp_t - sg(lp_t))``; ``-sum(min(s_t * A, clip(s_t, lo, hi) * A))``.

``lo``/``hi`` are ``loss_fn_config["clip_low_threshold" / "clip_high_threshold"]`` (ratios, e.g.
0.8 / 1.28); without them ``ppo`` and ``gspo`` take 0.8 / 1.2 (Tinker's fixed epsilon 0.2; its
GSPO page writes the clip with the same epsilons) and ``cispo`` 0.0 / 4.0. The formulas
themselves are the shared ones of :mod:`tempering.rlmath.policy_loss`
(the same functions our ``ppo``/``cispo``/``tis``/``importance_sampling`` losses call), applied
without a mask; this module holds what is Tinker's own: each built-in's inputs and config, and
the dispatch. Two users share it: the local Tinker server
(:mod:`~tempering.plugins.tinker_server.service`) computes the losses with it, and the
tests check with it that :mod:`~tempering.plugins.backends.tinker.mapping` sends rows on which
the built-in equals our loss, value and gradient.

A strict reading: a key a loss does not take, a missing input, or a missing threshold where the
documentation gives no default is a :class:`ValueError` (the local server answers it with
HTTP 400), so a client never silently runs with a service default it did not choose.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["BUILTIN_INPUTS", "BUILTIN_CONFIG", "STABLE_REINFORCE_CAP", "builtin_loss", "check_builtin"]

#: ``stable_reinforce``'s truncation of the importance ratio against the recorded sampler
#: logprobs (the cap of truncated importance sampling, as in our ``tis`` loss).
STABLE_REINFORCE_CAP = 2.0

#: ``loss_fn_inputs`` each built-in requires, and those it accepts.
BUILTIN_INPUTS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "cross_entropy": (frozenset({"target_tokens"}), frozenset({"target_tokens", "weights"})),
    **{
        name: (
            frozenset({"target_tokens", "logprobs", "advantages"}),
            frozenset({"target_tokens", "logprobs", "advantages"}),
        )
        for name in ("importance_sampling", "ppo", "cispo", "dro")
    },
    "stable_reinforce": (
        frozenset({"target_tokens", "advantages"}),
        frozenset({"target_tokens", "logprobs", "advantages"}),
    ),
    "gspo": (
        frozenset({"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"}),
        frozenset({"target_tokens", "logprobs", "advantages", "sequence_ratio_mask"}),
    ),
}
#: ``loss_fn_config`` keys each built-in takes, with the documented default (None: required).
BUILTIN_CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},  # "currently fixed to 0.2"
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},  # the loss docs' defaults
    "stable_reinforce": {},
    # Tinker's GSPO page writes the clip as PPO's, clip(s_t, 1 - eps_low, 1 + eps_high), and its PPO
    # page fixes eps to 0.2; the cookbook's rl_loop sends gspo with no config. So PPO's thresholds.
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": None},
}


def check_builtin(loss_fn: str, config: Mapping[str, Any] | None, keys: set[str] | frozenset[str]) -> dict[str, float]:
    """The loss's full config (defaults filled in) after checking its name, config keys and
    input keys; a :class:`ValueError` names what is wrong."""
    if loss_fn not in BUILTIN_INPUTS:
        raise ValueError(f"unknown loss_fn {loss_fn!r}; built-ins: {', '.join(BUILTIN_INPUTS)}")
    required, allowed = BUILTIN_INPUTS[loss_fn]
    if not required <= set(keys) or not set(keys) <= allowed:
        raise ValueError(
            f"{loss_fn} takes loss_fn_inputs {sorted(allowed)} (requires {sorted(required)}), got {sorted(keys)}"
        )
    known = BUILTIN_CONFIG[loss_fn]
    given = {str(k): float(v) for k, v in dict(config or {}).items()}
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise ValueError(
            f"loss_fn_config keys {unknown} are not valid for {loss_fn} (it takes {sorted(known) or 'none'})"
        )
    full: dict[str, float] = {}
    for key, default in known.items():
        if key in given:
            full[key] = given[key]
        elif default is None:
            raise ValueError(f"{loss_fn} needs loss_fn_config[{key!r}] (no documented default)")
        else:
            full[key] = default
    return full


def builtin_loss(loss_fn: str, config: Mapping[str, Any] | None, lp: Any, inputs: Mapping[str, Any]) -> Any:
    """Tinker's built-in ``loss_fn`` of one datum (a scalar tensor, differentiable in ``lp``).
    The formulas are :mod:`tempering.rlmath.policy_loss`'s, unmasked (``mask=None``)."""
    import torch

    from tempering.rlmath import policy_loss
    from tempering.rlmath.ratios import gspo_token_ratio

    cfg = check_builtin(loss_fn, config, frozenset(inputs))
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -(lp * weights).sum() if weights is not None else lp.sum() * 0.0
    q, adv = inputs["logprobs"], inputs["advantages"]  # stable_reinforce: the recorded sampler logprobs
    if loss_fn == "dro":
        return policy_loss.dro_loss(lp, q, adv, cfg["beta"])
    if loss_fn == "gspo":
        ratio = gspo_token_ratio(lp, q, inputs["sequence_ratio_mask"])
    else:
        ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return policy_loss.importance_sampling_loss(ratio, adv, None)
    if loss_fn == "stable_reinforce":
        return policy_loss.tis_loss(lp, ratio, adv, None, STABLE_REINFORCE_CAP)
    low, high = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    if loss_fn == "cispo":
        return policy_loss.cispo_loss(lp, ratio, adv, None, low, high)
    return policy_loss.ppo_loss(ratio, adv, None, low, high)  # ppo, gspo
