"""torchrun worker for ``tests/test_fsdp.py``; not a test itself.

For full fine-tuning and for LoRA, with ``parallel: fsdp`` on 2 ranks: snapshot the start, train
:data:`STEPS` steps on each rank's own rows (saving a checkpoint after step :data:`SAVE_AT`),
sample with a different ``max_tokens`` per rank (generation must run in lockstep), score, save
a final checkpoint and export the policy; then a *second* backend resumes from the mid-run checkpoint and takes
the remaining steps. Rank 0 writes what the test compares to ``<out>/<mode>.pt``.
Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fsdp_worker.py <out>``.
"""

from __future__ import annotations

import os
import sys

import torch
from ddp_worker import MODEL_KWARGS, NORMALISER, SumLoss, rank_rows

from tempering.errors import ConfigError
from tempering.plugins.backends.local import distributed, sharding
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.types import AdamParams, Batch, SamplingParams

STEPS, SAVE_AT = 3, 1
LORA = {"rank": 4, "alpha": 8.0}
# eps=1 keeps Adam's update smooth in the gradient (see ddp_worker); clipping at 0.05 is active
# on every step, so the global (not per-shard) gradient norm is what gets tested.
ADAM = AdamParams(learning_rate=0.05, eps=1.0, grad_clip_norm=0.05)


def make(lora: dict | None) -> LocalBackend:
    return LocalBackend(model_kwargs=MODEL_KWARGS, lora=lora, seed=0, num_threads=1, parallel="fsdp")


def full_weights(backend: LocalBackend) -> dict[str, torch.Tensor]:
    """Every trainable tensor, gathered whole (a collective: all ranks call it)."""
    return {n: sharding.full_tensor(p.detach()).clone() for n, p in backend._trainable_named}


def train(backend: LocalBackend, rows, steps: range, ckpt: str | None) -> list[dict[str, float]]:
    out = []
    for step in steps:
        metrics = backend.forward_backward(Batch(rows), SumLoss(NORMALISER)).result()
        out.append({**metrics, **backend.optim_step(ADAM).result()})
        if ckpt and step + 1 == SAVE_AT:
            backend.save(ckpt, extra={"at": SAVE_AT})
    return out


def run(mode: str, out: str) -> None:
    lora = LORA if mode == "lora" else None
    rank = distributed.rank()
    backend = make(lora)
    assert backend._sharded and any(hasattr(p, "device_mesh") for p in backend._trainable)
    rows = rank_rows(rank, backend.tokenizer)
    backend.snapshot("start")
    start_lp = backend.logprobs(Batch(rows)).result()
    mid = os.path.join(out, f"{mode}_mid")
    history = train(backend, rows, range(STEPS), mid)
    weights = full_weights(backend)
    ref_lp = backend.logprobs(Batch(rows), reference=True).result()
    start_snapshot_lp = backend.logprobs(Batch(rows), weights="start").result()
    # Different lengths per rank: without lockstep generation the ranks' all-gathers would not pair up.
    prompt = backend.tokenizer.encode("12+3=")
    completions = backend.sample(
        [prompt, prompt[:3]], 2, SamplingParams(max_tokens=3 + 6 * rank, temperature=1.0)
    ).result()
    try:
        backend.sampling_client()
        raise AssertionError("sampling_client() must be refused under fsdp")
    except ConfigError as err:
        assert "backend.parallel" in str(err)
    per_rank = {"history": history, "completions": [c.__dict__ for g in completions for c in g]}
    torch.save(per_rank, os.path.join(out, f"{mode}_rank{rank}.pt"))
    backend.save(os.path.join(out, f"{mode}_final"))
    backend.export_pretrained(os.path.join(out, f"{mode}_hf"))
    backend.close()

    resumed = make(lora)
    assert resumed.load(mid) == {"at": SAVE_AT} and resumed.step == SAVE_AT
    resumed_history = train(resumed, rows, range(SAVE_AT, STEPS), None)
    resumed_weights = full_weights(resumed)
    resumed.close()
    if rank == 0:
        torch.save(
            {
                "history": history,
                "weights": weights,
                "start_lp": start_lp,
                "ref_lp": ref_lp,
                "start_snapshot_lp": start_snapshot_lp,
                "resumed_history": resumed_history,
                "resumed_weights": resumed_weights,
            },
            os.path.join(out, f"{mode}.pt"),
        )
    distributed.barrier()


def main(out: str) -> None:
    assert distributed.init_from_env(), "run me under torchrun with WORLD_SIZE > 1"
    for mode in ("full", "lora"):
        run(mode, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
