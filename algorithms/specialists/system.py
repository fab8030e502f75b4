"""The ``specialists`` stage: one specialist per domain, trained in parallel processes, against
one generalist trained on all the domains for as many steps as the specialists together, with a
router that sends each question to its specialist (Ramp's experiment; docs/systems.md).

A recipe's stages run one after another on one model, so a system of several runs is one stage
that starts the runs itself. Each run is a recipe of its own: the recipe's backend, the stages
in ``train`` (steps are per specialist; the generalist takes ``len(domains)`` times as many, on
a balanced union, so it sees exactly as many samples of each domain as that domain's
specialist) and its own output folder under the run's. The runs train in worker processes
(:mod:`tempering.training.parallel`): the generalist alone, then the specialists all at once,
then the router alone (``router.steps`` SFT steps from the base model on
``router.prefix + question`` -> the domain's name). Each trained model answers the whole test
set greedily; the stage then scores the systems with ``reward`` and writes ``results.json`` and
``results.md`` into the run folder:

* the base model (the recipe's backend before any training) and the generalist;
* each specialist on each domain (the diagonal is the specialist on its own domain);
* routed systems: the trained router, the base model asked zero-shot (Ramp used an untrained
  instruct model), and oracle routing, each + the specialists;
* router accuracy, and the training wall-clock of each phase with its CPU-seconds and the
  machine's load (the serial cost of the specialists is the sum of their CPU-seconds).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tempering.algorithms.specialists import report, routing
from tempering.errors import ConfigError
from tempering.rollouts.data import load_examples
from tempering.schema import Problem, check_config_at, field_values
from tempering.training import parallel
from tempering.training.stage import config_only

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import RunContext
    from tempering.training.recipe import Recipe

#: Modules the workers' fork server imports once, besides :data:`tempering.training.parallel.PRELOAD`
#: (a name that does not import is skipped).
PRELOAD = (
    "tempering.plugins.backends.local.backend",
    "tempering.algorithms.sft.algorithm",
    "tempering.algorithms.grpo.algorithm",
    "tempering.plugins.rewards.basic",
    "tempering.plugins.datasets.files",
    "tempering.plugins.loggers.jsonl",
)
GENERALIST, ROUTER = "generalist", "router"


@dataclass
class Specialists:
    """Specialists in parallel vs one generalist, with a router (see the module docs).

    ``domains``: name -> ``{train: dataset, test: dataset}``; rows need ``prompt`` (or
    ``question``) and ``answer``. ``train``: the stages every run trains (any stage spec; its
    dataset is filled in). ``router``: ``{steps, batch_size, optimizer, prefix}`` of the trained
    router, or ``null`` for none. ``zero_shot_router``: the base model's prompt for routing
    untrained (``{question}`` and ``{domains}`` are filled in), or ``null``. ``time_serial``:
    also train the specialists again one after another, to time the serial alternative (their
    answers are not kept; without it the serial time is estimated from CPU-seconds)."""

    domains: Mapping[str, Any] = field(default_factory=dict)
    train: Sequence[Any] = ()
    router: Any = field(default_factory=lambda: {"steps": 10, "batch_size": 8, "optimizer": {"learning_rate": 5e-4}})
    zero_shot_router: str | None = (
        "Which topic is this question about: {domains}? Answer with one word.\n\nQuestion: {question}"
    )
    reward: Any = field(default_factory=lambda: {"name": "exact_match", "case_sensitive": False})
    max_tokens: int = 12
    workers: int | None = None
    time_serial: bool = False

    label = "specialists"

    # ------------------------------------------------------------------ config
    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem]:
        """The shape of ``domains``, ``train`` and ``router`` and the token cap, each at its key
        (run by the registry when it builds the system, and by :meth:`validate`)."""
        domains, train, router = config["domains"], config["train"], config["router"]
        if not isinstance(domains, Mapping) or len(domains) < 2:
            yield Problem("domains", "needs at least two domains: name -> {train: dataset, test: dataset}")
            return
        for name, spec in domains.items():
            if name in (GENERALIST, ROUTER) or not str(name).isidentifier():
                yield Problem("domains", f"'{name}' cannot name a domain (a word, not {GENERALIST}/{ROUTER})")
            missing = [k for k in ("train", "test") if not isinstance(spec, Mapping) or k not in spec]
            if missing:
                yield Problem(f"domains.{name}", f"missing {missing}: give {{train: dataset, test: dataset}}")
        if not isinstance(train, Sequence) or not train or not all(isinstance(s, Mapping) for s in train):
            yield Problem("train", "a list of stage specs every run trains, e.g. [{name: sft, steps: 20}]")
        if router is not None:
            if not isinstance(router, Mapping):
                yield Problem("router", f"a mapping {{steps, batch_size, optimizer, prefix}} or null, got {router!r}")
            elif unknown := set(router) - {"steps", "batch_size", "optimizer", "prefix"}:
                yield Problem("router", f"unknown keys {sorted(unknown)} (steps, batch_size, optimizer, prefix)")
        if config["max_tokens"] < 1:
            yield Problem("max_tokens", f"must be >= 1, got {config['max_tokens']}")

    def validate(self, ctx: RunContext) -> None:
        path = ctx.path
        check_config_at(type(self), field_values(self), path)  # built in Python: not checked yet
        ctx.check("reward", self.reward, "reward")
        out = Path(ctx.output_dir)
        paths = {role: "-" for role in self.roles()}
        with config_only():  # every run's recipe, checked as `tempering run` checks one
            for role, recipe in self.recipes(ctx, out, paths).items():
                try:
                    _check(recipe)
                except ConfigError as err:
                    key = f"{path}.router" if role == ROUTER else f"{path}.train"
                    raise ConfigError(f"the {role} run: {err}", key) from err

    def roles(self) -> list[str]:
        return [GENERALIST, *self.domains, *([ROUTER] if self.router is not None else [])]

    # ------------------------------------------------------------------ recipes
    def recipes(self, ctx: RunContext, out: Path, train_paths: Mapping[str, str]) -> dict[str, Any]:
        """Each run's recipe: the recipe's backend and seed, the ``train`` stages on its data
        (the generalist: ``len(domains)`` x the steps), its own folder under ``out``."""
        from tempering.training.recipe import Recipe

        def recipe(role: str, stages: list[dict[str, Any]]) -> Any:
            data = {
                "name": f"{ctx.config.get('name', 'specialists')}_{role}",
                "seed": ctx.seed,
                "output_dir": str(out / role),
                "backend": copy.deepcopy(ctx.config["backend"]),
                "loggers": ["jsonl"],
                "checkpoint_minutes": 0,
                "keep_checkpoints": 1,
                "stages": stages,
            }
            return Recipe.from_dict(data)

        out_recipes = {}
        for role in (GENERALIST, *self.domains):
            stages = []
            for i, spec in enumerate(self.train):
                stage = copy.deepcopy(dict(spec))
                stage.setdefault("id", f"{stage.get('name', 'stage')}{i}")
                stage["dataset"] = {"name": "jsonl", "path": train_paths[role]}
                if role == GENERALIST:
                    stage["steps"] = int(stage.get("steps", 50)) * len(self.domains)
                stages.append(stage)
            out_recipes[role] = recipe(role, stages)
        if self.router is not None:
            route = {k: copy.deepcopy(v) for k, v in self.router.items() if k != "prefix"}
            route.update(id="route", name="sft", dataset={"name": "jsonl", "path": train_paths[ROUTER]})
            out_recipes[ROUTER] = recipe(ROUTER, [route])
        return out_recipes

    @property
    def router_prefix(self) -> str:
        default = f"Which topic is this question about ({', '.join(self.domains)})? "
        return str((self.router or {}).get("prefix", default))

    # ------------------------------------------------------------------ data
    def load(self, ctx: RunContext, split: str) -> dict[str, list[dict[str, Any]]]:
        """Each domain's ``split`` as ``{prompt, answer, domain}`` rows."""
        out = {}
        for d, spec in self.domains.items():
            key = f"domains.{d}.{split}"
            rows = load_examples(ctx, spec[split], key)
            if not rows:
                raise ConfigError("the dataset is empty", f"{ctx.path}.{key}")
            out[d] = [_qa_row(r, d, f"{ctx.path}.{key}") for r in rows]
        return out

    def write_data(self, ctx: RunContext, out: Path) -> tuple[dict[str, str], list[dict[str, Any]]]:
        """Each run's training file under ``out/data``; the shared test set (every domain's)."""
        train = self.load(ctx, "train")
        test = [r for rows in self.load(ctx, "test").values() for r in rows]
        paths = {d: _write_jsonl(out / "data" / f"{d}_train.jsonl", rows) for d, rows in train.items()}
        paths[GENERALIST] = _write_jsonl(out / "data" / "generalist_train.jsonl", routing.balanced_union(train))
        union = routing.balanced_union(train, seed=1)
        paths[ROUTER] = _write_jsonl(
            out / "data" / "router_train.jsonl", routing.router_rows(union, self.router_prefix)
        )
        _write_jsonl(out / "data" / "test.jsonl", test)
        return paths, test

    # ------------------------------------------------------------------ the run
    def run(self, ctx: RunContext) -> dict[str, Any]:
        out = Path(ctx.output_dir)
        t0 = time.perf_counter()
        for role in [*self.roles(), *(f"{d}_serial" for d in self.domains)]:  # resumed runs would mean nothing
            shutil.rmtree(out / role, ignore_errors=True)
        train_paths, test = self.write_data(ctx, out)
        recipes = self.recipes(ctx, out, train_paths)
        domains = list(self.domains)
        answers: dict[str, list[str]] = {}

        _say(f"base model: answering {len(test)} test questions")
        answers["base"] = parallel.answer_with(ctx.backend, test, self.max_tokens)
        if self.zero_shot_router:
            prompts = [self.zero_shot_router.format(question=r["prompt"], domains=", ".join(domains)) for r in test]
            answers["zero_shot_router"] = parallel.answer_with(ctx.backend, prompts, 8)
        base_wall = time.perf_counter() - t0
        warm = parallel.warm_up(PRELOAD)

        def job(role: str, prompts: Sequence[Any]) -> dict[str, Any]:
            return {"recipe": recipes[role], "prompts": prompts, "max_tokens": self.max_tokens}

        _say(f"generalist: {_steps(recipes[GENERALIST])} steps in one process (load {os.getloadavg()[0]:.2f})")
        gen, gen_t = parallel.run_concurrently({GENERALIST: job(GENERALIST, test)}, preload=PRELOAD)
        _say(f"  trained in {gen_t['train_wall_s']:.1f} s")
        _say(f"specialists: {_steps(recipes[domains[0]])} steps each, {len(domains)} processes at once")
        spec, spec_t = parallel.run_concurrently(
            {d: job(d, test) for d in domains}, workers=self.workers, preload=PRELOAD
        )
        _say(f"  trained in {spec_t['train_wall_s']:.1f} s")
        runs = {GENERALIST: gen[GENERALIST], **spec}
        phases = {GENERALIST: gen_t, "specialists": spec_t}
        if self.time_serial:
            serial = {d: {"recipe": _moved(recipes[d], out / f"{d}_serial")} for d in domains}
            _say("specialists again, one after another (timing only)")
            _, phases["specialists_serial"] = parallel.run_concurrently(serial, workers=1, preload=PRELOAD)
            _say(f"  trained in {phases['specialists_serial']['train_wall_s']:.1f} s")
        if self.router is not None:
            prompts = [self.router_prefix + r["prompt"] for r in test]
            _say(f"router: {_steps(recipes[ROUTER])} steps from the base model")
            rout, rout_t = parallel.run_concurrently({ROUTER: job(ROUTER, prompts)}, preload=PRELOAD)
            runs[ROUTER], phases[ROUTER] = rout[ROUTER], rout_t
        answers.update({role: run["answers"] for role, run in runs.items()})

        results = report.results(
            test, answers, runs, phases, domains, ctx.registry.build("reward", self.reward, f"{ctx.path}.reward")
        )
        results["timing"].update(base_eval_s=base_wall, warm_up_s=warm, total_wall_s=time.perf_counter() - t0)
        results["meta"] = {
            "recipe": ctx.config.get("name"),
            "seed": ctx.seed,
            "cpu_count": os.cpu_count(),
            "backend": ctx.config["backend"],
            "train": list(self.train),
            "router": self.router,
        }
        (out / "results.json").write_text(json.dumps(results, indent=2, default=str), encoding="utf-8")
        table = report.markdown(results)
        (out / "results.md").write_text(table, encoding="utf-8")
        print("\n" + table, flush=True)
        summary = report.summary(results)
        ctx.log(summary)
        return summary


def _qa_row(row: Mapping[str, Any], domain: str, path: str) -> dict[str, Any]:
    prompt = row.get("prompt", row.get("question"))
    if prompt is None or "answer" not in row:
        raise ConfigError(f"rows need 'prompt' (or 'question') and 'answer', got keys {sorted(row)}", path)
    return {"prompt": str(prompt), "answer": str(row["answer"]), "domain": domain}


def _write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _moved(recipe: Recipe, output_dir: Path) -> Any:
    from tempering.training.recipe import Recipe

    return Recipe.from_dict({**recipe.to_dict(), "output_dir": str(output_dir)})


def _check(recipe: Recipe) -> None:
    from tempering.training.recipe import check_recipe

    check_recipe(recipe.to_dict())


def _steps(recipe: Recipe) -> str:
    return " + ".join(f"{s['steps']} {s['name']}" for s in recipe.stages)


def _say(line: str) -> None:
    print(f"[specialists] {line}", flush=True)
