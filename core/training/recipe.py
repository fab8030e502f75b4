"""Recipes: a list of stages that share one backend, one output folder and one checkpoint chain.

A recipe is data (YAML or a dict) or Python objects -- :class:`Recipe` accepts both, so a
reward written as a Python function can sit where YAML would name a registered one.

Stages are resumable: after each stage, and inside one every ``checkpoint_minutes`` of wall
time or ``checkpoint_every`` steps (whichever comes first), the backend is saved and
``progress.json`` records where the run is. Running the same recipe into the same
``output_dir`` again skips finished stages, restores the latest checkpoint and cuts what the
interrupted run logged after it, so the run continues with the very step it would have taken
next and ``metrics.jsonl`` holds each step once. ``resume: false`` (``--fresh``) moves the
earlier run aside and starts over. The folder rules (lock, fresh start, pruning) are in
:mod:`tempering.runs.runfolder`; docs/runs.md tells them to users.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import random
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from tempering.errors import (
    ConfigError,
    RunStopped,
    StopRun,
)  # StopRun, RunStopped: the recipe's API, kept importable here
from tempering.interfaces import Backend, Closeable
from tempering.registry import ComponentSpec, PluginOverrideWarning, Registry, get_registry, params_schema
from tempering.runs import rollout_log, run_record, runfolder
from tempering.runs.redact import redact
from tempering.runs.runfolder import PROGRESS_FILE, read_progress
from tempering.training.config import load_yaml, resolve_recipe, stage_id
from tempering.training.progress import phase
from tempering.training.stage import config_only


@dataclass
class RunContext:
    """What a stage sees: the shared backend, loggers, paths and the resume state."""

    registry: Registry
    backend: Backend  # None only while the config is checked, before the backend is built
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
    #: Checkpoint mid-stage once this many minutes passed since the last checkpoint (0 = never).
    checkpoint_minutes: float = 0.0
    #: How many periodic checkpoints to keep besides every stage end (None = all).
    keep_checkpoints: int | None = None
    #: What ``progress.json`` holds; kept in memory so a run never inherits a stale file.
    progress: dict[str, Any] = field(default_factory=lambda: {"completed": [], "checkpoints": []})
    #: Rows logged so far in the whole run (a resumed run starts from its checkpoint's count);
    #: None for a run begun by a tempering that did not count them: its log is never cut.
    rows_logged: int | None = 0
    clock: Callable[[], float] = time.monotonic
    _due: dict[str, Any] | None = field(default=None, repr=False)
    _last_checkpoint: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._last_checkpoint = self.clock()

    @property
    def path(self) -> str:
        """Config path of the current stage, for error messages."""
        return f"stages[{self.stage_index}]"

    def build(self, kind: str, spec: object, key: str, **context: object) -> Any:
        return self.registry.build(kind, spec, f"{self.path}.{key}", **context)

    def factory(self, kind: str, spec: object, key: str, **context: object) -> Any:
        """A callable building a new component per call (see :meth:`Registry.factory`)."""
        return self.registry.factory(kind, spec, f"{self.path}.{key}", **context)

    def check(self, kind: str, spec: object, key: str, context: Iterable[str] = ()) -> None:
        self.registry.check(kind, spec, f"{self.path}.{key}", context)

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Log one step of the current stage (adds stage id and global step); then take the
        checkpoint :meth:`end_step` found due, so it covers this row."""
        row = {"stage": self.stage_id, "step": self.global_step, "time": time.time(), **metrics}
        self.history.append(row)
        for logger in self.loggers:
            logger.log(row, self.global_step)
        if self.rows_logged is not None:
            self.rows_logged += 1
        if self._due is not None:
            self.checkpoint(self._due)

    def budget_left(self) -> bool:
        """False once ``max_total_steps`` is reached; a stage that sees False stops early and
        is *not* marked finished, so the next run resumes it where it stopped."""
        left = self.max_total_steps is None or self.global_step < self.max_total_steps
        self.interrupted = self.interrupted or not left
        return left

    def end_step(self, state: Mapping[str, Any]) -> None:
        """Call after each optimizer step: counts it and, when a checkpoint is due (every
        ``checkpoint_every`` steps or ``checkpoint_minutes``), takes it at the step's
        :meth:`log` -- after the row is written, so a resumed run neither loses nor repeats
        the row, and after any evaluation of this step, so the saved RNG state is the one the
        next step starts from."""
        self.last_state = dict(state)
        self.global_step += 1
        by_steps = self.checkpoint_every and self.global_step % self.checkpoint_every == 0
        by_time = self.checkpoint_minutes and self.clock() - self._last_checkpoint >= 60 * self.checkpoint_minutes
        if by_steps or by_time:
            self._due = dict(state)

    def checkpoint(self, state: Mapping[str, Any] | None, done: bool = False) -> str:
        """Save the backend and record it in ``progress.json`` (``state`` = the stage's loop
        state; ``done``: the stage is finished), then prune old checkpoints."""
        progress = self.progress
        ledger = progress.setdefault("checkpoints", [])
        ckpt = runfolder.new_checkpoint_path(self.output_dir, self.global_step, ledger)
        extra = {"stage": self.stage_id, "state": dict(state or {}), "global_step": self.global_step}
        self.backend.save(ckpt, extra=extra)
        if done and self.stage_id not in progress["completed"]:
            progress["completed"].append(self.stage_id)
        ledger.append({"path": ckpt, "stage": self.stage_id, "global_step": self.global_step, "stage_end": done})
        progress["checkpoints"], dropped = runfolder.prune(ledger, self.keep_checkpoints)
        progress.update(
            checkpoint=ckpt,
            current=None if done else self.stage_id,
            global_step=self.global_step,
            metrics_rows=self.rows_logged,
        )
        if runfolder.is_primary_process():  # under torchrun, rank 0 alone: its rows and its save
            runfolder.write_json(os.path.join(self.output_dir, PROGRESS_FILE), progress)
            runfolder.remove_checkpoints(dropped)  # only once progress.json no longer lists them
        self._due, self._last_checkpoint = None, self.clock()
        return ckpt

    def checkpoint_unfinished(self) -> str | None:
        """Checkpoint the current stage as unfinished at its last completed step. None when it
        completed no step in this run: the previous checkpoint is then already the place to
        resume from, and the rows logged since are cut when the run resumes."""
        return None if self.last_state is None else self.checkpoint(self.last_state, done=False)


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
    backend: ComponentSpec = field(default_factory=lambda: {"name": "local"})
    loggers: Any = field(default_factory=lambda: ["jsonl", "plot"])
    seed: int = 0
    output_dir: str | None = None
    max_total_steps: int | None = None
    checkpoint_every: int = 0
    checkpoint_minutes: float = 5.0
    keep_checkpoints: int | None = 3
    resume: bool = True

    @classmethod
    def from_yaml(cls, path: str, overrides: Iterable[str] = ()) -> Recipe:
        return cls.from_dict(load_yaml(path), overrides)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], overrides: Iterable[str] = ()) -> Recipe:
        store: dict[str, Any] = {}  # placeholder -> the Python object it stands for
        cfg = resolve_recipe(_objects_to_placeholders(data, store), overrides)
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
            "checkpoint_minutes": self.checkpoint_minutes,
            "keep_checkpoints": self.keep_checkpoints,
            "resume": self.resume,
        }

    def run(self, registry: Registry | None = None, backend: Backend | None = None) -> RunResult:
        return run_recipe(self, registry=registry, backend=backend)


