"""Recipes: a list of stages that share one backend, one output folder and one checkpoint.

A recipe is data (YAML or a dict) or Python objects -- :class:`Recipe` accepts both, so a
reward written as a Python function can sit where YAML would name a registered one.

Stages are resumable: after each stage (and every ``checkpoint_every`` steps inside one) the
backend is saved and ``progress.json`` records where the run is. Running the same recipe into
the same ``output_dir`` again skips finished stages and restores the latest checkpoint, so an
interrupted run continues with the very step it would have taken next.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.config import load_yaml, resolve_recipe, stage_id

from tempering.registry import Registry, get_registry

PROGRESS_FILE = "progress.json"


class StopRun(Exception):
    """Raised inside a stage to stop the whole run cleanly (after a checkpoint)."""


@dataclass
class RunContext:
    """What a stage sees: the shared backend, loggers, paths and the resume state."""

    registry: Registry
    backend: Any
    config: dict[str, Any]
    output_dir: str
    loggers: list[Any]
    seed: int
    stage_index: int = 0
    stage_id: str = ""
    global_step: int = 0
    resume_state: dict[str, Any] | None = None
    max_total_steps: int | None = None
    checkpoint_every: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    interrupted: bool = False
    last_state: dict[str, Any] | None = None

    @property
    def path(self) -> str:
        """Config path of the current stage, for error messages."""
        return f"stages[{self.stage_index}]"

    def build(self, kind: str, spec: Any, key: str, **context: Any) -> Any:
        return self.registry.build(kind, spec, f"{self.path}.{key}", **context)

    def factory(self, kind: str, spec: Any, key: str, **context: Any) -> Any:
        """A callable building a new component per call (see :meth:`Registry.factory`)."""
        return self.registry.factory(kind, spec, f"{self.path}.{key}", **context)

    def check(self, kind: str, spec: Any, key: str, context: Iterable[str] = ()) -> None:
        self.registry.check(kind, spec, f"{self.path}.{key}", context)

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Log one step of the current stage (adds stage id and global step)."""
        row = {"stage": self.stage_id, "step": self.global_step, "time": time.time(), **metrics}
        self.history.append(row)
        for logger in self.loggers:
            logger.log(row, self.global_step)

    def budget_left(self) -> bool:
        """False once ``max_total_steps`` is reached; a stage that sees False stops early and
        is *not* marked finished, so the next run resumes it where it stopped."""
        left = self.max_total_steps is None or self.global_step < self.max_total_steps
        self.interrupted = self.interrupted or not left
        return left

    def end_step(self, state: Mapping[str, Any]) -> None:
        """Call after each optimizer step: counts it and checkpoints when due."""
        self.last_state = dict(state)
        self.global_step += 1
        if self.checkpoint_every and self.global_step % self.checkpoint_every == 0:
            self.checkpoint(state)

    def checkpoint(self, state: Mapping[str, Any] | None, done: bool = False) -> str:
        """Save the backend and write where the run is (``state`` = the stage's loop state)."""
        progress = read_progress(self.output_dir) or {"completed": []}
        ckpt = os.path.join(self.output_dir, "checkpoints", f"step{self.global_step:06d}")
        extra = {"stage": self.stage_id, "state": dict(state or {}), "global_step": self.global_step}
        self.backend.save(ckpt, extra=extra)
        if done and self.stage_id not in progress["completed"]:
            progress["completed"].append(self.stage_id)
        progress.update(checkpoint=ckpt, current=None if done else self.stage_id, global_step=self.global_step)
        _write_json(os.path.join(self.output_dir, PROGRESS_FILE), progress)
        return ckpt


def read_progress(output_dir: str) -> dict[str, Any] | None:
    path = os.path.join(output_dir, PROGRESS_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)  # atomic: a crash never leaves half a progress file


def seed_everything(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass
    import torch

    torch.manual_seed(seed)


@dataclass
class Recipe:
    """A runnable recipe. Build it from a YAML path, a dict, or Python objects::

        Recipe(name="demo", backend={"name": "local", "model": "tiny_llama"},
               stages=[{"name": "grpo", "reward": my_reward_fn, "steps": 20}])
    """

    name: str = "recipe"
    stages: Sequence[Any] = ()
    backend: Any = field(default_factory=lambda: {"name": "local"})
    loggers: Any = field(default_factory=lambda: ["jsonl", "plot"])
    seed: int = 0
    output_dir: str | None = None
    max_total_steps: int | None = None
    checkpoint_every: int = 0
    resume: bool = True

    @classmethod
    def from_yaml(cls, path: str, overrides: Iterable[str] = ()) -> Recipe:
        return cls.from_dict(load_yaml(path), overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], overrides: Iterable[str] = ()) -> Recipe:
        cfg = resolve_recipe(_objects_to_placeholders(data, store := {}), overrides)
        cfg = _placeholders_to_objects(cfg, store)
        return cls(**cfg)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seed": self.seed,
            "output_dir": self.output_dir or f"runs/{self.name}",
            "backend": self.backend,
            "loggers": self.loggers,
            "stages": list(self.stages),
            "max_total_steps": self.max_total_steps,
            "checkpoint_every": self.checkpoint_every,
            "resume": self.resume,
        }

    def run(self, registry: Registry | None = None, backend: Any = None) -> RunResult:
        return run_recipe(self, registry=registry, backend=backend)


@dataclass
class RunResult:
    output_dir: str
    stages: dict[str, dict[str, Any]]
    history: list[dict[str, Any]]
    metadata: dict[str, Any]


