"""Build and train the runs of the experiment: three specialists (concurrently) and one generalist.

Every run is the recipe in ``recipe.yaml`` (an SFT warmup, then GRPO with a verifiable reward),
built with :meth:`tempering.training.recipe.Recipe.from_dict` and overrides. A specialist trains on one
domain; the generalist on a balanced union of the three, for the *sum* of the specialists'
steps with the same batch sizes, so it sees exactly as many samples as the three together.

Each run trains in its own worker process, forked from a fork server that imported torch and
transformers once (one torch thread each on the local backend, one Tinker training client each
on Tinker). The generalist trains alone; then the three specialists train at the same time. The
parent times each phase from the launch of its processes to the end of the last training (the
test-set answers each process computes afterwards are not counted) and samples the machine's
load average meanwhile, since other jobs on a shared machine change the ratio.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import make_data
from make_data import DATA, DOMAINS, ROUTER_PREFIX

from tempering.algorithms.specialists.routing import balanced_union
from tempering.training import parallel

HERE = Path(__file__).resolve().parent
TEMPLATE = HERE / "recipe.yaml"


@dataclass
class Scale:
    """How big a run is. Steps are per specialist; the generalist takes ``len(DOMAINS)`` times as many."""

    sft_steps: int
    grpo_steps: int
    router_steps: int  # SFT steps that teach the generalist (after its evaluation) to name the domain
    val_size: int  # per domain, for the in-recipe evaluation at the end of each stage
    test_size: int | None  # per domain (None = the whole test split; capitals has 100)
    #: Applied to every run (batch sizes; ``backend.*``: the local tiny model's size, dropped on Tinker).
    overrides: list[str] = field(default_factory=list)


SCALES: dict[str, Scale] = {
    # A smoke test (the end-to-end test): under a minute on 2 cores; the models learn little.
    "tiny": Scale(
        sft_steps=40,
        grpo_steps=2,
        router_steps=15,
        val_size=20,
        test_size=30,
        overrides=[
            "backend.model_kwargs.hidden_size=32",
            "backend.model_kwargs.num_layers=1",
            "backend.model_kwargs.num_heads=2",
            "backend.model_kwargs.intermediate_size=64",
            "stages.warmup.batch_size=32",
            "stages.rl.prompts_per_step=8",
            "stages.rl.group_size=4",
        ],
    ),
    # The measured experiment (docs/domain_specialists.md).
    "default": Scale(sft_steps=300, grpo_steps=10, router_steps=60, val_size=60, test_size=100),
}

#: Hyperparameters that differ on Tinker (a pretrained model with a LoRA adapter wants a much
#: smaller learning rate than a tiny model trained from scratch). Untested offline.
TINKER_OVERRIDES = ["stages.warmup.optimizer.learning_rate=2.0e-4", "stages.rl.optimizer.learning_rate=4.0e-5"]


def load_template() -> dict[str, Any]:
    from tempering.training.config import load_yaml

    return load_yaml(str(TEMPLATE))


# --------------------------------------------------------------------------- data for the runs
def _write_jsonl(path: Path, rows: Iterable[Mapping[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r, separators=(",", ":")) + "\n")
    return str(path)


def router_rows(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, str]]:
    """The model router's SFT data: ``"domain of: <question>"`` -> the domain's name."""
    return [{"prompt": ROUTER_PREFIX + r["prompt"], "answer": r["domain"]} for r in rows]


def test_rows(scale: Scale, data_dir: Path = DATA) -> list[dict[str, Any]]:
    """The shared test set: the first ``test_size`` rows of each domain's test split."""
    rows: list[dict[str, Any]] = []
    for d in DOMAINS:
        split = make_data.load_split(d, "test", data_dir)
        rows += split[: scale.test_size] if scale.test_size else split
    return rows


