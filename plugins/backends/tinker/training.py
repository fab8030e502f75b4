"""Training on Tinker: a loss checked locally before it is sent, a custom loss as the SDK runs
it, the metrics of a ``forward_backward`` and an ``optim_step``.

Which loss goes out (a Tinker built-in where that is exact, else ``forward_backward_custom``)
is :mod:`tempering.plugins.backends.tinker.mapping`'s plan; this module runs the plan's loss
on our side: once on zero logprobs before anything is sent (a loss that cannot run would
otherwise poison the SDK's training client for good), and on the logprobs Tinker returns, for
the loss's own metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch

import tempering.loss_contract as loss_contract
from tempering.interfaces import Loss
from tempering.plugins.backends.common import float_metrics
from tempering.plugins.backends.tinker.errors import TinkerLossError, one_line
from tempering.plugins.backends.tinker.mapping import LossPlan
from tempering.plugins.backends.tinker.scoring import tensor_list
from tempering.types import AdamParams


def dry_run(loss: Loss, tensors: dict[str, Any]) -> None:
    """Run ``loss`` on zero logprobs, with a gradient, before anything is sent: the SDK runs a
    custom loss inside the training client's queue, where an error poisons the client for good.
    Catches what does not depend on the logprobs' values (missing inputs, wrong shapes, a
    non-scalar loss, non-numeric metrics)."""
    try:
        lp = torch.zeros_like(tensors["weights"], dtype=torch.float32, requires_grad=True)
        out = loss(lp, tensors)
        value = getattr(out, "loss", None)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(
                f"it must return a LossOutput with a scalar tensor .loss, got {type(value).__name__}"
                + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else "")
            )
        value.backward()
        float_metrics(getattr(out, "metrics", {}) or {}, type(loss).__name__)
    except Exception as err:
        raise TinkerLossError(
            f"forward_backward: {type(loss).__name__} failed on zero logprobs before anything was sent to Tinker "
            f"({type(err).__name__}: {one_line(err)}); "
            "the batch lacks what the loss reads (e.g. ref_logprobs: give the "
            "stage a reference) or the loss is wrong"
        ) from err


def custom_loss_fn(loss: Loss, tensors: dict[str, Any], captured: dict[str, Any]) -> Callable[..., Any]:
    """The ``forward_backward_custom`` callable: our loss on the logprobs Tinker returns.

    The SDK passes one logprob tensor per row (requires grad) and back-propagates the returned
    scalar to them; it then sends ``-d loss / d logprobs`` as cross-entropy weights, which gives
    the service exactly our gradient. The loss's output is kept in ``captured["out"]`` for its
    metrics."""

    def tempering_custom_loss(data: Sequence[Any], logprobs_list: Sequence[Any]) -> tuple[Any, dict[str, float]]:
        width = tensors["weights"].shape[1]
        rows = [
            torch.nn.functional.pad(lp.to(torch.float32).reshape(-1), (0, width - lp.numel())) for lp in logprobs_list
        ]
        out = loss(torch.stack(rows), tensors)
        value = getattr(out, "loss", None)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(
                f"forward_backward: {type(loss).__name__} must return a LossOutput with a scalar tensor .loss"
            )
        captured["out"] = out
        return value, {}

    return tempering_custom_loss


def loss_metrics(
    out: Any, plan: LossPlan, loss: Loss, tensors: dict[str, Any], captured: dict[str, Any]
) -> dict[str, float]:
    """The metrics of a finished ``forward_backward``: the loss's own (from the custom run, or
    the loss recomputed on the per-token logprobs a built-in returned), its value, and the
    service's ``loss:sum``."""
    server = dict(getattr(out, "metrics", None) or {})
    metrics: dict[str, float] = {}
    if plan.custom and "out" in captured:
        result = captured["out"]
    elif not loss_contract.needs_logits(loss) and not plan.two_dimensional:
        rows = [torch.tensor(tensor_list(o["logprobs"]), dtype=torch.float32) for o in out.loss_fn_outputs]
        width = tensors["weights"].shape[1]
        lp = torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[0])) for r in rows])
        with torch.no_grad():
            result = loss(lp, tensors)
    else:
        result = None
    if result is not None:
        metrics.update(float_metrics(getattr(result, "metrics", {}) or {}, type(loss).__name__))
        metrics["loss"] = float(result.loss.detach())
    elif "loss:sum" in server:
        metrics["loss"] = float(server["loss:sum"])
    if "loss:sum" in server:
        metrics["tinker/loss_sum"] = float(server["loss:sum"])
    metrics["tinker/custom_loss"] = float(plan.custom)
    return metrics


def tinker_adam(types: ModuleType, params: AdamParams) -> Any:
    """Ours -> ``tinker.types.AdamParams`` (the same fields)."""
    return types.AdamParams(
        learning_rate=float(params.learning_rate),
        beta1=float(params.beta1),
        beta2=float(params.beta2),
        eps=float(params.eps),
        weight_decay=float(params.weight_decay),
        grad_clip_norm=float(params.grad_clip_norm),
    )


def optim_metrics(response: object, lr: float) -> dict[str, float]:
    """The learning rate used and the service's own optimizer metrics (``tinker/...``)."""
    metrics = {"lr": lr}
    for key, value in (getattr(response, "metrics", None) or {}).items():
        metrics[f"tinker/{key}"] = float(value)
    return metrics