@dataclass
class RunResult:
    output_dir: str
    stages: dict[str, dict[str, Any]]
    history: list[dict[str, Any]]
    metadata: dict[str, Any]
    #: Every stage had already finished in ``output_dir``: nothing ran (``stages`` is empty).
    already_complete: bool = False

    def report(self) -> str:
        """What a finished run says (``tempering run`` prints it, and so can a script): where
        its files are and each stage's summary line (the last step's values, the latest
        evaluation's, failures, collapse)."""
        lines = [f"Done. Metrics, plot and checkpoints are in {self.output_dir}"]
        for sid, metrics in self.stages.items():
            shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
            lines.append(f"  {sid}: {shown}")
        return "\n".join(lines)


def run_recipe(recipe: Recipe, registry: Registry | None = None, backend: Backend | None = None) -> RunResult:
    """Run every stage of ``recipe`` in order, resuming if its output folder has progress.

    The folder is locked for the run (:class:`tempering.runs.runfolder.RunLock`). ``resume: false``
    moves an earlier run's files aside first. A resumed run loads the latest checkpoint, cuts
    the loggers back to the rows logged at that checkpoint and removes checkpoint directories
    ``progress.json`` does not list. A stage raising :class:`StopRun` is checkpointed as
    unfinished and the run ends with :class:`RunStopped`.
    """
    registry = registry or get_registry()
    cfg = recipe.to_dict()
    out_dir = cfg["output_dir"]
    seed_everything(cfg["seed"])
    stages = check_recipe(cfg, registry, backend)

    runfolder.make_output_dir(out_dir)
    primary = runfolder.is_primary_process()
    lock = runfolder.RunLock(out_dir)
    if primary:
        lock.acquire()
        for line in registry.overrides():  # one line each: an override must not change a run silently
            warnings.warn(line, PluginOverrideWarning, stacklevel=3)
    owns_backend = backend is None
    loggers: list[Any] = []
    try:
        progress = read_progress(out_dir) if cfg["resume"] else None
        if backend is None:
            phase(f"loading the model: {_loading(cfg['backend'])} ...")  # minutes for a real model: say so
            backend = registry.build("backend", backend_spec(registry, cfg), "backend")
        ctx = RunContext(
            registry,
            backend,
            cfg,
            out_dir,
            loggers,
            cfg["seed"],
            max_total_steps=cfg["max_total_steps"],
            checkpoint_every=cfg["checkpoint_every"],
            checkpoint_minutes=cfg["checkpoint_minutes"],
            keep_checkpoints=cfg["keep_checkpoints"],
        )
        finished = list(progress.get("completed", [])) if progress else []
        for i, (sid, algorithm) in enumerate(stages):  # every stage to run, data included, up front
            if sid not in finished and hasattr(algorithm, "validate"):
                ctx.stage_index, ctx.stage_id = i, sid
                algorithm.validate(ctx)
        if primary and not cfg["resume"]:  # only once the model is built and the data checked
            runfolder.start_fresh(out_dir)
        for i, spec in enumerate(_as_list(cfg["loggers"]) if primary else []):  # rank 0 alone writes the rows
            loggers.append(registry.build("logger", spec, f"loggers[{i}]", output_dir=out_dir))
        completed = _resume(ctx, progress, primary)
        already_complete = bool(stages) and all(sid in completed for sid, _ in stages)
        metadata = _metadata(registry, cfg)
        if primary:
            metadata = run_record.update(out_dir, metadata, progress, already_complete)
        if already_complete and primary:  # said, not a bare "Done": a rerun of a finished recipe does nothing
            warnings.warn(
                f"tempering: run '{cfg.get('name')}' in {out_dir} is already complete "
                f"(stages {', '.join(sid for sid, _ in stages)} finished); nothing was run. To start over, "
                "run it with --fresh (in Python: resume=False): the earlier run's files are moved to a "
                f"sibling folder {os.path.basename(os.path.abspath(out_dir))}.prev-<time>",
                runfolder.RunAlreadyComplete,
                stacklevel=3,
            )

        results: dict[str, dict[str, Any]] = {}
        for i, (sid, algorithm) in enumerate(stages):
            if sid not in completed:
                results[sid] = _run_stage(ctx, i, sid, algorithm, progress)
                if ctx.interrupted or not ctx.budget_left():
                    break
    finally:
        for logger in loggers:
            logger.close()
        if owns_backend and isinstance(backend, Closeable):
            backend.close()  # finish queued calls, end remote sessions
        lock.release()
    return RunResult(out_dir, results, ctx.history, metadata, already_complete=already_complete)


