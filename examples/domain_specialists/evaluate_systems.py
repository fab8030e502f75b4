"""Score the systems on the shared test set; write ``results.json``, ``results.md``, ``results.png``.

Systems:

1. ``generalist`` -- one model trained on the union answers everything;
2. ``keyword router + specialists`` -- the regex baseline picks the specialist (router.py);
3. ``model router + specialists`` -- the generalist fine-tuned to name the domain picks it;
4. ``oracle routing + specialists`` -- every question goes to its own domain's specialist.

Every model answers every test question once (greedy, in worker processes), which also gives
the specialist x domain matrix; a routed system then takes, for each question, the answer of
the specialist its router chose (greedy decoding: the same answer it would give if asked alone).
Answers are scored with the registered ``exact_match`` reward, the training reward.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import router as routing
from make_data import DOMAINS

from tempering.algorithms.specialists import routing as routes_lib
from tempering.algorithms.specialists.routing import routed
from tempering.training.parallel import answer_with, free_core_ratios

MAX_TOKENS = 16
COLUMNS = ("system", *DOMAINS, "overall", "train_wall_s", "samples_seen")
SYSTEMS = ("generalist", "keyword router + specialists", "model router + specialists", "oracle routing + specialists")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def answer_job(job: Mapping[str, Any]) -> list[str]:
    """In a worker process: the model saved at ``job["checkpoint"]`` answers ``job["prompts"]``."""
    os.environ.setdefault("TEMPERING_PROGRESS", "0")
    import torch

    torch.set_num_threads(1)
    from tempering.registry import get_registry

    backend = get_registry().build("backend", dict(job["backend"]), "backend")
    backend.load(job["checkpoint"])
    texts = answer_with(backend, job["prompts"], int(job.get("max_tokens", MAX_TOKENS)))
    if hasattr(backend, "close"):
        backend.close()
    return texts


def answers_from_checkpoints(info: Mapping[str, Any], log: Callable[[str], None] = print) -> dict[str, list[str]]:
    """Every model's answers again, from the checkpoints the runs saved (in worker processes)."""
    from experiment import run_concurrently

    questions = [r["prompt"] for r in read_jsonl(info["paths"]["test"])]
    jobs = {}
    for m, run in info["runs"].items():
        prompts = [routing.router_prompt(q) for q in questions] if m == "router_model" else questions
        jobs[m] = {"backend": info["recipes"][m]["backend"], "checkpoint": run["checkpoint"], "prompts": prompts}
    log(f"answering {len(questions)} test questions with {len(jobs)} saved models")
    answers, _ = run_concurrently(jobs, answer_job, workers=min(len(jobs), max(2, os.cpu_count() or 2)))
    return answers


