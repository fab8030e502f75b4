"""Held-out preference metrics of a DPO run: ``python examples/real_models/pair_metrics.py RUN_DIR``.

Scores held-out pairs (default: the run's first DPO stage's dataset with ``split: test``) with
the run's latest checkpoint (the policy) and with the base model (LoRA adapter off: the DPO
reference of a first stage) and prints, overall and per ``rejected_kind``:

* ``margin``: DPO's implicit reward margin ``beta * ((pi_c - ref_c) - (pi_r - ref_r))`` (0 before
  training, by definition), and ``ranked_right``: the share of pairs with a positive margin;
* ``policy_prefers_chosen`` / ``base_prefers_chosen``: the share of pairs whose chosen completion
  has the higher sequence logprob under the trained policy / the base model -- the ranking
  itself, before and after;
* ``policy_logp_chosen`` / ``base_logp_chosen``: mean sequence logprob of the chosen completions.

Pairs are tokenized exactly as the DPO stage trains them (its own ``build_batch``).
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from tempering.algorithms.dpo.algorithm import DPO
from tempering.registry import get_registry
from tempering.rollouts.renderer import chat_text_prompts, renderer_spec
from tempering.training.rundata import RunDir, run_backend
from tempering.types import Batch


def pair_logprobs(backend: Any, batch: Batch, **kwargs: Any) -> list[tuple[float, float]]:
    """(chosen, rejected) sequence logprobs of each pair of ``batch`` (one row per side)."""
    sums = [
        sum(lp * w for lp, w in zip(lps, d.weights))
        for d, lps in zip(batch.data, backend.logprobs(batch, **kwargs).result())
    ]
    return list(zip(sums[0::2], sums[1::2]))


def summarise(
    rows: Sequence[Mapping[str, Any]],
    policy: Sequence[tuple[float, float]],
    base: Sequence[tuple[float, float]],
    beta: float,
) -> dict[str, float]:
    n = len(rows)
    margins = [beta * ((pc - bc) - (pr - br)) for (pc, pr), (bc, br) in zip(policy, base)]
    return {
        "pairs": n,
        "margin": sum(margins) / n,
        "ranked_right": sum(m > 0 for m in margins) / n,
        "policy_prefers_chosen": sum(c > r for c, r in policy) / n,
        "base_prefers_chosen": sum(c > r for c, r in base) / n,
        "policy_logp_chosen": sum(c for c, _ in policy) / n,
        "base_logp_chosen": sum(c for c, _ in base) / n,
        "policy_logp_rejected": sum(r for _, r in policy) / n,
        "base_logp_rejected": sum(r for _, r in base) / n,
    }


def dpo_stage(recipe: Mapping[str, Any]) -> Mapping[str, Any]:
    for stage in recipe.get("stages") or []:
        if isinstance(stage, Mapping) and stage.get("name") == "dpo":
            return stage
    raise SystemExit("the run has no dpo stage")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--size", type=int, default=150, help="held-out pairs")
    parser.add_argument("--step", type=int, default=None, help="checkpoint (default: the latest)")
    parser.add_argument("--chunk", type=int, default=25, help="pairs per forward pass")
    args = parser.parse_args(argv)
    registry = get_registry()
    run = RunDir.open(args.run_dir)
    stage = dpo_stage(run.recipe)
    spec = stage.get("dataset")
    spec = dict(spec) if isinstance(spec, Mapping) else {"name": spec}
    rows = registry.build("dataset", {**spec, "split": "test", "size": args.size}, "dataset")
    loss = stage.get("loss") or {}
    beta = float(loss.get("beta", 0.1)) if isinstance(loss, Mapping) else 0.1
    with run_backend(run, args.step, registry) as (backend, ckpt):
        tok = backend.tokenizer
        dpo = DPO()
        dpo._chat_text = chat_text_prompts(stage.get("renderer", "auto"), tok)  # as DPO.setup decides
        renderer = registry.build(
            "renderer", renderer_spec(stage.get("renderer", "auto"), tok), "renderer", tokenizer=tok
        )
        policy: list[tuple[float, float]] = []
        base: list[tuple[float, float]] = []
        for start in range(0, len(rows), args.chunk):
            batch = dpo.build_batch(tok, rows[start : start + args.chunk], renderer)
            policy += pair_logprobs(backend, batch)
            base += pair_logprobs(backend, batch, reference=True)
    by_kind: dict[str, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        by_kind[str(row.get("rejected_kind", "all"))].append(i)
    out = {"checkpoint": ckpt["global_step"], "beta": beta, "all": summarise(rows, policy, base, beta)}
    for kind, idx in sorted(by_kind.items()):
        out[kind] = summarise([rows[i] for i in idx], [policy[i] for i in idx], [base[i] for i in idx], beta)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