def check_recipe(
    cfg: Mapping[str, Any], registry: Registry | None = None, backend: Backend | None = None
) -> list[tuple[str, Any]]:
    """The checks a run makes before it touches its output folder, on ``cfg`` (a
    :meth:`Recipe.to_dict`): the checkpoint keys, every stage built (its keys, components and
    values), the backend's name and keys (unless a built ``backend`` is given). Raises a
    :class:`ConfigError` naming the key; returns the built stages as ``(stage id, algorithm)``.
    ``tempering show`` runs it too, so it never prints a recipe ``tempering run`` rejects."""
    registry = registry or get_registry()
    _check_run_keys(cfg)
    # Build every stage first: a config error in stage 3 should fail before stage 1 trains.
    stages = []
    for i, spec in enumerate(cfg["stages"]):
        sid = stage_id(spec, i)
        if isinstance(spec, Mapping):
            spec = {k: v for k, v in spec.items() if k != "id"}
        stages.append((sid, registry.build("algorithm", spec, f"stages[{i}]")))
    if backend is None:  # its name, keys, model and model kwargs: before the run folder is touched
        registry.check("backend", cfg["backend"], "backend")
    _check_stage_configs(registry, cfg, stages, backend)
    return stages


def _check_stage_configs(
    registry: Registry, cfg: Mapping[str, Any], stages: Sequence[tuple[str, Any]], backend: Backend | None
) -> None:
    """Every stage's config (values, enums, nested components; not its data, not what needs
    the backend) before anything else happens: a typo must not cost a model load, nor move an
    earlier run aside under ``--fresh``. The full check, data included, runs again once the
    backend is up and the finished stages are known."""
    # backend: None when the recipe builds its own (not yet built while only the config is checked)
    ctx = RunContext(registry, cast(Backend, backend), dict(cfg), cfg["output_dir"], [], cfg["seed"])
    with config_only():
        for i, (sid, algorithm) in enumerate(stages):
            if hasattr(algorithm, "validate"):
                ctx.stage_index, ctx.stage_id = i, sid
                algorithm.validate(ctx)


