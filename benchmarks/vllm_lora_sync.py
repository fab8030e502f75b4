"""How a LoRA policy should reach the colocated vLLM engine: merged into the pushed base weights
(``lora_sync: merged``) or as an adapter vLLM applies itself (``lora_sync: adapter``, written to a
RAM-backed folder per sync).

One backend per mode (SmolLM2-135M-Instruct by default), one after the other in this process;
each takes ``--rounds`` rounds of (an optimizer step that moves the adapter, then sampling
``--prompts`` chat prompts x ``--samples`` completions of ``--max-tokens`` tokens). Printed per
mode: median seconds of the weight sync and of the sampling (generation alone), and the
sampler-vs-trainer logprob gap after the last step (both must be ~1e-5 on SmolLM2).

Run (in the vLLM venv): ``python benchmarks/vllm_lora_sync.py [--model smollm2] [--rank 16]
[--rounds 4] [--prompts 4] [--samples 4] [--max-tokens 16] [--threads 2] [--compiled]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tempering.interfaces import LossOutput
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.types import AdamParams, Batch, Datum, SamplingParams

QUESTIONS = ["What is 12+3?", "Name a colour.", "Write one word.", "What is 7 times 8?"]


class CrossEntropy:
    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        w = batch["weights"]
        return LossOutput(-(logprobs * w).sum() / w.sum(), {})


def run(mode: str, args: argparse.Namespace) -> dict[str, float]:
    backend = LocalBackend(
        model=args.model,
        lora={"rank": args.rank, "alpha": 2 * args.rank},
        num_threads=args.threads,
        engine="vllm",
        vllm={"enforce_eager": not args.compiled, "max_model_len": 512, "kv_cache_space_gib": 1, "lora_sync": mode},
    )
    tok = backend.tokenizer
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS[: args.prompts]
    ]
    prompts = [list(p["input_ids"]) if hasattr(p, "keys") else list(p) for p in prompts]  # a BatchEncoding or ids
    row = prompts[0] + tok.encode("15") + [tok.eos_token_id]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    backend.sample(prompts, args.samples, params).result()  # the engine's start and first push
    engine = backend._vllm
    assert engine is not None
    samples: list[float] = []
    for _ in range(args.rounds):
        backend.forward_backward(Batch([Datum(row[:-1], row[1:], [1.0] * (len(row) - 1))]), CrossEntropy())
        backend.optim_step(AdamParams(learning_rate=1e-3)).result()
        t0 = time.perf_counter()
        out = backend.sample(prompts, args.samples, params).result()
        samples.append(time.perf_counter() - t0)
    completions = [c for g in out for c in g]
    scored = backend.logprobs(Batch([Datum.from_completion(c) for c in completions])).result()
    gap = max(
        abs(a - b) for lp, c in zip(scored, completions) for a, b in zip(lp[len(lp) - len(c.tokens) :], c.logprobs)
    )
    syncs = engine.sync_seconds[1:]
    backend.close()
    sync = statistics.median(syncs)
    return {"sync": sync, "generate": statistics.median(samples) - sync, "gap": gap}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--compiled", action="store_true", help="let vLLM compile the model (enforce_eager off)")
    args = p.parse_args()
    os.environ.setdefault("TEMPERING_PROGRESS", "0")
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    results = {mode: run(mode, args) for mode in ("merged", "adapter")}
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    shape = f"{args.prompts} prompts x {args.samples} x {args.max_tokens} tokens"
    mode = "compiled" if args.compiled else "eager"
    print(f"\n{args.model}, LoRA r{args.rank}, {shape}, {args.threads} threads, {mode}; {args.rounds} rounds")
    print(f"{'lora_sync':>10} {'sync s':>8} {'generate s':>11} {'sync+gen s':>11} {'logprob gap':>12}")
    for mode, r in results.items():
        both = r["sync"] + r["generate"]
        print(f"{mode:>10} {r['sync']:>8.3f} {r['generate']:>11.3f} {both:>11.3f} {r['gap']:>12.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
