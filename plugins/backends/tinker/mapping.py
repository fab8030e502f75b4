"""How a :class:`~tempering.types.Batch` and one of our losses become Tinker training rows.

Tinker's built-in losses are *sums over tokens* of a fixed per-token formula (docs, "Loss
functions"), with ``r = exp(lp - q)`` (``lp`` the trainer's logprob of the target token, ``q`` the
``logprobs`` input, the sampler's):

* ``cross_entropy``: ``-sum(w * lp)``; with ``(N, K)`` ``target_tokens``/``weights``:
  ``-sum_{t,k} w[t,k] * log p(target[t,k])`` (top-k soft targets);
* ``importance_sampling``: ``-sum(r * A)``;
* ``ppo``: ``-sum(min(r * A, clip(r, lo, hi) * A))`` with ``lo``/``hi`` =
  ``loss_fn_config["clip_low_threshold" / "clip_high_threshold"]`` (ratios, e.g. 0.8 / 1.28);
* ``cispo``: ``-sum(sg(clip(r, lo, hi)) * lp * A)``;
* ``gspo`` (GSPO-token): ``-sum(min(s_t * A, clip(s_t, lo, hi) * A))``, every ``s_t`` the
  sequence ratio ``exp(mean over sequence_ratio_mask of (lp - q))`` in value, with the gradient
  of the token's own logprob.

The formulas are written out once, in :mod:`~tempering.plugins.tinker_server.builtin_losses`.

None of them has a mask: every position of ``target_tokens`` counts. So :func:`plan_loss` sends
``advantages = 0`` and ``logprobs = 0`` where our ``weights`` are 0 (such a position then adds
exactly 0 to the loss and its gradient, and ``r = exp(lp) <= 1`` cannot overflow), and folds any
normaliser of ours into the advantages: our aggregations (token mean, per-sequence mean,
constant) are linear in the per-token loss with non-negative coefficients ``c[b, t]``, and
``c * min(r A, clip(r) A) = min(r (cA), clip(r) (cA))`` for ``c >= 0``. Which built-in, with
which config and coefficients, is the loss's own declaration (the loss contract,
:mod:`tempering.loss_contract`: ``tinker_builtin``, or ``builtin(batch)`` -- GRPO's loss reads its
coefficients off its aggregation); this module only turns it into rows, and never imports an
algorithm. That makes the built-in compute *exactly* our loss as a function of the per-token
logprobs (tests/test_tinker_backend.py checks loss and gradient against the documented formulas).

GRPO with sequence-level ratios (GSPO) is Tinker's ``gspo`` when each row's loss mask is 0/1 and
its folded advantage is one value over the mask: our ratio ``exp(mean(lp - q))`` has gradient
``s / |M|`` for each of a row's ``|M|`` tokens, and summed over the row's tokens with one
advantage ``a`` that is ``s * a`` per token -- exactly GSPO-token's.

When no built-in is exact, the plan is ``custom``: ``forward_backward_custom`` with a wrapper
that evaluates our pure-torch loss on the logprobs Tinker returns (one extra forward pass).

This module imports neither torch nor the Tinker SDK at import time; :func:`to_tinker_data`
builds ``tinker.types.Datum`` rows from a plan.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import tempering.loss_contract as loss_contract
from tempering.interfaces import Loss
from tempering.loss_contract import (
    BUILTIN_LOSSES,
    POLICY_BUILTINS,
    SOFT_TARGET_IDS,
    SOFT_TARGET_WEIGHTS,
    BuiltinLoss,
    DeclaresBuiltin,
    NoBuiltin,
    builtin_of,
)
from tempering.types import Batch

__all__ = ["BUILTINS", "LossPlan", "plan_loss", "to_tinker_data", "RL_BUILTINS"]

#: Tinker's built-in losses (the loss contract's standard ones), and those that read
#: ``target_tokens``, ``logprobs`` (the sampler's) and ``advantages``.
BUILTINS, RL_BUILTINS = BUILTIN_LOSSES, POLICY_BUILTINS
#: ``Datum.extra`` keys that turn ``cross_entropy`` rows into ``(N, K)`` soft targets.
SOFT_IDS, SOFT_WEIGHTS = SOFT_TARGET_IDS, SOFT_TARGET_WEIGHTS


@dataclass
class LossPlan:
    """What :class:`~tempering.plugins.backends.tinker.backend.TinkerBackend` sends.

    ``loss_fn`` is a Tinker built-in name or ``"custom"``; ``inputs[i]`` holds the
    ``loss_fn_inputs`` of row ``i`` as plain lists (nested for ``(N, K)`` tensors), keyed as
    Tinker names them. ``note`` says why a built-in was or was not used.
    """

    loss_fn: str
    loss_fn_config: dict[str, float] | None
    inputs: list[dict[str, list[Any]]]
    note: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def custom(self) -> bool:
        return self.loss_fn == "custom"

    @property
    def two_dimensional(self) -> bool:
        """``(N, K)`` targets (top-k soft cross-entropy)."""
        return bool(
            self.inputs and self.inputs[0]["target_tokens"] and isinstance(self.inputs[0]["target_tokens"][0], list)
        )


def plan_loss(loss: Loss, batch: Batch) -> LossPlan:
    """The Tinker rows for ``loss`` on ``batch``: the built-in the loss declares (the loss
    contract, :func:`tempering.loss_contract.builtin_of`) when there is one, else ``custom``.
    Raises :class:`NotImplementedError` for losses Tinker cannot run at all (those that need
    full logits)."""
    if not batch.data:
        raise ValueError("forward_backward: the batch is empty")
    hook = getattr(loss, "tinker_plan", None)  # a third-party loss may map itself to Tinker's rows
    if callable(hook):
        plan = hook(batch)
        if plan is not None:
            return plan
    found = builtin_of(loss, batch)
    if isinstance(found, NoBuiltin):
        return custom_plan(loss, batch, found.reason)
    return _builtin_plan(loss, found, batch)


def custom_plan(loss: Loss, batch: Batch, note: str) -> LossPlan:
    """``forward_backward_custom``: only ``target_tokens`` and ``weights`` reach the service."""
    if loss_contract.needs_logits(loss):
        raise NotImplementedError(_logits_message(loss, note))
    inputs = _token_weight_inputs(batch)
    return LossPlan("custom", None, inputs, note=note + "; runs as forward_backward_custom (one extra forward pass)")


def _token_weight_inputs(batch: Batch) -> list[dict[str, list[Any]]]:
    """Each row's ``target_tokens`` and ``weights``: what a custom loss and cross_entropy send."""
    return [{"target_tokens": list(d.target_tokens), "weights": [float(w) for w in d.weights]} for d in batch.data]