def _resume(ctx: RunContext, progress: Mapping[str, Any] | None, primary: bool) -> list[str]:
    """Restore the latest checkpoint (if any) into ``ctx``; cut the loggers back to the rows
    it had seen; remove checkpoints progress.json does not list. Returns the finished stages."""
    if progress and progress.get("checkpoint"):
        extra = ctx.backend.load(progress["checkpoint"])
        ctx.progress = {"checkpoints": [], **progress, "completed": list(progress.get("completed", []))}
        ctx.global_step = int(progress.get("global_step", 0))
        if progress.get("current"):
            ctx.resume_state = dict(extra.get("state") or {})
    ctx.rows_logged = progress.get("metrics_rows") if progress else 0  # None: no count to cut back to
    if ctx.rows_logged is not None:
        for logger in ctx.loggers:
            if hasattr(logger, "rewind"):  # optional: a logger that cannot take rows back skips it
                logger.rewind(ctx.rows_logged)
        if primary:
            rollout_log.rewind(ctx.output_dir, ctx.rows_logged)  # records are keyed by metrics row
    if primary:
        runfolder.remove_partial_writes(ctx.output_dir)
    if primary and (progress is None or "checkpoints" in progress):
        runfolder.remove_unlisted_checkpoints(ctx.output_dir, ctx.progress["checkpoints"])
    return list(ctx.progress["completed"])


class RunsStage(Protocol):
    """What a recipe runs as a stage: a :class:`~tempering.training.stage.Stage`, or any
    component with ``run(ctx)`` (the specialists system runs whole recipes of its own)."""

    def run(self, ctx: RunContext) -> dict[str, Any] | None: ...


