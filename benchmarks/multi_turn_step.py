"""One multi-turn tool-use GRPO step on SmolLM2-135M-Instruct (the real-model tool-use recipe's RL
stage, ``examples/real_models/smollm2_tool_use.yaml``), sampled three ways, alternating step by
step in one process so every arm sees the same machine load:

* ``today``: transformers ``generate`` with every prompt prefilled per row (the engine before
  issue 33: ``Generator.prefill_once`` off);
* ``prefill``: ``generate`` with shared prompt work done once (a group's identical first-turn
  prompts, and the system turn with the tool specs that every episode's turns begin with);
* ``vllm``: the colocated vLLM engine (prefix caching on: a turn's prompt is the previous turn's
  prompt and completion plus the tool's answer, so its KV cache is mostly there already), when
  vLLM is installed (the CPU build in ``.ci/run``'s vLLM venv).

Each arm's backend starts from the same SFT warmup (run once and loaded into every arm; 12 steps
where the recipe has 3, so that the episodes call the calculator tool and run their turns, as a
learning run's do after its first steps). Printed per arm: median step seconds, of which
sampling (``time/episodes``) and training (``time/train``), episode turns and tokens, and the
ratio to ``today``. ``--rss`` runs one arm
alone and prints the process's peak resident memory (the figure the issue started from).

Run: ``python benchmarks/multi_turn_step.py [--arms today prefill vllm] [--steps 2] [--warmup 0]
[--threads 1] [--vllm JSON] [--rss ARM]`` (~2-4 minutes a step per arm on 2 busy cores).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

RECIPE = Path(__file__).resolve().parents[1] / "examples" / "real_models" / "smollm2_tool_use.yaml"


def stage_specs(sft_steps: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The recipe's backend, SFT warmup (``sft_steps`` long) and GRPO stage (without the KL
    log), without their evaluations."""
    recipe = yaml.safe_load(RECIPE.read_text())
    warmup, rl = ({k: v for k, v in s.items() if k not in ("id", "eval")} for s in recipe["stages"])
    # log_kl off: the KL-to-reference log is one more forward every kl_every (10) steps, and a
    # one- or two-step measurement would pay it at every step
    return recipe["backend"], {**warmup, "steps": sft_steps}, {**rl, "log_kl": False}


def make_backend(spec: dict[str, Any], engine: str, args: argparse.Namespace) -> Any:
    from tempering.plugins.backends.local.backend import LocalBackend

    keys = {k: v for k, v in spec.items() if k != "name"}
    keys.update(num_threads=args.threads, engine=engine, vllm=args.vllm if engine == "vllm" else None)
    return LocalBackend(**keys)


class Arm:
    """One way of sampling: a backend loaded with the warm weights and the recipe's GRPO stage."""

    def __init__(self, name: str, backend_spec: dict, rl: dict, warm: str, out: str, args: argparse.Namespace) -> None:
        from tempering.registry import get_registry
        from tempering.training.recipe import RunContext
        from tempering.training.stage import OptimizerConfig

        self.name = name
        self.backend = make_backend(backend_spec, "vllm" if name == "vllm" else "generate", args)
        self.backend._generator.prefill_once = name != "today"
        self.backend.load(warm)
        registry = get_registry()
        self.stage = registry.build("algorithm", dict(rl), "stages[1]")
        self.stage._optimizer = OptimizerConfig(**rl.get("optimizer", {}))
        self.ctx = RunContext(registry, self.backend, {}, out, [], 0)
        self.stage.setup(self.ctx, {})
        if self.backend._vllm is not None:  # start the engine (and its first weight push) untimed
            from tempering.types import SamplingParams

            self.backend.sample([self.backend.tokenizer.encode("Hi")], 1, SamplingParams(max_tokens=1)).result()
        self.records: list[dict[str, float]] = []
        self.index = 0

    def step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.stage.train_step(self.ctx, self.index)
        metrics["step_time"] = time.perf_counter() - t0
        self.index += 1
        return metrics


