"""Domain specialists trained in parallel vs one generalist, with a router: the whole experiment.

    python examples/domain_specialists/run.py                      # default scale, local CPU
    python examples/domain_specialists/run.py --scale tiny         # a 1-2 minute smoke run
    TINKER_API_KEY=... python examples/domain_specialists/run.py --backend tinker \\
        --base-model meta-llama/Llama-3.2-1B --rank 32

Trains the generalist (alone), then the three specialists (concurrently), then the model
router; scores the systems on the shared test set and writes ``results.{md,json,png}`` into
``--out`` (default ``runs/domain_specialists/<scale>``). See docs/domain_specialists.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling modules, when imported from elsewhere

import evaluate_systems
import experiment
import make_data

from tempering.errors import TemperingError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    ap.add_argument("--scale", choices=sorted(experiment.SCALES), default="default")
    ap.add_argument("--backend", choices=["local", "tinker"], default="local")
    ap.add_argument(
        "--base-model",
        default=os.environ.get("TINKER_BASE_MODEL"),
        help="Tinker base model (--backend tinker), e.g. meta-llama/Llama-3.2-1B",
    )
    ap.add_argument("--rank", type=int, default=32, help="LoRA rank on Tinker")
    ap.add_argument("--reward", choices=["exact_match", "llm_judge"], default="exact_match", help="the GRPO reward")
    ap.add_argument("--judge-url", help="llm_judge: an OpenAI-compatible base URL (e.g. http://127.0.0.1:8000/v1)")
    ap.add_argument("--judge-model", help="llm_judge: the judge's model name")
    ap.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a recipe override applied to every run, e.g. stages.rl.group_size=4 (repeatable)",
    )
    ap.add_argument(
        "--sft-steps", type=int, help="SFT steps per specialist (the generalist takes 3x); default: the scale's"
    )
    ap.add_argument(
        "--grpo-steps", type=int, help="GRPO steps per specialist (the generalist takes 3x); default: the scale's"
    )
    ap.add_argument("--router-steps", type=int, help="SFT steps of the model router; default: the scale's")
    ap.add_argument("--no-model-router", action="store_true", help="skip training the model router")
    ap.add_argument("--out", type=Path, help="output folder (default runs/domain_specialists/<scale>); replaced")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TEMPERING_PROGRESS", "0")  # three processes' progress bars would interleave
    stale = make_data.stale()
    if stale:
        raise SystemExit(f"data/ is out of date ({', '.join(stale)}): run examples/domain_specialists/make_data.py")
    if args.backend == "tinker" and not os.environ.get("TINKER_API_KEY"):
        print("warning: TINKER_API_KEY is not set; the Tinker SDK will try its stored credentials", file=sys.stderr)
    scale = experiment.SCALES[args.scale]
    steps = {"sft_steps": args.sft_steps, "grpo_steps": args.grpo_steps, "router_steps": args.router_steps}
    scale = dataclasses.replace(scale, **{k: v for k, v in steps.items() if v is not None})
    try:
        backend = experiment.backend_spec(args.backend, args.base_model, args.rank)
        judge = {"base_url": args.judge_url, "model": args.judge_model} if args.reward == "llm_judge" else None
        reward = experiment.reward_spec(args.reward, judge)
        experiment.check_config(scale, backend, reward, args.overrides)  # a bad --set fails before anything runs
    except (ValueError, TemperingError) as err:
        raise SystemExit(f"run.py: error: {err}") from None
    out = (args.out or Path("runs") / "domain_specialists" / args.scale).resolve()

    t0 = time.perf_counter()
    print(
        f"domain specialists: scale={args.scale} backend={args.backend} reward={args.reward} "
        f"cores={os.cpu_count()} -> {out}",
        flush=True,
    )
    info = experiment.train_all(
        out,
        scale,
        backend,
        reward,
        args.overrides,
        model_router=not args.no_model_router,
        log=lambda s: print(s, flush=True),
    )
    meta = {
        "scale": args.scale,
        "backend": args.backend,
        "reward": args.reward,
        "cpu_count": os.cpu_count(),
        "base_model": args.base_model if args.backend == "tinker" else "tiny_llama",
        "overrides": args.overrides,
    }
    results = evaluate_systems.evaluate_all(info, out, meta=meta)
    results["timing"]["total_wall_s"] = time.perf_counter() - t0
    evaluate_systems.write_outputs(results, out)
    print()
    print(evaluate_systems.markdown(results))
    print(f"total {results['timing']['total_wall_s']:.0f} s; wrote {out / 'results.md'}, results.json, results.png")
    return results


if __name__ == "__main__":
    main()
