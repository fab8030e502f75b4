"""On-policy distillation vs SFT on the teacher's samples vs GRPO, on SmolLM2 (issue 37 item 1).

The student is SmolLM2-135M-Instruct with LoRA (the ``smollm2_math`` settings); the teacher is
the ``smollm2_math`` recipe's trained policy, exported to a Hugging Face folder. Three ways to
move the student towards the skill, each at equal samples per step (4 prompts x 8 completions of
16 tokens, the same learning rate, steps and seed), held-out accuracy (``math_answer`` on 100
``math_questions`` never trained on, greedy) measured every ``--eval-every`` steps:

* ``distill``: ``examples/distill/smollm2.yaml``: the student samples, the teacher
  scores its tokens, the sampled-token reverse KL is the advantage (no reward);
* ``sft``: the same stage replaced by SFT on completions the teacher sampled for the training
  questions (temperature 0.7, ``steps x 32`` of them, drawn once before training: their cost is
  reported apart);
* ``grpo``: the bundled ``smollm2_math`` recipe itself, from the base model (the reward, no
  teacher).

Per step the three sample or read 32 completions; ``distill`` also pays one teacher forward of
them (about a third of a training step), ``sft`` no student sampling at all. Each run is a
process of its own, one at a time, one thread; the table gives the accuracies per evaluation and
the seconds. The teacher is built first when ``--teacher`` names a folder that does not exist
(``tempering run smollm2_math`` then ``tempering export``: about 10 minutes).

Run: ``python benchmarks/distill_vs_sft_vs_grpo.py [--teacher exports/smollm2_math] [--seeds 0]
[--steps 10] [--eval-every 2] [--only distill sft grpo]``. ``--smoke``: one step of 2 prompts x
4 samples, 8 held-out questions, the base model as its own teacher unless ``--teacher`` is given
(a check that every piece runs, 2-3 minutes a method; not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import yaml

os.environ.setdefault("TEMPERING_PROGRESS", "0")
HERE = os.path.dirname(os.path.abspath(__file__))
DISTILL_RECIPE = os.path.join(HERE, "..", "examples", "distill", "smollm2.yaml")
METHODS = ("distill", "sft", "grpo")


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What every method shares: steps, samples per step, the held-out evaluation."""
    smoke = {"steps": 1, "prompts_per_step": 2, "group_size": 4, "eval_size": 8, "eval_every": 1}
    full = {"steps": args.steps, "prompts_per_step": 4, "group_size": 8, "eval_size": 100}
    return {**(smoke if args.smoke else full), "eval_every": 1 if args.smoke else args.eval_every}


def recipe(method: str, seed: int, out: str, teacher: str, samples: str, s: dict[str, Any]) -> dict[str, Any]:
    """The recipe of ``method``: the distill recipe as written, or its stage swapped for SFT on
    ``samples`` or for the bundled ``smollm2_math`` GRPO stage; the shared settings ``s``."""
    with open(DISTILL_RECIPE, encoding="utf-8") as f:
        spec: dict[str, Any] = yaml.safe_load(f)
    stage = spec["stages"][0]
    if method == "grpo":
        from tempering import recipes

        stage = recipes.smollm2_math()["stages"][0]
    elif method == "sft":
        stage = {"id": "sft", "name": "sft", "renderer": "auto", "dataset": {"name": "jsonl", "path": samples}}
        stage["batch_size"] = s["prompts_per_step"] * s["group_size"]
        stage["optimizer"] = spec["stages"][0]["optimizer"]
    else:
        stage["teacher"] = teacher
    if method != "sft":
        stage.update(prompts_per_step=s["prompts_per_step"], group_size=s["group_size"])
    stage["steps"] = s["steps"]
    stage["eval"] = {
        "dataset": {"name": "math_questions", "split": "test", "size": s["eval_size"]},
        "reward": "math_answer",
        "max_tokens": 16,
        "every": s["eval_every"],
        "at_start": True,
    }
    spec.update(seed=seed, output_dir=out, loggers=["jsonl"], stages=[stage])
    return spec


def run_one(method: str, seed: int, out: str, teacher: str, samples: str, s: dict[str, Any]) -> dict[str, Any]:
    """One run (in a child process): held-out accuracy at each evaluation, and its wall time."""
    from tempering.training.recipe import Recipe

    t0 = time.perf_counter()
    result = Recipe(**recipe(method, seed, out, teacher, samples, s), resume=False).run()
    evals = [(h.get("step", 0), h["eval/accuracy"]) for h in result.history if "eval/accuracy" in h]
    kl = [h["distill/teacher_kl"] for h in result.history if "distill/teacher_kl" in h]
    return {"method": method, "seed": seed, "evals": evals, "teacher_kl": kl, "seconds": time.perf_counter() - t0}