def warm_checkpoint(backend_spec: dict, warmup: dict, folder: str, args: argparse.Namespace) -> str:
    """The recipe's SFT warmup, run once; the checkpoint every arm loads."""
    from tempering.training.recipe import Recipe, run_recipe

    backend = make_backend(backend_spec, "generate", args)
    recipe = Recipe.from_dict(
        {"name": "warmup", "output_dir": os.path.join(folder, "warmup"), "loggers": [], "stages": [warmup]}
    )
    run_recipe(recipe, backend=backend)
    path = os.path.join(folder, "warm")
    backend.save(path)
    backend.close()
    return path


def reset_peak_rss() -> None:
    """Start the process's peak resident memory (VmHWM) afresh (Linux: ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_gb() -> float:
    """The process's peak resident memory since :func:`reset_peak_rss`, in GB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", nargs="+", default=["today", "prefill", "vllm"])
    p.add_argument("--steps", type=int, default=2, help="measured steps per arm")
    p.add_argument(
        "--warmup", type=int, default=1, help="discarded steps per arm (the vLLM engine starts in its first)"
    )
    p.add_argument(
        "--sft-steps",
        type=int,
        default=12,
        help="SFT warmup steps: the recipe's 3 leave episodes of one turn at temperature 0.7 (the tool "
        "is not called yet); 12 make them call it and answer, as the episodes of a learning run do",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--vllm", type=json.loads, default={"kv_cache_space_gib": 2})
    p.add_argument("--rss", default=None, help="run this one arm alone and print the peak RSS")
    args = p.parse_args(argv)
    os.environ.setdefault("TEMPERING_PROGRESS", "0")
    arms_wanted = [args.rss] if args.rss else args.arms
    if "vllm" in arms_wanted:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            print("vLLM is not installed here: the vllm arm is skipped (run in the vLLM venv for it)")
            arms_wanted = [a for a in arms_wanted if a != "vllm"]
    backend_spec, warmup, rl = stage_specs(args.sft_steps)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; arms {arms_wanted}; {RECIPE.name}")
    with tempfile.TemporaryDirectory(prefix="multi_turn_") as folder:
        warm = warm_checkpoint(backend_spec, warmup, folder, args)
        reset_peak_rss()  # the peak of the arm, not of the SFT warmup before it
        arms = [Arm(a, backend_spec, rl, warm, os.path.join(folder, a), args) for a in arms_wanted]
        for i in range(args.warmup + args.steps):
            for arm in arms:
                m = arm.step()
                print(
                    f"step {i + 1} {arm.name:>8}: {m['step_time']:6.1f} s (sample {m.get('time/episodes', 0):.1f}, "
                    f"train {m.get('time/train', 0):.1f}), turns/episode {m.get('env/turns_mean', float('nan')):.2f}, "
                    f"reward {m.get('reward/mean', float('nan')):.2f}",
                    flush=True,
                )
                if i >= args.warmup:
                    arm.records.append(m)
        for arm in arms:
            arm.backend.close()
    print(f"load average at end: {os.getloadavg()[0]:.2f}")
    if args.rss:
        print(f"peak RSS of the process, arm {args.rss} alone (after the warmup): {peak_rss_gb():.2f} GB")
        return 0

    def med(arm: Arm, key: str) -> float:
        return statistics.median(r.get(key, float("nan")) for r in arm.records)

    base = next((a for a in arms if a.name == "today"), None)
    print(f"\n{'arm':>8} {'step s':>8} {'sample s':>9} {'train s':>8} {'turns':>6} {'tokens':>7} {'today/arm':>10}")
    for arm in arms:
        ratio = med(base, "step_time") / med(arm, "step_time") if base else float("nan")
        print(
            f"{arm.name:>8} {med(arm, 'step_time'):>8.1f} {med(arm, 'time/episodes'):>9.1f} "
            f"{med(arm, 'time/train'):>8.1f} {med(arm, 'env/turns_mean'):>6.2f} "
            f"{med(arm, 'completion/mean_len'):>7.1f} {ratio:>10.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