def _run_stage(
    ctx: RunContext, index: int, sid: str, algorithm: RunsStage, progress: Mapping[str, Any] | None
) -> dict[str, Any]:
    """Run one stage and checkpoint it: finished, or unfinished when it ran out of budget or
    raised :class:`StopRun` (which becomes :class:`RunStopped`)."""
    ctx.stage_index, ctx.stage_id = index, sid
    if not progress or progress.get("current") != sid:
        ctx.resume_state = None
    ctx.interrupted = False
    ctx.last_state = dict(ctx.resume_state) if ctx.resume_state else None  # a resumed stage starts where it was
    try:
        result = algorithm.run(ctx) or {}
    except StopRun as stop:
        saved = ctx.checkpoint_unfinished()
        where = f"is checkpointed at step {ctx.global_step}" if saved else "will start this stage over"
        raise RunStopped(
            f"stage '{sid}' stopped the run: {stop}. The run {where}: fix the cause and run "
            f"the same recipe again to resume"
        ) from stop
    if ctx.interrupted:  # out of budget mid-stage: checkpoint where it stands, resumable
        ctx.checkpoint_unfinished()
    else:
        ctx.checkpoint(None, done=True)
        ctx.resume_state = None
    return result


def _check_run_keys(cfg: Mapping[str, Any]) -> None:
    """The checkpoint keys, checked before anything runs (one line: key, problem, fix)."""

    def number(value: object, kinds: tuple[type, ...]) -> bool:
        return isinstance(value, kinds) and not isinstance(value, bool)

    every, minutes = cfg["checkpoint_every"], cfg["checkpoint_minutes"]
    if not (number(every, (int,)) and every >= 0):
        raise ConfigError(f"must be a whole number of steps >= 0 (0 = off), got {every!r}", "checkpoint_every")
    if not (number(minutes, (int, float)) and minutes >= 0):
        raise ConfigError(f"must be a number of minutes >= 0 (0 = off), got {minutes!r}", "checkpoint_minutes")
    keep = cfg["keep_checkpoints"]
    if keep is not None and not (number(keep, (int,)) and keep >= 1):
        raise ConfigError(
            f"must be an integer >= 1 (the latest checkpoint is always kept) or null to keep all, got {keep!r}",
            "keep_checkpoints",
        )


def backend_spec(registry: Registry, cfg: Mapping[str, Any]) -> Any:
    """The recipe's backend spec as the run builds it: with the recipe's ``seed`` unless the
    backend sets its own (one seed for the whole recipe). ``tempering export``/``eval`` rebuild
    a run's backend through this, so a LoRA run gets back the base model it trained on."""
    spec = cfg["backend"]
    if isinstance(spec, Mapping) and "seed" not in spec and _accepts(registry, spec, "seed"):
        spec = {**spec, "seed": cfg.get("seed", 0)}
    return spec


def _accepts(registry: Registry, spec: Mapping[str, Any], key: str) -> bool:
    schema = params_schema(registry.get("backend", spec["name"]).load())
    return schema is None or key in {f.name for f in dataclasses.fields(schema)}


def _loading(spec: object) -> str:
    """What the phase line names while the backend is built: its model and backend name."""
    if isinstance(spec, Mapping):
        return f"{spec.get('model', 'default model')} on the {spec.get('name')} backend"
    return str(spec)


def _as_list(x: object) -> list[Any]:
    if x is None:
        return []
    return list(x) if isinstance(x, (list, tuple)) else [x]


def _metadata(registry: Registry, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Which provider and version each named component resolved to: reproducibility."""
    used: dict[str, str] = {}

    def visit(node: object, kind_hint: str | None) -> None:
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
    # redacted: run.json is read by the trackers and `tempering view`; the components got the real values
    recorded = {**cfg, "stages": [_stage_record(spec) for spec in cfg["stages"]]}
    return {
        "tempering": importlib.metadata.version("tempering"),
        "recipe": redact(_jsonable(recorded)),
        "components": used,
        "cwd": os.getcwd(),  # what the recipe's relative paths (a dataset file) were resolved from
    }


def _stage_record(spec: object) -> Any:
    """A stage built in Python (a dataclass) recorded by its keys, not as an opaque object: the
    record says what it trained with, and a rerun can compare keys (:mod:`tempering.runs.run_record`)."""
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return spec
    keys = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.init}
    return {"name": f"<python object {type(spec).__qualname__}>", **keys}


def _jsonable(x: object) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return f"<python object {getattr(x, '__qualname__', type(x).__name__)}>"


def _objects_to_placeholders(data: object, store: dict[str, Any]) -> Any:
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


def _placeholders_to_objects(data: object, store: Mapping[str, Any]) -> Any:
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
