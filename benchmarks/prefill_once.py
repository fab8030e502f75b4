"""The ``generate`` engine's prefill-once (a group's shared prompt run once) vs prefilling it per
completion, on the GRPO step of ``grpo_step_vs_trl.py`` (SmolLM2-135M-Instruct by default).

For each group size the same backend runs steps alternately with ``prefill_once`` on and off
(``Generator.prefill_once``, the switch this benchmark flips; the engine has it on), so both
arms see the same machine load; the first ``--warmup`` steps of each arm are discarded. Printed:
median step and generate seconds per arm and their ratios (on / off), per group size.

Run: ``python benchmarks/prefill_once.py [--groups 8 16] [--prompts 4] [--max-tokens 16]
[--steps 6] [--warmup 1] [--lora 16] [--threads 2] [--model smollm2]``.
The prompts are the arithmetic task's as raw text (as ``grpo_step_vs_trl.py`` sends them), each
after ``--instruction`` (by default a 2-sentence instruction, ~40 tokens with the question, the
length of a short chat-templated task prompt; ``--instruction ''`` gives the bare ~8-token
question, where there is little prompt to share).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_step_vs_trl as bench

from tempering.plugins.datasets.arithmetic import arithmetic

INSTRUCTION = (
    "You are a careful calculator. Read the arithmetic problem below, work it out exactly, "
    "and reply with the final number only, without words or units. Problem: "
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=[8, 16])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--steps", type=int, default=6, help="measured steps per arm")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--lora", type=int, default=16, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--instruction", default=INSTRUCTION)
    args = p.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    rows = []
    for group in args.groups:
        ns = argparse.Namespace(
            model=args.model,
            model_kwargs={},
            threads=args.threads,
            device="cpu",
            dtype="float32",
            lora=args.lora or None,
            lora_alpha=None,
            engine="generate",
            vllm=None,
            prompts=args.prompts,
            group=group,
            max_tokens=args.max_tokens,
            lr=1e-5,
            warmup=args.warmup,
            steps=args.steps,
        )
        examples = [{**ex, "prompt": args.instruction + ex["prompt"]} for ex in arithmetic("train")]
        with tempfile.TemporaryDirectory() as out:
            ours = bench.Ours(ns, examples, out, log_kl=False)
            arms: dict[bool, list[bench.StepRecord]] = {True: [], False: []}
            for _ in range(args.warmup + args.steps):
                for once in (False, True):
                    ours.backend._generator.prefill_once = once
                    arms[once].append(ours.step())
            ours.backend.close()
        med = {
            k: (
                statistics.median(r.seconds for r in v[args.warmup :]),
                statistics.median(r.generate for r in v[args.warmup :]),
            )
            for k, v in arms.items()
        }
        rows.append((group, med))
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    shape = f"{args.prompts} prompts x G x {args.max_tokens} tokens, {args.threads} threads"
    print(f"\n{args.model}, {'LoRA r' + str(args.lora) if args.lora else 'full'}, {shape}")
    print(f"{'G':>4} {'step off':>10} {'step on':>10} {'on/off':>8} {'gen off':>10} {'gen on':>10} {'on/off':>8}")
    for group, med in rows:
        (s_off, g_off), (s_on, g_on) = med[False], med[True]
        step = f"{s_off:>10.2f} {s_on:>10.2f} {s_on / s_off:>8.2f}"
        print(f"{group:>4} {step} {g_off:>10.2f} {g_on:>10.2f} {g_on / g_off:>8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
