"""Generated tokens per second: multi-turn environment rollouts vs single-turn sampling.

Both sides sample from the same model (the tiny chat Llama of the ``tool_use`` demo, untrained:
timing only) on the local backend, at temperature 1, through the real samplers and
``tempering.rollouts.rollout.collect``:

* ``single``: the ``completion`` sampler, one turn of up to ``turns x max_tokens`` tokens per
  sample (``ignore_eos``-like: the random model rarely stops early at this length either);
* ``episodes``: the ``environment`` sampler with an environment that answers every turn with a
  short tool message and ends after ``turns`` turns of up to ``max_tokens`` each.

Both generate about the same number of tokens per sample; the ratio of tokens/s says what the
multi-turn machinery costs: re-rendering the conversation every turn, prefilling the growing
prompt again (``generate`` has no prefix cache), parsing, running the environment, and the
batching queue. Rounds alternate the two sides; medians are reported.

Run: ``python benchmarks/env_vs_single_turn.py [--prompts 32] [--group 4] [--turns 3]
[--max-tokens 16] [--rounds 5]``; about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("TEMPERING_PROGRESS", "0")


class Chatter:
    """Answers every model turn with a tool-style message; done after ``turns`` turns."""

    def __init__(self, turns: int = 3) -> None:
        self.turns = turns
        self.seen = 0

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": example["prompt"]}]

    def tools(self) -> list[Any]:
        return []

    async def step(self, response: Any) -> Any:
        from tempering.rollouts.environment import StepResult

        self.seen += 1
        return StepResult([{"role": "tool", "content": "ok 42"}], reward=0.0, done=self.seen >= self.turns)

    async def cleanup(self) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)

    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.plugins.renderers.tiny_chat import TinyChat
    from tempering.plugins.samplers.environment import EnvironmentSampler
    from tempering.registry import get_registry
    from tempering.rollouts.rollout import SamplerContext, collect
    from tempering.training.evaluate import completion_sampler
    from tempering.types import SamplingParams

    print(f"load average at start: {os.getloadavg()}  cpus: {os.cpu_count()}")
    backend = LocalBackend(
        model="tiny_llama", model_kwargs={"chat": True, "max_position_embeddings": 512}, seed=0, num_threads=1
    )
    renderer = TinyChat(backend.tokenizer)
    reg = get_registry()
    context = SamplerContext(backend.tokenizer, lambda: renderer, None, reg.build, reg.factory)
    episodes = EnvironmentSampler(environment=lambda: Chatter(args.turns), max_turns=args.turns, context=context)
    single = completion_sampler(backend.tokenizer, None)
    examples = [
        {"prompt": f"what is {i}*{i + 7}?", "messages": [{"role": "user", "content": f"what is {i}*{i + 7}?"}]}
        for i in range(args.prompts)
    ]
    sides = {
        "single": (single, SamplingParams(max_tokens=args.turns * args.max_tokens, temperature=1.0, seed=1)),
        "episodes": (episodes, SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1)),
    }
    results: dict[str, list[float]] = {k: [] for k in sides}
    tokens: dict[str, list[int]] = {k: [] for k in sides}
    collect(single, backend, examples[:2], 1, sides["single"][1])  # warm up generate's first-call costs
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for name in order:
            sampler, params = sides[name]
            t0 = time.perf_counter()
            rollout = collect(sampler, backend, examples, args.group, params)
            dt = time.perf_counter() - t0
            n = sum(s.num_generated for g in rollout.groups for s in g.samples)
            results[name].append(n / dt)
            tokens[name].append(n)
    backend.close()
    print(
        f"{args.prompts} prompts x {args.group} samples; episodes: {args.turns} turns x <= {args.max_tokens} tokens; "
        f"single: one turn of <= {args.turns * args.max_tokens} tokens; {args.rounds} rounds, alternating"
    )
    for name in sides:
        print(
            f"  {name:9s} {statistics.median(results[name]):9.0f} tokens/s (median; rounds "
            f"{', '.join(f'{x:.0f}' for x in results[name])}), {statistics.median(tokens[name]):.0f} tokens/round"
        )
    ratio = statistics.median(results["episodes"]) / statistics.median(results["single"])
    print(f"ratio episodes/single (tokens/s): {ratio:.2f}")
    print(f"load average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