def score(answers: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[float]:
    from tempering.registry import get_registry

    reward = get_registry().build("reward", "exact_match", "eval.reward")
    return [float(reward(a, r)) for a, r in zip(answers, rows)]


def per_domain(correct: Sequence[float], rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    # overall = the mean over questions; macro = the mean over domains (equal when, as at both
    # scales, every domain has as many test questions).
    return routes_lib.per_domain(correct, rows, DOMAINS)


def evaluate_all(
    info: Mapping[str, Any],
    run_dir: Path,
    meta: Mapping[str, Any] | None = None,
    answers: Mapping[str, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """Score and tabulate. ``info`` is what ``experiment.train_all`` returned (it holds every
    model's answers, given by the training processes); ``answers`` replaces those."""
    rows = read_jsonl(info["paths"]["test"])
    questions = [r["prompt"] for r in rows]
    runs, timing = info["runs"], info["timing"]
    answers = dict(answers) if answers is not None else {m: r["answers"] for m, r in runs.items()}
    models = ["generalist", *DOMAINS]
    has_router = "router_model" in runs
    correct = {m: score(answers[m], rows) for m in models}

    keyword_choice = routing.route_all(questions)
    routers: dict[str, Any] = {
        "keyword": {
            "accuracy": routing.accuracy(keyword_choice, rows),
            "confusion": routing.confusion(keyword_choice, rows),
        }
    }
    choices: dict[str, list[str | None]] = {"keyword": keyword_choice, "oracle": [r["domain"] for r in rows]}
    if has_router:
        model_choice = [routing.parse_domain(a) for a in answers["router_model"]]
        choices["model"] = model_choice
        routers["model"] = {
            "accuracy": routing.accuracy(model_choice, rows),
            "confusion": routing.confusion(model_choice, rows),
            "train_wall_s": timing.get("router_model_wall_s"),
            "train_samples": runs["router_model"]["samples_seen"]["total"],
            "unparsed": sum(c is None for c in model_choice),
            "examples": [{"question": q, "answer": a} for q, a in list(zip(questions, answers["router_model"]))[:5]],
        }

    specialists = {d: correct[d] for d in DOMAINS}
    spec_samples = sum(runs[d]["samples_seen"]["total"] for d in DOMAINS)
    spec_wall = timing["specialists_parallel_wall_s"]
    table = [
        {
            "system": "generalist",
            **per_domain(correct["generalist"], rows),
            "train_wall_s": timing["generalist_wall_s"],
            "samples_seen": runs["generalist"]["samples_seen"]["total"],
        }
    ]
    for name, key in (
        ("keyword router + specialists", "keyword"),
        ("model router + specialists", "model"),
        ("oracle routing + specialists", "oracle"),
    ):
        if key in choices:
            table.append(
                {
                    "system": name,
                    **per_domain(routed(choices[key], specialists), rows),
                    "train_wall_s": spec_wall,
                    "samples_seen": spec_samples,
                }
            )

    timing = {**timing, **free_core_estimates(timing)}
    results = {
        "meta": dict(meta or {}),
        "columns": list(COLUMNS),
        "systems": table,
        "routers": routers,
        "cross_domain": {m: per_domain(correct[m], rows) for m in models},
        "val_after_stage": {m: {s: v.get("eval/accuracy") for s, v in runs[m]["stages"].items()} for m in runs},
        "samples_seen": {m: runs[m]["samples_seen"] for m in runs},
        "timing": dict(timing),
        "test_counts": {d: sum(r["domain"] == d for r in rows) for d in DOMAINS},
        "answers_sample": {
            m: [
                {"prompt": q, "answer": a, "correct": c}
                for q, a, c in list(zip(questions, answers[m], correct[m]))[:: max(len(rows) // 12, 1)]
            ]
            for m in models
        },
    }
    write_outputs(results, run_dir)
    return results


def free_core_estimates(timing: Mapping[str, Any]) -> dict[str, float]:
    """What the ratio would be without contention, from the CPU-seconds each run used
    (:func:`tempering.training.parallel.free_core_ratios`)."""
    return free_core_ratios(timing["generalist_cpu_s"], list(timing["specialists_cpu_s"].values()))


# --------------------------------------------------------------------------- outputs
def _pct(x: Any) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def markdown(results: Mapping[str, Any]) -> str:
    t = results["timing"]
    m = results.get("meta", {})
    lines = [
        f"# Domain specialists vs one generalist ({m.get('scale', '?')} scale, {m.get('backend', '?')} backend)",
        "",
    ]
    lines += ["Test accuracy (%, exact match, greedy):", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in results["systems"]:
        cells = [
            row["system"],
            *(_pct(row[d]) for d in (*DOMAINS, "overall")),
            f"{row['train_wall_s']:.1f}",
            str(row["samples_seen"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    counts = results["test_counts"]
    lines += [
        "",
        f"Test questions: {', '.join(f'{d} {n}' for d, n in counts.items())}; `overall` is the mean over "
        "questions. `train_wall_s`: the generalist trained alone; the specialists' figure is the wall-clock of "
        "training all three at once (the same for every routed system: the routers' own cost is below).",
        "",
    ]
    lines += [
        "Router accuracy on the test set (%):",
        "",
        "| router | " + " | ".join(DOMAINS) + " | overall | notes |",
        "|" + "---|" * (len(DOMAINS) + 3),
    ]
    for name, r in results["routers"].items():
        note = "regular expressions, no training"
        if name == "model":
            note = (
                f"generalist + {r['train_samples']} SFT rows on domain labels, {r['train_wall_s']:.1f} s; "
                f"{r['unparsed']} answers named no domain"
            )
        lines.append(
            f"| {name} | "
            + " | ".join(_pct(r["accuracy"][d]) for d in DOMAINS)
            + f" | {_pct(r['accuracy']['overall'])} | {note} |"
        )
    lg, ls = t["load_generalist"], t["load_specialists"]
    lines += [
        "",
        "Wall-clock of training:",
        "",
        f"- generalist alone: **{t['generalist_wall_s']:.1f} s** ({t['generalist_cpu_s']:.1f} CPU-s)",
        f"- three specialists concurrently: **{t['specialists_parallel_wall_s']:.1f} s** "
        f"({sum(t['specialists_cpu_s'].values()):.1f} CPU-s in all; each run's own training time: "
        + ", ".join(f"{d} {s:.1f} s" for d, s in t["specialists_train_wall_s"].items())
        + ")",
        f"- ratio generalist / parallel specialists: **{t['ratio_generalist_over_parallel']:.2f}x** measured "
        f"(ideal with one free core per process: ~{len(DOMAINS)}x; "
        f"this machine has {results['meta'].get('cpu_count', '?')} cores)",
        f"- from the CPU-seconds (no contention): {t['ratio_cpu_estimate_3_free_cores']:.2f}x on 3 free cores, "
        f"{t['ratio_cpu_estimate_2_free_cores']:.2f}x on 2; the generalist did "
        f"{t['work_ratio_generalist_over_specialists']:.2f}x the specialists' total CPU work for the same samples",
        f"- load average (1 min) during the generalist: before {lg['before_1min']}, "
        f"mean {lg['mean_1min']}, max {lg['max_1min']}; "
        f"during the specialists: before {ls['before_1min']}, mean {ls['mean_1min']}, max {ls['max_1min']}",
        f"- not timed: starting the worker fork server ({t['warm_up_s']:.1f} s: torch and transformers imported once); "
        f"the test-set answers after training ({t['eval_wall_s']:.1f} s in all)",
        "",
    ]
    lines += [
        "Each model on each domain's test questions (%): the specialists off their domain show why routing matters.",
        "",
        "| model | " + " | ".join(DOMAINS) + " |",
        "|" + "---|" * (len(DOMAINS) + 1),
    ]
    for model, acc in results["cross_domain"].items():
        lines.append(f"| {model} | " + " | ".join(_pct(acc[d]) for d in DOMAINS) + " |")
    lines += [
        "",
        "Validation accuracy at the end of each stage (%; SFT warmup -> GRPO):",
        "",
        "| run | " + " | ".join(f"after {s}" for s in ("warmup", "rl")) + " |",
        "|---|---|---|",
    ]
    for run, stages in results["val_after_stage"].items():
        if run != "router_model":
            lines.append(f"| {run} | " + " | ".join(_pct(stages.get(s)) for s in ("warmup", "rl")) + " |")
    return "\n".join(lines) + "\n"


def plot(results: Mapping[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = results["systems"]
    groups = [*DOMAINS, "overall"]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.8 / len(systems)
    for i, row in enumerate(systems):
        xs = [g + (i - (len(systems) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, [100 * row[g] for g in groups], width, label=row["system"])
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel("test accuracy (%)")
    ax.set_ylim(0, 125)
    ax.set_yticks(range(0, 101, 20))
    ax.set_title("exact-match accuracy on the shared test set")
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    t = results["timing"]
    labels = ["generalist\nalone", "3 specialists\nconcurrently", "longest\nspecialist\n(CPU-s)"]
    values = [t["generalist_wall_s"], t["specialists_parallel_wall_s"], max(t["specialists_cpu_s"].values())]
    bars = bx.bar(labels, values, color=["tab:blue", "tab:orange", "lightgray"])
    bars[2].set_hatch("//")
    bx.axhline(t["generalist_wall_s"] / len(DOMAINS), color="gray", linestyle="--", linewidth=1)
    bx.text(
        2.45,
        t["generalist_wall_s"] / len(DOMAINS),
        f"1/{len(DOMAINS)}",
        va="bottom",
        ha="right",
        fontsize=8,
        color="gray",
    )
    for b, v in zip(bars, values):
        bx.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f} s", ha="center", va="bottom", fontsize=8)
    bx.set_ylabel("training wall-clock (s)")
    bx.set_title(
        f"ratio {t['ratio_generalist_over_parallel']:.2f}x (load {t['load_specialists']['mean_1min']})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(results: Mapping[str, Any], run_dir: Path) -> dict[str, Path]:
    paths = {"json": run_dir / "results.json", "md": run_dir / "results.md", "png": run_dir / "results.png"}
    paths["json"].write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
    paths["md"].write_text(markdown(results), encoding="utf-8")
    plot(results, paths["png"])
    return paths


def main(argv: list[str] | None = None) -> int:
    """Re-tabulate a finished run (``python evaluate_systems.py RUN_DIR``): from the answers its
    training processes recorded, or with ``--from-checkpoints`` answering again from the saved models."""
    import argparse

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("run_dir", type=Path)
    ap.add_argument(
        "--from-checkpoints", action="store_true", help="reload every saved model and answer the test set again"
    )
    args = ap.parse_args(argv)
    info = json.loads((args.run_dir / "training.json").read_text(encoding="utf-8"))
    previous_path = args.run_dir / "results.json"
    previous = json.loads(previous_path.read_text(encoding="utf-8")) if previous_path.exists() else {}
    answers = answers_from_checkpoints(info) if args.from_checkpoints else None
    results = evaluate_all(info, args.run_dir, meta=previous.get("meta"), answers=answers)
    if "total_wall_s" in previous.get("timing", {}):
        results["timing"]["total_wall_s"] = previous["timing"]["total_wall_s"]
        write_outputs(results, args.run_dir)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