def prepare_data(run_dir: Path, scale: Scale, data_dir: Path = DATA) -> dict[str, Any]:
    """Write the files the runs read into ``run_dir/data``; returns their paths per run."""
    out = run_dir / "data"
    train = {d: make_data.load_split(d, "train", data_dir) for d in DOMAINS}
    val = {d: make_data.load_split(d, "val", data_dir)[: scale.val_size] for d in DOMAINS}
    strip = lambda rows: [{"prompt": r["prompt"], "answer": r["answer"], "domain": r["domain"]} for r in rows]
    paths: dict[str, Any] = {}
    for d in DOMAINS:
        paths[d] = {
            "train": _write_jsonl(out / f"{d}_train.jsonl", strip(train[d])),
            "val": _write_jsonl(out / f"{d}_val.jsonl", strip(val[d])),
        }
    paths["generalist"] = {
        "train": _write_jsonl(out / "generalist_train.jsonl", balanced_union(train)),
        "val": _write_jsonl(out / "generalist_val.jsonl", [r for d in DOMAINS for r in val[d]]),
    }
    paths["router"] = {
        "train": _write_jsonl(out / "router_train.jsonl", router_rows(balanced_union(train, seed=1))),
        "val": _write_jsonl(out / "router_val.jsonl", router_rows(r for d in DOMAINS for r in val[d])),
    }
    paths["test"] = _write_jsonl(out / "test.jsonl", test_rows(scale, data_dir))
    return paths


# --------------------------------------------------------------------------- recipes
def backend_spec(backend: str, base_model: str | None = None, rank: int = 32) -> dict[str, Any] | None:
    """None keeps the template's local backend; ``tinker`` swaps the whole block."""
    if backend == "local":
        return None
    if backend == "tinker":
        if not base_model:
            raise ValueError("--backend tinker needs --base-model (e.g. meta-llama/Llama-3.2-1B)")
        return {"name": "tinker", "base_model": base_model, "rank": rank}
    raise ValueError(f"unknown backend '{backend}' (use local or tinker)")


def reward_spec(reward: str, judge: Mapping[str, Any] | None = None) -> Any:
    """``exact_match`` (verifiable) or ``llm_judge`` in binary mode against the reference answer."""
    if reward == "exact_match":
        return "exact_match"
    if reward == "llm_judge":
        judge = dict(judge or {})
        if not judge.get("base_url") or not judge.get("model"):
            raise ValueError("--reward llm_judge needs --judge-url and --judge-model (an OpenAI-compatible server)")
        return {"name": "llm_judge", "mode": "binary", **judge}
    raise ValueError(f"unknown reward '{reward}' (use exact_match or llm_judge)")


def build_recipe(
    role: str,
    run_dir: Path,
    paths: Mapping[str, Any],
    scale: Scale,
    backend: Mapping[str, Any] | None = None,
    reward: Any = "exact_match",
    overrides: Sequence[str] = (),
    chars: str | None = None,
) -> Any:
    """The recipe of one run: ``role`` is a domain (its specialist) or ``generalist``."""
    from tempering.training.recipe import Recipe

    fixed = [o for o in overrides if o.partition("=")[0].strip().endswith(".steps")]
    if fixed:
        raise ValueError(
            f"{fixed[0]}: steps come from the scale (the generalist takes the sum of the "
            "specialists'); use run.py --sft-steps / --grpo-steps instead"
        )
    if role != "generalist" and role not in DOMAINS:
        raise ValueError(f"role must be 'generalist' or one of {DOMAINS}, got '{role}'")
    data = load_template()
    data["name"] = f"ds_{role}"
    data["output_dir"] = str(run_dir / role)
    if backend is not None:
        data["backend"] = dict(backend)
    else:
        data["backend"]["model_kwargs"]["chars"] = chars or make_data.load_meta()["chars"]
    mult = len(DOMAINS) if role == "generalist" else 1
    for stage, steps in (("warmup", scale.sft_steps), ("rl", scale.grpo_steps)):
        spec = next(s for s in data["stages"] if s["id"] == stage)
        spec["steps"] = steps * mult
        spec["dataset"]["path"] = paths[role]["train"]
        spec["eval"]["dataset"]["path"] = paths[role]["val"]
    next(s for s in data["stages"] if s["id"] == "rl")["reward"] = reward
    extra = list(scale.overrides)
    if backend is not None:  # the scale's model size is the local tiny model's: not for another backend
        extra = [o for o in extra if not o.startswith("backend.")]
        extra += TINKER_OVERRIDES if backend.get("name") == "tinker" else []
    recipe = Recipe.from_dict(data, [*extra, *overrides])
    missing = [p for p, v in _walk(recipe.to_dict()) if v == "???"]
    if missing:
        raise ValueError(f"recipe.yaml: unfilled keys {missing}")
    return recipe


