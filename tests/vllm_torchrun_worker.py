"""torchrun worker for ``tests/test_vllm_torchrun.py``; not a test itself.

Under ``torchrun --nproc_per_node 2`` each rank builds a local backend with the colocated vLLM
engine (``engine: vllm``: one in-process engine per rank through vLLM's ``external_launcher``) for
each mode named on the command line (``ddp-full``, ``ddp-lora``, ``fsdp-full``, ``fsdp-lora``), one
after the other in the same processes, and records per rank: the largest gap between the
engine's sampled-token logprobs and the trainer's forward before and after each of 3 optimizer
steps (each step trains on this rank's own rows, so the weights move and must be re-synced),
whether greedy tokens equal transformers ``generate`` on the same weights, what the rank sampled
(ranks must sample differently), how many syncs ran, and every file created under the temp dir
(the test's own, through TMPDIR), and in RAM
(/dev/shm) while syncing. Rank 0 writes ``<out>/<mode>.json`` with both ranks' records.
Run: ``python -m torch.distributed.run --standalone --nproc_per_node 2 tests/vllm_torchrun_worker.py <out> MODE...``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

from tempering.interfaces import LossOutput
from tempering.plugins.backends.local import distributed
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.types import AdamParams, Batch, Completion, Datum, SamplingParams

# head size 32: vLLM's CPU attention has no kernel for 16
TINY = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "intermediate_size": 64, "max_position_embeddings": 128}
ENGINE = {"enforce_eager": True, "max_model_len": 128, "kv_cache_space_gib": 1}
PROMPTS = {0: ["12+3=", "7+40="], 1: ["1", "99+1=", "5+5="]}  # each rank its own share, of different sizes
STEPS = 3


class CrossEntropy:
    """Token-mean negative log-likelihood: a step that surely moves the weights."""

    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        w = batch["weights"]
        return LossOutput(-(logprobs * w).sum() / w.sum(), {})


def forward_gap(backend: LocalBackend, completions: list[Completion]) -> float:
    scored = backend.logprobs(Batch([Datum.from_completion(c) for c in completions])).result()
    gaps = [abs(a - b) for lp, c in zip(scored, completions) for a, b in zip(lp[len(lp) - len(c.tokens) :], c.logprobs)]
    return max(gaps)


def files_under(*roots: str) -> set[str]:
    """Every file under the test's private temp dir and our own under /dev/shm."""
    found = set()
    for root in roots:
        if os.path.isdir(root):
            for folder, _, names in os.walk(root):
                paths = (os.path.join(folder, n) for n in names)
                found.update(p for p in paths if root != "/dev/shm" or "tempering" in p)
    return found


def run(mode: str) -> dict:
    parallel, weights, *sync = mode.split("-")
    rank = distributed.rank()
    lora = {"rank": 4, "alpha": 8.0} if weights == "lora" else None
    backend = LocalBackend(
        model="tiny_llama",
        model_kwargs=TINY,
        lora=lora,
        seed=0,
        num_threads=1,
        parallel=parallel,
        engine="vllm",
        vllm={**ENGINE, **({"lora_sync": sync[0]} if sync else {})},
    )
    tok = backend.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[rank]]
    params = SamplingParams(max_tokens=8, temperature=1.0)
    sampled = [c for g in backend.sample(prompts, 3, params).result() for c in g]
    gaps = [forward_gap(backend, sampled)]
    before = files_under(tempfile.gettempdir())
    in_ram = files_under("/dev/shm")
    row = tok.encode("12+3=15") + [tok.eos_token_id]
    for _ in range(STEPS):
        backend.forward_backward(Batch([Datum(row[:-1], row[1:], [1.0] * (len(row) - 1))]), CrossEntropy())
        backend.optim_step(AdamParams(learning_rate=5e-2)).result()
        after = [c for g in backend.sample(prompts, 3, params).result() for c in g]
        gaps.append(forward_gap(backend, after))
    new_files = sorted(files_under(tempfile.gettempdir()) - before)
    ram_files = sorted(files_under("/dev/shm") - in_ram)
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    engine_greedy = [g[0].tokens for g in backend.sample(prompts, 1, greedy).result()]
    generate_greedy = [g[0].tokens for g in backend._generator.sample(backend.model, prompts, 1, greedy, 0)]
    engine = backend._vllm
    assert engine is not None
    record = {
        "rank": rank,
        "gaps": gaps,
        "versions": sorted({c.policy_version for c in after}),
        "greedy_equal": engine_greedy == generate_greedy,
        "sampled": [c.tokens for c in sampled],
        "syncs": len(engine.sync_seconds),
        "new_files": new_files,
        "ram_files": ram_files,
        "sharded": backend._sharded,
    }
    backend.close()
    return record


def main() -> None:
    out, modes = sys.argv[1], sys.argv[2:]
    assert distributed.init_from_env(), "run me under torchrun with WORLD_SIZE > 1"
    for mode in modes:
        records = distributed.gather_to_main(run(mode))
        if records is not None:
            with open(os.path.join(out, f"{mode}.json"), "w") as f:
                json.dump(records, f)
    distributed.barrier()


if __name__ == "__main__":
    main()
