"""The ``specialists`` stage's numbers: every model scored on every test question, the routed
systems, router accuracy and the wall-clock of each training phase; as a dict
(``results.json``), a Markdown table (``results.md``) and the flat summary a recipe logs."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tempering.algorithms.specialists import routing
from tempering.training.parallel import free_core_ratios

GENERALIST, ROUTER = "generalist", "router"


def results(
    test: Sequence[Mapping[str, Any]],
    answers: Mapping[str, Sequence[str]],
    runs: Mapping[str, Mapping[str, Any]],
    phases: Mapping[str, Mapping[str, Any]],
    domains: Sequence[str],
    reward: Callable[[str, Mapping[str, Any]], float],
) -> dict[str, Any]:
    """``answers``: model -> its answer to each test question (``base``, ``generalist``, one per
    domain; ``router`` and ``zero_shot_router``: their routing answers). ``runs`` and
    ``phases``: what :func:`tempering.training.parallel.run_concurrently` returned."""
    models = ["base", GENERALIST, *domains]
    correct = {m: [float(reward(a, r)) >= 1.0 - 1e-9 for a, r in zip(answers[m], test)] for m in models}
    scores = {m: [float(c) for c in correct[m]] for m in models}
    choices: dict[str, list[str | None]] = {"oracle": [r["domain"] for r in test]}
    if ROUTER in answers:
        choices["trained router"] = [routing.parse_domain(a, domains) for a in answers[ROUTER]]
    if "zero_shot_router" in answers:
        choices["zero-shot base model"] = [routing.first_domain_named(a, domains) for a in answers["zero_shot_router"]]
    specialists = {d: scores[d] for d in domains}
    systems = {"base model": routing.per_domain(scores["base"], test, domains)}
    systems["generalist"] = routing.per_domain(scores[GENERALIST], test, domains)
    for name, choice in choices.items():
        systems[f"{name} + specialists"] = routing.per_domain(routing.routed(choice, specialists), test, domains)
    routers = {
        name: {
            "accuracy": routing.accuracy(choice, test, domains),
            "confusion": routing.confusion(choice, test, domains),
            "unparsed": sum(c is None for c in choice),
        }
        for name, choice in choices.items()
        if name != "oracle"
    }
    return {
        "domains": list(domains),
        "test_counts": {d: sum(r["domain"] == d for r in test) for d in domains},
        "systems": systems,
        "cross_domain": {m: routing.per_domain(scores[m], test, domains) for m in models},
        "routers": routers,
        "timing": timing(runs, phases, domains),
        "samples_seen": {m: run["samples_seen"] for m, run in runs.items()},
        "answers_sample": {
            m: [
                {"prompt": r["prompt"], "answer": a, "correct": c}
                for r, a, c in list(zip(test, answers[m], correct[m]))[:: max(len(test) // 9, 1)]
            ]
            for m in models
        },
    }


def timing(
    runs: Mapping[str, Mapping[str, Any]], phases: Mapping[str, Mapping[str, Any]], domains: Sequence[str]
) -> dict[str, Any]:
    """Wall-clock and CPU-seconds of training (answers excluded) per phase and per run."""
    spec_cpu = [runs[d]["train_cpu_s"] for d in domains]
    out: dict[str, Any] = {
        "generalist_wall_s": phases[GENERALIST]["train_wall_s"],
        "generalist_cpu_s": runs[GENERALIST]["train_cpu_s"],
        "specialists_parallel_wall_s": phases["specialists"]["train_wall_s"],
        "specialists_cpu_s": dict(zip(domains, spec_cpu)),
        "specialists_train_wall_s": {d: runs[d]["train_wall_s"] for d in domains},
        "specialists_serial_estimate_s": sum(spec_cpu),
        "load": {name: phase["load"] for name, phase in phases.items()},
    }
    out["ratio_generalist_over_parallel"] = out["generalist_wall_s"] / out["specialists_parallel_wall_s"]
    out.update(free_core_ratios(out["generalist_cpu_s"], spec_cpu))
    if "specialists_serial" in phases:
        out["specialists_serial_wall_s"] = phases["specialists_serial"]["train_wall_s"]
    if ROUTER in runs:
        out.update(router_wall_s=phases[ROUTER]["train_wall_s"], router_cpu_s=runs[ROUTER]["train_cpu_s"])
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{100 * x:.1f}"


def markdown(res: Mapping[str, Any]) -> str:
    domains, t = res["domains"], res["timing"]
    head = ["system", *domains, "overall"]
    lines = [
        "Held-out accuracy (%, greedy, exact match):",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for name, acc in res["systems"].items():
        lines.append(f"| {name} | " + " | ".join(_pct(acc[k]) for k in (*domains, "overall")) + " |")
    lines += ["", "Each model on each domain (%; the diagonal is each specialist on its own domain):", ""]
    lines += ["| model | " + " | ".join(domains) + " |", "|" + "---|" * (len(domains) + 1)]
    lines += [f"| {m} | " + " | ".join(_pct(a[d]) for d in domains) + " |" for m, a in res["cross_domain"].items()]
    lines += ["", "Router accuracy (%):", "", "| router | " + " | ".join(domains) + " | overall | no domain named |"]
    lines += ["|" + "---|" * (len(domains) + 3)]
    for name, r in res["routers"].items():
        acc = r["accuracy"]
        lines.append(
            f"| {name} | "
            + " | ".join(_pct(acc[d]) for d in domains)
            + f" | {_pct(acc['overall'])} | {r['unparsed']} |"
        )
    load = t["load"]
    lines += [
        "",
        "Training wall-clock (answers excluded; 1-minute load average in brackets, mean):",
        "",
        f"- generalist alone: {t['generalist_wall_s']:.1f} s ({t['generalist_cpu_s']:.1f} CPU-s) "
        f"[{load[GENERALIST]['mean_1min']}]",
        f"- {len(domains)} specialists in parallel: {t['specialists_parallel_wall_s']:.1f} s "
        f"[{load['specialists']['mean_1min']}]; each: "
        + ", ".join(
            f"{d} {t['specialists_train_wall_s'][d]:.1f} s ({t['specialists_cpu_s'][d]:.1f} CPU-s)" for d in domains
        ),
        "- specialists one after another: "
        + (
            f"{t['specialists_serial_wall_s']:.1f} s measured [{load['specialists_serial']['mean_1min']}]; "
            if "specialists_serial_wall_s" in t
            else ""
        )
        + f"~{t['specialists_serial_estimate_s']:.1f} s from the sum of their CPU-seconds",
        f"- generalist / parallel specialists: {t['ratio_generalist_over_parallel']:.2f}x measured; "
        f"{t[f'ratio_cpu_estimate_{len(domains)}_free_cores']:.2f}x on {len(domains)} free cores and "
        f"{t['ratio_cpu_estimate_2_free_cores']:.2f}x on 2, from the CPU-seconds",
    ]
    if "router_wall_s" in t:
        lines.append(
            f"- router: {t['router_wall_s']:.1f} s ({t['router_cpu_s']:.1f} CPU-s) [{load[ROUTER]['mean_1min']}]"
        )
    if "total_wall_s" in t:
        lines.append(f"- whole stage: {t['total_wall_s']:.1f} s (base-model answers {t['base_eval_s']:.1f} s included)")
    return "\n".join(lines) + "\n"


def summary(res: Mapping[str, Any]) -> dict[str, float]:
    """The flat numbers a run logs and ``tempering run`` prints (accuracy, wall-clock)."""
    out: dict[str, float] = {}
    keys = {"base model": "base", "generalist": "generalist", "trained router + specialists": "routed"}
    keys.update({"zero-shot base model + specialists": "routed_zero_shot", "oracle + specialists": "oracle"})
    for name, key in keys.items():
        if name in res["systems"]:
            out[f"eval/{key}/accuracy"] = res["systems"][name]["overall"]
    for d in res["domains"]:
        out[f"eval/specialist_{d}/accuracy"] = res["cross_domain"][d][d]
        out[f"eval/generalist_{d}/accuracy"] = res["cross_domain"][GENERALIST][d]
    for name, r in res["routers"].items():
        out[f"eval/router_{name.split()[0].replace('-', '_')}/accuracy"] = r["accuracy"]["overall"]
    t = res["timing"]
    out.update(
        {
            "time/generalist_s": t["generalist_wall_s"],
            "time/specialists_parallel_s": t["specialists_parallel_wall_s"],
            "time/specialists_serial_estimate_s": t["specialists_serial_estimate_s"],
        }
    )
    if "specialists_serial_wall_s" in t:
        out["time/specialists_serial_s"] = t["specialists_serial_wall_s"]
    return out