def validate_recipe(recipe: Any) -> None:
    """Check every stage's keys and the backend's and reward's, without building anything heavy:
    a typo in ``--set`` fails here, not in a worker process minutes later."""
    from tempering.registry import get_registry
    from tempering.training.config import stage_id
    from tempering.training.recipe import RunContext
    from tempering.training.stage import config_only

    registry = get_registry()
    registry.check("backend", recipe.backend, "backend")
    for i, stage in enumerate(recipe.stages):
        algorithm = registry.build("algorithm", {k: v for k, v in stage.items() if k != "id"}, f"stages[{i}]")
        if hasattr(algorithm, "validate"):  # nested blocks: optimizer, eval, loss, reward, ...
            ctx = RunContext(
                registry, None, recipe.to_dict(), "", [], recipe.seed, stage_index=i, stage_id=stage_id(stage, i)
            )
            with config_only():  # the data does not exist yet (placeholder paths)
                algorithm.validate(ctx)


def check_config(
    scale: Scale, backend: Mapping[str, Any] | None = None, reward: Any = "exact_match", overrides: Sequence[str] = ()
) -> None:
    """Build and validate every run's recipe (with placeholder data paths)."""
    paths = {role: {"train": "-", "val": "-"} for role in ("generalist", *DOMAINS)}
    for role in paths:
        validate_recipe(build_recipe(role, Path("-"), paths, scale, backend, reward, overrides))


def build_router_recipe(
    run_dir: Path, paths: Mapping[str, Any], scale: Scale, generalist: Any, overrides: Sequence[str] = ()
) -> Any:
    """The model router: one more SFT stage on the generalist's weights, teaching it to answer
    ``"domain of: <question>"`` with the domain's name (the same optimizer settings)."""
    from tempering.training.recipe import Recipe

    warmup = next(s for s in generalist.stages if s.get("id") == "warmup")
    stage = copy.deepcopy(dict(warmup))
    stage.update(id="route", steps=scale.router_steps, dataset={"name": "jsonl", "path": paths["router"]["train"]})
    stage["eval"] = {**stage.get("eval", {}), "dataset": {"name": "jsonl", "path": paths["router"]["val"]}}
    stage["optimizer"] = {**stage.get("optimizer", {}), "warmup_steps": 0}
    data = {
        "name": "ds_router",
        "seed": generalist.seed,
        "output_dir": str(run_dir / "router_model"),
        "backend": copy.deepcopy(generalist.backend),
        "loggers": ["jsonl"],
        "stages": [stage],
    }
    return Recipe.from_dict(data, overrides)


