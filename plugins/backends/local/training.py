"""The local backend's forward passes: scoring without gradients (Tinker's ``forward``:
``logprobs``, ``distributions``) and training (``forward_backward``, ``optim_step`` with AdamW).

Scoring and training share how a batch becomes tensors and logits; the choice of weights to
score with is :meth:`~tempering.plugins.backends.local.weights.PolicyWeights.scoring_model`'s.
"""

from __future__ import annotations

from typing import Any

import torch

import tempering.loss_contract as loss_contract
import tempering.plugins.backends.local.distributed as distributed
import tempering.plugins.backends.local.sharding as sharding
from tempering.interfaces import Loss, at_positions, from_positions
from tempering.plugins.backends.common import float_metrics
from tempering.plugins.backends.local.logprobs import (
    model_logits,
    next_token_distributions,
    selected_token_logprobs,
    trained_positions,
)
from tempering.plugins.backends.local.weights import PolicyWeights
from tempering.types import AdamParams, Batch


class Trainer:
    """Scores and trains ``weights.model``; owns the optimizer (created on first use).

    Args:
        weights: the policy's weights (and snapshots / reference to score with).
        pad_token_id: what padded positions hold.
        device: where batches go.
        world_size: data-parallel ranks; gradients are averaged across them before clipping.
    """

    def __init__(self, weights: PolicyWeights, pad_token_id: int, device: torch.device, world_size: int) -> None:
        self.weights = weights
        self.pad_token_id = pad_token_id
        self.device = device
        self.world_size = world_size
        self.optimizer: torch.optim.Optimizer | None = None

    # ------------------------------------------------------------------ scoring
    def logprobs(self, batch: Batch, reference: bool, weights: str | None = None) -> list[list[float]]:
        """Every target position's logprob (Tinker's ``forward``), log-softmaxed chunk by chunk."""
        tensors = batch.to_tensors(self.pad_token_id, device=self.device)
        with torch.no_grad(), self.weights.scoring_model(reference, weights) as model:
            model.eval()
            logits = model_logits(model, tensors["input_ids"], tensors["attention_mask"])
            lp = selected_token_logprobs(logits, tensors["target_ids"])
        return [lp[i, : len(d.target_tokens)].tolist() for i, d in enumerate(batch.data)]

    def distributions(self, batch: Batch, reference: bool, weights: str | None, topk: int | None) -> list[Any]:
        tensors = batch.to_tensors(self.pad_token_id, device=self.device)
        out: list[Any] = []
        with torch.no_grad(), self.weights.scoring_model(reference, weights) as model:
            model.eval()
            logits = model_logits(model, tensors["input_ids"], tensors["attention_mask"])
            for i, d in enumerate(batch.data):
                dist = next_token_distributions(logits[i, : len(d.target_tokens)], topk)
                # topk: a (values, ids) pair; else the full distributions, one tensor
                out.append((dist[0].cpu(), dist[1].cpu()) if isinstance(dist, tuple) else dist.cpu())
        return out

    # ------------------------------------------------------------------ training
    def forward_backward(self, batch: Batch, loss: Loss) -> dict[str, float]:
        """The LM head runs only at the positions some row trains on (unless the loss sets
        ``needs_all_positions``); logprobs elsewhere are 0 (see :class:`~tempering.interfaces.Loss`)
        and a ``needs_logits`` loss gets the logits there with ``batch["logit_positions"]``."""
        model = self.weights.model
        tensors = batch.to_tensors(self.pad_token_id, device=self.device)
        positions = None if loss_contract.needs_all_positions(loss) else trained_positions(tensors["weights"])
        model.train()
        logits = model_logits(model, tensors["input_ids"], tensors["attention_mask"], positions)
        lp = selected_token_logprobs(logits, at_positions(tensors["target_ids"], positions))
        lp = from_positions(lp, positions, tensors["target_ids"].shape[1])
        if loss_contract.needs_logits(loss):
            tensors["logits"] = logits
            if positions is not None:
                tensors["logit_positions"] = positions
        out = loss(lp, tensors)
        value = getattr(out, "loss", None)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(
                f"forward_backward: {type(loss).__name__} must return a LossOutput with a scalar tensor .loss"
            )
        value.backward()
        metrics = float_metrics(getattr(out, "metrics", {}) or {}, type(loss).__name__)
        metrics["loss"] = float(value.detach())
        return metrics

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """One AdamW step on the accumulated (rank-averaged) gradients, then clear them; a
        non-finite gradient norm skips the step."""
        grads = self._averaged_grads()
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        norm = sharding.clip_grad_norm_(grads, max_norm)  # the global norm, sharded or not
        finite = bool(torch.isfinite(torch.tensor(norm)))
        optimizer = self.get_optimizer()
        for group in optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        if finite:  # a NaN/inf gradient would poison the weights and Adam's moments for good
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return {
            "grad_norm": norm,
            "lr": float(params.learning_rate),
            "grad_clipped": float(finite and norm > max_norm),
            "skipped_nonfinite": float(not finite),
        }

    def _averaged_grads(self) -> list[torch.Tensor]:
        """The parameters that have gradients, with those averaged across ranks.

        Under data parallelism every rank reduces every trainable tensor (a missing gradient
        counts as zeros) so that the collective calls line up and all ranks step identically.
        """
        trainable = self.weights.tensors
        if self.world_size > 1 and not self.weights.sharded:  # FSDP's backward already averaged them
            for p in trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            distributed.all_reduce_mean_([p.grad for p in trainable])
        return [p for p in trainable if p.grad is not None]

    def get_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the trainable tensors, created on first use; hyper-parameters are set on
        its param groups at every step, so changing AdamParams never loses its moments."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.weights.tensors, lr=1e-4)
        return self.optimizer
