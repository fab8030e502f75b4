"""Per-token log-probabilities from a causal LM without a float32 ``(B, T, V)`` log-softmax.

Why: ``torch.log_softmax(logits.float(), -1)`` over the whole vocabulary at every position of
every row, kept for backward, is the largest tensor of a training step -- 8 rows x 4,096
positions x 152k (Qwen3's vocabulary) x 4 bytes is 20 GB per copy -- so a real model runs out of
memory long before its weights do. Three pieces avoid it:

* :func:`trained_positions` and :func:`model_logits`: the LM head runs only at the target
  positions some row trains on (non-zero loss weight; prompts are skipped), through the model's
  own forward with ``logits_to_keep``, so peft's wrapper and FSDP's root hooks (which gather the
  head's weights) run as for any forward;
* :func:`selected_token_logprobs`: ``log p(target)`` computed one chunk of positions at a time,
  in forward and again in backward, keeping only the logits themselves for backward;
* :func:`next_token_distributions`: full distributions (or their top-k, SDFT's teacher), one
  chunk of positions at a time.

In forward each chunk runs exactly the ops the unchunked expression ran (``log_softmax`` of
the float32 logits, then ``gather``), and in backward the ops autograd runs for it; both are
row-wise, so values and gradients are bitwise those of ``torch.log_softmax(logits.float(),
-1).gather(-1, targets)`` (``tests/test_forward_memory.py``). A log-sum-exp formula (``logit -
logsumexp``) would be as cheap but sums in another order: up to 2e-5 away from torch's
log-softmax over a 49k vocabulary.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.autograd.function import FunctionCtx, once_differentiable

from tempering.plugins.backends.local.sharding import transformers_model

CHUNK_BYTES = 64 * 2**20
"""About how many bytes of float32 ``(positions, V)`` scratch one chunk may use."""


def chunk_size(vocab: int, chunk_bytes: int | None = None) -> int:
    """Positions per chunk: a ``(chunk, vocab)`` float32 block of about ``chunk_bytes``
    (default :data:`CHUNK_BYTES`)."""
    return max(1, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // (4 * max(vocab, 1)))


def trained_positions(weights: torch.Tensor) -> torch.Tensor | None:
    """The target positions (columns of the ``(B, T)`` batch) where some row has a non-zero
    loss weight, as a sorted 1-D index tensor; ``None`` when that is every position.

    One index for all rows (what ``logits_to_keep`` takes on every transformers version we
    support): a position one row trains on is computed for every row."""
    used = (weights != 0).any(dim=0)
    return None if bool(used.all()) else used.nonzero().squeeze(-1)


def model_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """The model's logits at ``positions`` of every row, ``(B, K, V)``, or at every position.

    transformers' causal LMs take ``logits_to_keep`` (an index tensor) and run the head on
    ``hidden_states[:, positions]`` only. A model whose forward lacks it computes every
    position and is sliced here: the same values, without the memory saving. ``use_cache`` is
    off: no KV cache is built (with gradient checkpointing transformers would turn it off
    itself, with a warning per call)."""
    accepted = inspect.signature(transformers_model(model).forward).parameters
    keep = positions is not None and "logits_to_keep" in accepted
    extra: dict[str, Any] = {"logits_to_keep": positions} if keep else {}
    if "use_cache" in accepted:  # a scoring or training forward never reuses its KV cache
        extra["use_cache"] = False
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **extra).logits
    return logits[:, positions] if positions is not None and not keep else logits


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The reference expression on one chunk: ``log_softmax`` of the float32 logits at ``targets``."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _target_logprobs_grad(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`_target_logprobs` with respect to the float32 logits, times
    ``grad``: autograd through the recomputed chunk, i.e. the very ops it runs for the
    unchunked expression (a one-hot ``grad`` into torch's log-softmax backward), so bitwise the
    same. Writing it out as ``grad * (onehot - exp(log_softmax))`` is about 2x faster on this
    block but differs in the last bit of ``exp``, which added up to 2e-6 of the largest
    gradient on SmolLM2; the block is a small part of a step either way."""
    with torch.enable_grad():
        block = logits.detach().float().requires_grad_(True)
        (grad_block,) = torch.autograd.grad(_target_logprobs(block, targets), block, grad)
    return grad_block


class _SelectedLogprobs(torch.autograd.Function):
    """:func:`_target_logprobs` on ``(N, V)`` logits, chunk by chunk. Saves the logits (which
    the caller holds anyway) rather than the float32 log-softmax; backward recomputes each
    chunk's log-softmax, so no more than one chunk's float32 copies exist at a time."""

    @staticmethod
    def forward(ctx: FunctionCtx, logits: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.chunk = chunk  # type: ignore[attr-defined]
        out = torch.empty(targets.shape, dtype=torch.float32, device=logits.device)
        for start in range(0, targets.shape[0], chunk):
            rows = slice(start, start + chunk)
            out[rows] = _target_logprobs(logits[rows], targets[rows])
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets = ctx.saved_tensors  # type: ignore[attr-defined]
        chunk = ctx.chunk  # type: ignore[attr-defined]
        if targets.shape[0] <= chunk:
            return _target_logprobs_grad(logits, targets, grad).to(logits.dtype), None, None
        grad_logits = torch.empty_like(logits)
        for start in range(0, targets.shape[0], chunk):
            rows = slice(start, start + chunk)
            grad_logits[rows] = _target_logprobs_grad(logits[rows], targets[rows], grad[rows])
        return grad_logits, None, None


def selected_token_logprobs(logits: torch.Tensor, targets: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``log softmax(logits)[..., targets]`` in float32, shaped like ``targets``.

    ``logits`` is ``(..., V)`` in any dtype; ``chunk`` positions are log-softmaxed at a time
    (default :func:`chunk_size`). Differentiable with respect to ``logits``."""
    vocab = logits.shape[-1]
    flat = _SelectedLogprobs.apply(logits.reshape(-1, vocab), targets.reshape(-1), chunk or chunk_size(vocab))
    return flat.view(targets.shape)


def next_token_distributions(
    logits: torch.Tensor, topk: int | None = None, chunk: int | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The float32 log-softmax of ``(T, V)`` logits, or with ``topk=K`` its ``K`` largest
    values and their ids (``(T, K)`` each, descending), one chunk of positions at a time: with
    ``topk`` no float32 copy larger than a chunk exists. No gradients."""
    chunk = chunk or chunk_size(logits.shape[-1])
    n, vocab = logits.shape
    if topk is None:
        out = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            out[s : s + chunk] = torch.log_softmax(logits[s : s + chunk].float(), dim=-1)
        return out
    k = min(topk, vocab)
    values = torch.empty((n, k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((n, k), dtype=torch.long, device=logits.device)
    for s in range(0, n, chunk):
        top = torch.topk(torch.log_softmax(logits[s : s + chunk].float(), dim=-1), k=k, dim=-1)
        values[s : s + chunk], ids[s : s + chunk] = top.values, top.indices
    return values, ids