def _walk(node: Any, path: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for k, v in node.items():
            yield from _walk(v, f"{path}.{k}" if path else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _walk(v, f"{path}.{i}")
    else:
        yield path, node


# --------------------------------------------------------------------------- training processes
#: Imported once by the fork server besides :data:`tempering.training.parallel.PRELOAD`.
PRELOAD = [
    "tempering.plugins.backends.local.backend",
    "tempering.plugins.models.tiny",
    "tempering.algorithms.sft.algorithm",
    "tempering.algorithms.grpo.algorithm",
    "tempering.plugins.rewards.basic",
    "tempering.plugins.datasets.files",
    "tempering.plugins.loggers.jsonl",
    "tempering.plugins.loggers.plot",
    "matplotlib",
    "matplotlib.pyplot",
    "experiment",
    "evaluate_systems",
]


def run_concurrently(
    jobs: Mapping[str, Mapping[str, Any]],
    fn: Callable[[Mapping[str, Any]], Any] = parallel.train_one,
    workers: int | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`tempering.training.parallel.run_concurrently` with this example's modules preloaded."""
    return parallel.run_concurrently(jobs, fn, workers, PRELOAD)


def train_all(
    run_dir: Path,
    scale: Scale,
    backend: Mapping[str, Any] | None = None,
    reward: Any = "exact_match",
    overrides: Sequence[str] = (),
    model_router: bool = True,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Train the generalist alone (it then answers the test set and, optionally, becomes the
    model router), then the three specialists at once (each then answers the test set).
    Returns everything the evaluation needs: the answers, the runs, the timings."""
    from router import router_prompt

    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh experiment: timings of a resumed run would mean nothing
    run_dir.mkdir(parents=True)
    paths = prepare_data(run_dir, scale)
    questions = [r["prompt"] for r in test_rows(scale)]
    recipes = {
        role: build_recipe(role, run_dir, paths, scale, backend, reward, overrides) for role in ("generalist", *DOMAINS)
    }
    for recipe in recipes.values():
        validate_recipe(recipe)
    info: dict[str, Any] = {
        "scale": asdict(scale),
        "paths": paths,
        "cpu_count": os.cpu_count(),
        "recipes": {k: r.to_dict() for k, r in recipes.items()},
    }
    log(f"[0/2] starting the worker fork server (imports torch once; not timed; load {os.getloadavg()[0]:.2f})")
    info["warm_up_s"] = parallel.warm_up(PRELOAD)

    gen_job: dict[str, Any] = {"recipe": recipes["generalist"], "prompts": questions}
    if model_router:
        router = build_router_recipe(run_dir, paths, scale, recipes["generalist"])
        gen_job["then"] = {"recipe": router, "prompts": [router_prompt(q) for q in questions]}
        info["recipes"]["router_model"] = router.to_dict()
    g = recipes["generalist"]
    log(
        f"[1/2] generalist: {g.stages[0]['steps']} SFT + {g.stages[1]['steps']} GRPO steps in one process "
        f"(load {os.getloadavg()[0]:.2f})"
        + (f"; then the model router: {scale.router_steps} SFT steps" if model_router else "")
    )
    gen, gen_t = run_concurrently({"generalist": gen_job})
    log(
        f"      trained in {gen_t['train_wall_s']:.1f} s (load avg 1 min: mean {gen_t['load']['mean_1min']}, "
        f"max {gen_t['load']['max_1min']}); "
        f"with evaluation{' and router' if model_router else ''} {gen_t['wall_s']:.1f} s"
    )

    log(
        f"[2/2] specialists: {scale.sft_steps} SFT + {scale.grpo_steps} GRPO steps each, {len(DOMAINS)} processes "
        f"at once (load {os.getloadavg()[0]:.2f})"
    )
    spec, spec_t = run_concurrently({d: {"recipe": recipes[d], "prompts": questions} for d in DOMAINS})
    log(
        f"      trained in {spec_t['train_wall_s']:.1f} s (load avg 1 min: mean {spec_t['load']['mean_1min']}, "
        f"max {spec_t['load']['max_1min']}); with evaluation {spec_t['wall_s']:.1f} s"
    )

    runs = {"generalist": gen["generalist"], **spec}
    if model_router:
        runs["router_model"] = runs["generalist"].pop("then")
    info["runs"] = runs
    info["timing"] = {
        "generalist_wall_s": gen_t["train_wall_s"],
        "specialists_parallel_wall_s": spec_t["train_wall_s"],
        "ratio_generalist_over_parallel": gen_t["train_wall_s"] / spec_t["train_wall_s"],
        "load_generalist": gen_t["load"],
        "load_specialists": spec_t["load"],
        "generalist_cpu_s": gen["generalist"]["train_cpu_s"],
        "specialists_cpu_s": {d: spec[d]["train_cpu_s"] for d in DOMAINS},
        "specialists_train_wall_s": {d: spec[d]["train_wall_s"] for d in DOMAINS},
        "eval_wall_s": sum(r["eval_wall_s"] for r in runs.values()),
        "warm_up_s": info["warm_up_s"],
    }
    if model_router:
        info["timing"]["router_model_wall_s"] = runs["router_model"]["train_wall_s"]
    (run_dir / "training.json").write_text(json.dumps(info, indent=2, default=str), encoding="utf-8")
    return info
