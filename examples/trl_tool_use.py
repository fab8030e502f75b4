"""TRL's GRPOTrainer learns the calculator tool-use task through tempering's environment, and
tempering's own ``grpo`` stage does the same from the same start, for comparison.

    python examples/trl_tool_use.py --steps 20 --out runs/trl_tool_use

1. **Warmup** (tempering): the bundled ``tool_use`` recipe's SFT stage alone (a tiny chat Llama
   built in code; it stops at 30% held-out accuracy), exported as a Hugging Face folder.
2. **TRL**: ``trl.GRPOTrainer`` from that folder, with ``environment_factory`` = the registered
   ``calculator`` environment and ``reward_funcs`` = its episode reward
   (:mod:`tempering.plugins.interop.trl`), set up like the recipe's RL stage: 16 prompts x 8
   rollouts a step, dapo loss clipped 0.2/0.28, lr 5e-4, temperature 1, at most 2 tool rounds.
3. **tempering**: the recipe's own ``rl`` stage (``grpo``), resumed from the same warmup.
4. Both policies are measured the same way, by ``tempering eval``'s code: 300 held-out tasks,
   whole greedy episodes of the environment.

Differences that remain: TRL renders with the tokenizer's chat template (made token-equal to
``tiny_chat`` by ``tiny_chat_template``), resets its learning rate schedule and optimizer (the
recipe's stage keeps the warmup's Adam state), and caps a rollout by ``max_completion_length``
rather than tempering's per-turn and per-episode token limits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any

#: The recipe's held-out evaluation (core/recipes/tool_use.yaml), as ``tempering eval`` settings.
HELD_OUT: dict[str, Any] = {
    "dataset": {"name": "tool_use", "split": "test", "size": 300},
    "sampler": {"name": "environment", "environment": "calculator", "max_turns": 3, "max_total_tokens": 96},
    "renderer": "tiny_chat",
    "max_tokens": 20,
}


def warmup(out: str, seed: int = 0) -> dict[str, Any]:
    """The recipe's SFT warmup in ``out/warmup``, exported to ``out/warmup_hf``."""
    from tempering.apps.export import export_run
    from tempering.training.recipe import find_recipe, read_progress

    run = os.path.join(out, "warmup")
    t0 = time.perf_counter()
    recipe = find_recipe("tool_use", [f"output_dir={run}", "loggers=[jsonl]", f"seed={seed}"])
    recipe.stages = [s for s in recipe.stages if s.get("id") == "warmup"]
    result = recipe.run()
    progress = read_progress(run)
    hf = os.path.join(out, "warmup_hf")
    shutil.rmtree(hf, ignore_errors=True)
    export_run(run, hf)
    return {
        "run": run,
        "hf": hf,
        "accuracy": result.stages["warmup"]["eval/accuracy"],
        "steps": progress["global_step"] if progress else None,
        "seconds": time.perf_counter() - t0,
    }


def held_out_accuracy(model_dir: str, out: str) -> float:
    """Greedy accuracy over the 300 held-out episodes, as ``tempering eval`` measures it."""
    from tempering.apps.checkpoint_eval import run_eval

    report = run_eval(model_dir, HELD_OUT, out=out)
    return float(report.metrics["accuracy"])


def train_trl(model_dir: str, out: str, steps: int, seed: int = 0) -> dict[str, Any]:
    """TRL's GRPOTrainer from ``model_dir`` through the calculator environment; the trained
    model is saved to ``out/model``."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tempering.plugins.datasets.tool_use import tool_use
    from tempering.plugins.interop import trl as tt

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = tt.tiny_chat_template(AutoTokenizer.from_pretrained(model_dir))
    rows = Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in tool_use("train")])
    args = GRPOConfig(
        output_dir=out,
        use_cpu=True,
        seed=seed,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=128,
        num_generations=8,  # 16 prompts x 8 rollouts, as the recipe
        max_completion_length=48,
        max_tool_calling_iterations=2,  # a correct episode's completion is 27 tokens
        learning_rate=5e-4,
        lr_scheduler_type="constant",
        warmup_steps=0,
        temperature=1.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.0,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=rows,
        environment_factory=tt.environment_factory("calculator"),
        reward_funcs=[tt.environment_reward],
    )
    t0 = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - t0
    saved = os.path.join(out, "model")
    trainer.save_model(saved)
    tokenizer.save_pretrained(saved)
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "model": saved,
        "rewards": rewards,
        "seconds": seconds,
        "accuracy": held_out_accuracy(saved, os.path.join(out, "eval")),
    }


def train_tempering(warm: dict[str, Any], out: str, steps: int) -> dict[str, Any]:
    """The recipe's ``rl`` stage (``grpo``) for ``steps`` steps, resumed from the warmup."""
    from tempering.training.recipe import find_recipe

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(warm["run"], out)
    recipe = find_recipe(
        "tool_use", [f"output_dir={out}", "loggers=[jsonl]", f"stages.rl.steps={steps}", "stages.rl.eval.every=0"]
    )
    t0 = time.perf_counter()
    result = recipe.run()
    seconds = time.perf_counter() - t0
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rewards = [r["reward/mean"] for r in rows if r.get("stage") == "rl" and "reward/mean" in r]
    return {"accuracy": result.stages["rl"]["eval/accuracy"], "rewards": rewards, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/trl_tool_use")
    a = parser.parse_args()
    warm = warmup(a.out, a.seed)
    trl = train_trl(warm["hf"], os.path.join(a.out, "trl"), a.steps, a.seed)
    ours = train_tempering(warm, os.path.join(a.out, "tempering"), a.steps)
    print(f"warmup: {warm['steps']} SFT steps, held-out {warm['accuracy']:.3f} ({warm['seconds']:.0f} s)")
    print("| trainer | held-out after SFT | after RL | gain | mean reward, first 5 / last 5 steps | RL wall |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in (("TRL GRPOTrainer + environment_factory", trl), ("tempering grpo stage", ours)):
        first, last = sum(r["rewards"][:5]) / 5, sum(r["rewards"][-5:]) / 5
        print(
            f"| {name} | {warm['accuracy']:.1%} | {r['accuracy']:.1%} | {r['accuracy'] - warm['accuracy']:+.1%} "
            f"| {first:.2f} / {last:.2f} | {r['seconds']:.0f} s |"
        )


if __name__ == "__main__":
    main()