def teacher_samples(teacher: str, n: int, path: str, seed: int) -> float:
    """``n`` teacher completions of the first ``n`` training questions (temperature 0.7, 16
    tokens), written to ``path`` as ``messages`` transcripts for SFT; returns the seconds."""
    from tempering.interfaces import model_renderer
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.plugins.datasets.math_questions import math_questions
    from tempering.rollouts.rollout import collect
    from tempering.training.evaluate import completion_sampler
    from tempering.types import SamplingParams

    t0 = time.perf_counter()
    rows = math_questions("train")[:n]
    backend = LocalBackend(model=teacher, seed=seed, num_threads=1)
    try:
        sampler = completion_sampler(backend.tokenizer, model_renderer(backend), None, "chatml")
        params = SamplingParams(max_tokens=16, temperature=0.7)
        groups = collect(sampler, backend, rows, 1, params).groups
    finally:
        backend.close()
    with open(path, "w", encoding="utf-8") as f:
        for row, group in zip(rows, groups):
            reply = {"role": "assistant", "content": group.samples[0].completion.text.strip()}
            f.write(json.dumps({"messages": [*row["messages"], reply]}) + "\n")
    return time.perf_counter() - t0


def ensure_teacher(teacher: str) -> None:
    """Build the teacher folder when it is missing: the smollm2_math run, exported."""
    if os.sep not in teacher and not os.path.exists(teacher):
        return  # a model name (smollm2), not a folder
    if os.path.isfile(os.path.join(teacher, "config.json")):
        return
    print(f"no teacher at {teacher}: training it (tempering run smollm2_math, ~10 min) and exporting it", flush=True)
    cli = [sys.executable, "-m", "tempering"]
    subprocess.run([*cli, "run", "smollm2_math", "--output-dir", "runs/smollm2_math"], check=True)
    subprocess.run([*cli, "export", "runs/smollm2_math", "--to", teacher], check=True)


def child(cmd: list[str]) -> dict[str, Any]:
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        sys.stderr.write(out.stderr[-3000:])
        raise SystemExit(out.returncode)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--teacher", help="the teacher: a folder (default exports/smollm2_math) or a model name")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--only", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--out", default="runs/distill_compare", help="where the runs and teacher samples go")
    parser.add_argument("--smoke", action="store_true", help="one tiny step of each: does everything run")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "SEED"), help=argparse.SUPPRESS)
    parser.add_argument("--samples-child", metavar="SEED", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    teacher = args.teacher or ("smollm2" if args.smoke else "exports/smollm2_math")
    s = settings(args)
    samples = os.path.abspath(os.path.join(args.out, "teacher_samples.jsonl"))
    if args.child:
        method, seed = args.child[0], int(args.child[1])
        out = os.path.join(args.out, f"{method}_seed{seed}")
        print(json.dumps(run_one(method, seed, out, teacher, samples, s)))
        return 0
    if args.samples_child is not None:
        n = s["steps"] * s["prompts_per_step"] * s["group_size"]
        print(json.dumps({"seconds": teacher_samples(teacher, n, samples, int(args.samples_child))}))
        return 0
    os.makedirs(args.out, exist_ok=True)
    ensure_teacher(teacher)
    print(f"teacher {teacher}; {s}; load average before: {os.getloadavg()[0]:.2f}", flush=True)
    base = [sys.executable, os.path.abspath(__file__), "--teacher", teacher, "--out", args.out]
    base += ["--steps", str(args.steps), "--eval-every", str(args.eval_every)] + (["--smoke"] if args.smoke else [])
    rows = []
    for seed in args.seeds:
        for method in args.only:
            if method == "sft" and not os.path.exists(samples):  # drawn once, before the first SFT run
                took = child([*base, "--samples-child", str(args.seeds[0])])["seconds"]
                print(f"teacher samples for SFT: {samples} ({took:.0f} s)", flush=True)
            rows.append(child([*base, "--child", method, str(seed)]))
            print(json.dumps(rows[-1]), flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    steps = sorted({step for r in rows for step, _ in r["evals"]})
    print("| method | seed | " + " | ".join(f"step {k}" for k in steps) + " | seconds |")
    print("| --- | --- | " + " | ".join("---" for _ in steps) + " | --- |")
    for r in rows:
        acc = dict(r["evals"])
        cells = " | ".join(f"{acc[k]:.2f}" if k in acc else "" for k in steps)
        print(f"| {r['method']} | {r['seed']} | {cells} | {r['seconds']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