def run_recipe(recipe: Recipe, registry: Registry | None = None, backend: Any = None) -> RunResult:
    """Run every stage of ``recipe`` in order, resuming if its output folder has progress."""
    registry = registry or get_registry()
    cfg = recipe.to_dict()
    out_dir = cfg["output_dir"]
    os.makedirs(out_dir, exist_ok=True)
    seed_everything(cfg["seed"])

    # Build every stage first: a config error in stage 3 should fail before stage 1 trains.
    stages = []
    for i, spec in enumerate(cfg["stages"]):
        sid = stage_id(spec, i)
        if isinstance(spec, Mapping):
            spec = {k: v for k, v in spec.items() if k != "id"}
        stages.append((sid, registry.build("algorithm", spec, f"stages[{i}]")))

    owns_backend = backend is None
    if backend is None:
        spec = cfg["backend"]
        if isinstance(spec, Mapping) and "seed" not in spec and _accepts(registry, spec, "seed"):
            spec = {**spec, "seed": cfg["seed"]}  # one seed for the whole recipe unless overridden
        backend = registry.build("backend", spec, "backend")
    loggers = [registry.build("logger", spec, f"loggers[{i}]", output_dir=out_dir) for i, spec in enumerate(_as_list(cfg["loggers"]))]
    metadata = _metadata(registry, cfg)
    _write_json(os.path.join(out_dir, "run.json"), metadata)

    ctx = RunContext(registry, backend, cfg, out_dir, loggers, cfg["seed"], max_total_steps=cfg["max_total_steps"], checkpoint_every=cfg["checkpoint_every"])
    progress = read_progress(out_dir) if cfg["resume"] else None
    completed: list[str] = []
    if progress and progress.get("checkpoint"):
        extra = backend.load(progress["checkpoint"])
        completed = list(progress.get("completed", []))
        ctx.global_step = int(progress.get("global_step", 0))
        if progress.get("current"):
            ctx.resume_state = dict(extra.get("state") or {})

    for i, (sid, algorithm) in enumerate(stages):  # check every stage's nested config up front
        if sid not in completed and hasattr(algorithm, "validate"):
            ctx.stage_index, ctx.stage_id = i, sid
            algorithm.validate(ctx)

    results: dict[str, dict[str, Any]] = {}
    try:
        for i, (sid, algorithm) in enumerate(stages):
            if sid in completed:
                continue
            ctx.stage_index, ctx.stage_id = i, sid
            if progress and progress.get("current") != sid:
                ctx.resume_state = None
            ctx.interrupted, ctx.last_state = False, None
            results[sid] = algorithm.run(ctx) or {}
            if ctx.interrupted:  # out of budget mid-stage: checkpoint where it stands, resumable
                ctx.checkpoint(ctx.last_state, done=False)
                break
            ctx.checkpoint(None, done=True)
            ctx.resume_state = None
            if not ctx.budget_left():
                break
    finally:
        for logger in loggers:
            logger.close()
        if owns_backend and hasattr(backend, "close"):
            backend.close()  # finish queued calls, end remote sessions
    return RunResult(out_dir, results, ctx.history, metadata)


def _accepts(registry: Registry, spec: Mapping[str, Any], key: str) -> bool:
    from tempering.registry import params_schema

    schema = params_schema(registry.get("backend", spec["name"]).load())
    return schema is None or key in {f.name for f in dataclasses.fields(schema)}


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _metadata(registry: Registry, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Which provider and version each named component resolved to: reproducibility."""
    used: dict[str, str] = {}

    def visit(node: Any, kind_hint: str | None) -> None:
        if isinstance(node, Mapping):
            name = node.get("name")
            if kind_hint and isinstance(name, str):
                try:
                    comp = registry.get(kind_hint, name)
                    used[f"{kind_hint}:{name}"] = f"{comp.plugin.dist} {comp.plugin.version}"
                except Exception:  # noqa: BLE001 - metadata must never fail a run
                    pass
            for key, value in node.items():
                visit(value, key if key in registry._components else None)
        elif isinstance(node, list):
            for value in node:
                visit(value, kind_hint)
        elif isinstance(node, str) and kind_hint:
            visit({"name": node}, kind_hint)

    visit({"backend": cfg["backend"], "logger": cfg["loggers"]}, None)
    for spec in cfg["stages"]:
        visit(spec, "algorithm")
    import tempering

    return {"tempering": tempering.__version__, "recipe": _jsonable(cfg), "components": used}


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return f"<python object {getattr(x, '__qualname__', type(x).__name__)}>"


def _objects_to_placeholders(data: Any, store: dict[str, Any]) -> Any:
    """omegaconf holds only plain data: park Python objects (a reward function) meanwhile."""
    if isinstance(data, Mapping):
        return {k: _objects_to_placeholders(v, store) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_objects_to_placeholders(v, store) for v in data]
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    key = f"__object_{len(store)}__"
    store[key] = data
    return key


def _placeholders_to_objects(data: Any, store: Mapping[str, Any]) -> Any:
    if isinstance(data, dict):
        return {k: _placeholders_to_objects(v, store) for k, v in data.items()}
    if isinstance(data, list):
        return [_placeholders_to_objects(v, store) for v in data]
    if isinstance(data, str) and data in store:
        return store[data]
    return data


def find_recipe(name_or_path: str, overrides: Iterable[str] = (), registry: Registry | None = None) -> Recipe:
    """``tempering run X``: X is a YAML path or the name of a registered (bundled) recipe,
    whose target is a function returning the recipe as a dict."""
    if name_or_path.endswith((".yaml", ".yml")) or os.path.sep in name_or_path:
        return Recipe.from_yaml(name_or_path, overrides)
    registry = registry or get_registry()
    data = registry.get("recipe", name_or_path).load()()
    return Recipe.from_dict(data, overrides)