# ---------------------------------------------------------------------- losses a built-in computes
def _builtin_plan(loss: Loss, builtin: BuiltinLoss, batch: Batch) -> LossPlan:
    name, config, who = builtin.name, dict(builtin.config) if builtin.config else None, type(loss).__name__
    if name == "cross_entropy":
        if config:
            raise ValueError(f"{who}: Tinker's cross_entropy takes no loss_fn_config (got {config})")
        soft = [SOFT_IDS in d.extra and SOFT_WEIGHTS in d.extra for d in batch.data]
        if any(soft) and not all(soft):
            raise ValueError(f"{who}: either every row has {SOFT_IDS}/{SOFT_WEIGHTS} (soft targets) or none does")
        if all(soft):
            soft_rows = [_soft_inputs(d, who) for d in batch.data]
            return LossPlan(
                name, None, soft_rows, note=f"{who} as Tinker's cross_entropy with (N, K) soft targets (exact)"
            )
        hard_rows = _token_weight_inputs(batch)
        return LossPlan(name, None, hard_rows, note=f"{who} as Tinker's cross_entropy (exact: a weighted sum)")
    _require(batch, ("sampler_logprobs", "advantages"), f"{who} (Tinker's {name})")
    import torch

    t = batch.to_tensors()
    coef = builtin.coefficients if builtin.coefficients is not None else (t["weights"] != 0).to(torch.float32)
    zero = torch.zeros_like(coef)
    # advantages scaled by the coefficients (the normaliser folded in) and sampler logprobs, both
    # 0 where a coefficient is 0: such a position adds exactly 0 and r = exp(lp) <= 1 cannot overflow
    adv = torch.where(coef != 0, t["advantages"] * coef, zero)
    old = torch.where(coef != 0, t["sampler_logprobs"], zero)
    inputs: list[dict[str, list[Any]]] = []
    for i, d in enumerate(batch.data):
        n = len(d.target_tokens)
        row = {
            "target_tokens": list(d.target_tokens),
            "logprobs": old[i, :n].tolist(),
            "advantages": adv[i, :n].tolist(),
        }
        if name == "gspo":
            row["sequence_ratio_mask"] = [1.0 if w else 0.0 for w in d.weights]
        bad = [x for x in row["logprobs"] + row["advantages"] if not math.isfinite(x)]
        if bad:
            raise ValueError(f"{who}: non-finite sampler logprobs or advantages on loss positions ({bad[:3]})")
        inputs.append(row)
    details = {"coefficients": builtin.coefficients} if builtin.coefficients is not None else {}
    note = builtin.note or f"{who} as Tinker's {name}"
    return LossPlan(name, config, inputs, note=note + " (weight-0 positions zeroed)", details=details)


