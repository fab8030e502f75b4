"""torchrun worker for ``test_local_backend.py::test_data_parallel_step``; not a test itself.

Each rank trains one step on its *own* rows (see :func:`rank_rows`), then writes its trainable
parameters to ``<out>/params_rank<r>.pt`` and saves a backend checkpoint to ``<out>/ckpt``.
Run: ``python -m torch.distributed.run --nproc_per_node 2 tests/ddp_worker.py <out>``.
"""

from __future__ import annotations

import os
import sys

import torch

from tempering.interfaces import LossOutput
from tempering.plugins.backends.local import distributed
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.types import AdamParams, Batch, Datum

MODEL_KWARGS = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
NORMALISER = 8.0
# eps=1 makes Adam's first step ~lr*g (smooth in g), so float noise in the averaged gradient
# cannot flip the sign of an update the way g/|g| would.
ADAM = AdamParams(learning_rate=0.1, eps=1.0, grad_clip_norm=0.0)


class SumLoss:
    """Token sum over a constant: averaging it over ranks equals the concatenated batch's
    sum over twice the constant, which the test reproduces in one process."""

    needs_logits = False
    tinker_builtin = None

    def __init__(self, normaliser: float) -> None:
        self.normaliser = normaliser

    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        return LossOutput(-(logprobs * batch["weights"]).sum() / self.normaliser)


def rank_rows(rank: int, tokenizer) -> list[Datum]:
    """Different problems (and lengths) per rank, trained on the answer only: the prompt's
    positions have weight 0, so the backend runs the LM head on the answers' positions alone
    (``logits_to_keep``, different per rank) -- under DDP and FSDP too."""
    texts = [f"{rank * 7 + i}+{i * 3}={rank * 7 + i + i * 3}" for i in range(3 + rank)]
    rows = []
    for text in texts:
        ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
        prompt = len(tokenizer.encode(text[: text.index("=") + 1]))
        rows.append(Datum(ids[:-1], ids[1:], [0.0] * (prompt - 1) + [1.0] * (len(ids) - prompt)))
    return rows


def main(out: str) -> None:
    assert distributed.init_from_env(), "run me under torchrun with WORLD_SIZE > 1"
    rank = distributed.rank()
    backend = LocalBackend(model_kwargs=MODEL_KWARGS, seed=0, num_threads=1)
    metrics = backend.forward_backward(Batch(rank_rows(rank, backend.tokenizer)), SumLoss(NORMALISER)).result()
    step = backend.optim_step(ADAM).result()
    params = {n: p.detach().clone() for n, p in backend.model.named_parameters() if p.requires_grad}
    torch.save(
        {"params": params, "loss": metrics["loss"], "grad_norm": step["grad_norm"]},
        os.path.join(out, f"params_rank{rank}.pt"),
    )
    backend.save(os.path.join(out, "ckpt"), extra={"written_by_world": distributed.world_size()})
    backend.close()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