def _soft_inputs(d: Any, who: str) -> dict[str, list[Any]]:
    ids, weights = _as_rows(d.extra[SOFT_IDS]), _as_rows(d.extra[SOFT_WEIGHTS])
    n = len(d.target_tokens)
    if len(ids) != n or len(weights) != n:
        raise ValueError(
            f"{who}: {SOFT_IDS}/{SOFT_WEIGHTS} need one row per target token ({n}), got {len(ids)}/{len(weights)}"
        )
    widths = {len(r) for r in ids} | {len(r) for r in weights}
    if len(widths) != 1:
        raise ValueError(f"{who}: {SOFT_IDS}/{SOFT_WEIGHTS} must be rectangular (T, K), got widths {sorted(widths)}")
    return {"target_tokens": [[int(x) for x in r] for r in ids], "weights": [[float(x) for x in r] for r in weights]}


def _as_rows(value: Any) -> list[list[Any]]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [list(r) for r in value]


def _require(batch: Batch, fields: Sequence[str], who: str) -> None:
    for name in fields:
        missing = [i for i, d in enumerate(batch.data) if getattr(d, name) is None]
        if missing:
            raise KeyError(f"{who} needs Datum.{name} on every row; rows {missing[:5]} have none")


def _logits_message(loss: object, reason: str) -> str:
    """Why a loss that needs logits cannot run on Tinker, with what to do instead: the loss's
    own word when its ``builtin(batch)`` declared none (:class:`~tempering.loss_contract.NoBuiltin`),
    else the general way out."""
    mode = getattr(loss, "mode", None)
    what = f"{type(loss).__name__}" + (f" (mode {mode!r})" if mode else "")
    hint = (
        f" {reason}"
        if isinstance(loss, DeclaresBuiltin)
        else " Express it on per-token logprobs, or as Tinker's cross_entropy with (N, K) soft targets "
        f"(tinker_builtin='cross_entropy' and Datum.extra['{SOFT_IDS}'/'{SOFT_WEIGHTS}'])."
    )
    return f"{what} needs the model's full logits (needs_logits=True), which Tinker does not return.{hint}"


# ---------------------------------------------------------------------- to the SDK's types
def to_tinker_data(batch: Batch, plan: LossPlan, types: ModuleType) -> list[Any]:
    """``tinker.types.Datum`` rows: ``model_input`` = our ``input_tokens``, ``loss_fn_inputs`` =
    the plan's, as explicitly typed ``TensorData`` (int64 tokens, float32 values)."""
    import numpy as np

    out = []
    for d, inputs in zip(batch.data, plan.inputs):
        tensors = {}
        for key, value in inputs.items():
            dtype = np.int64 if key == "target_tokens" else np.float32
            tensors[key] = types.TensorData.from_numpy(np.asarray(value, dtype=dtype))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(list(d.input_tokens)), loss_fn_inputs=tensors))
    return out


def plain_datum(datum: Any) -> dict[str, Any]:
    """A ``tinker.types.Datum`` as plain lists (for tests and debugging)."""
    return {
        "model_input": datum.model_input.to_ints(),
        "loss_fn_inputs": {k: v.tolist() for k, v in datum.loss_fn_inputs.items()},
    }


def describe(plan: LossPlan) -> Mapping[str, Any]:
    return {"loss_fn": plan.loss_fn, "loss_fn_config": plan.loss_fn_config, "note": plan.note}
