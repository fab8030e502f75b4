"""``tempering eval RUN_DIR|MODEL_DIR``: a checkpoint, or a model folder, on a dataset.

Evaluated with the components training uses -- a registered dataset, reward, sampler
(``completion``, or ``environment`` for whole tool-use episodes) and renderer, sampled by the
same backend code -- so the number is the number a stage's evaluation would report:

* ``reward/mean``, ``accuracy`` (share of samples with reward >= ``success_threshold``) and,
  with ``samples`` k > 1 per example, ``pass@j`` for j = 1, 2, 4, ..., k: the unbiased
  estimator 1 - C(n-c, j) / C(n, j) per example (n samples, c correct), averaged;
* for probability answers (forecasting: a ``brier``/``brier_skill`` reward, whose parts hold the
  forecast ``p`` and outcome ``y``; or ``outcome_key`` naming the example's outcome column, the
  probability then read from the completion) the Brier score, Brier skill and ECE
  (:mod:`tempering.runs.calibration`) and a reliability diagram PNG.

A run folder needs no flags: the dataset, reward, sampler and renderer default to the recipe's
last held-out evaluation (its last stage with ``eval.dataset``). Results go to ``out``:
``eval.json`` (the metrics and what was evaluated), ``rollouts.jsonl`` (every sample, in the
rollout log's format) and ``reliability.png``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, cast

from tempering.apps.export import exported_renderer
from tempering.errors import ConfigError, TemperingError
from tempering.interfaces import model_renderer
from tempering.registry import Registry, get_registry
from tempering.rollouts.data import load_examples
from tempering.rollouts.renderer import check_renderer, resolved_name
from tempering.rollouts.rollout import collect, rollout_metrics
from tempering.rollouts.scoring import RewardRunner
from tempering.runs import rollout_log
from tempering.runs.calibration import calibration, forecasts_of, reliability_diagram
from tempering.runs.failures import failure_metrics
from tempering.runs.outcomes import outcome_metrics
from tempering.training.config import parse_value
from tempering.training.evaluate import build_sampler
from tempering.training.rundata import RunDir, run_backend
from tempering.training.stage import check_sampler
from tempering.types import Group, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import Backend


@dataclass
class EvalSpec:
    """What to evaluate on (the ``tempering eval`` flags, or a recipe's ``eval:`` block)."""

    dataset: Any = None
    reward: Any = None
    sampler: Any = "completion"
    renderer: Any = "auto"
    max_tokens: int = 32
    temperature: float | None = None  # None: greedy for one sample per example, 1.0 for several
    samples: int = 1
    success_threshold: float = 1.0
    outcome_key: str | None = None
    limit: int | None = None
    batch_size: int = 64

    def check(self) -> None:
        if self.dataset is None:
            raise ConfigError(
                "no dataset to evaluate on: give --dataset (a registered name, a YAML mapping such as "
                "'{name: arithmetic, split: test}', or a .jsonl file)",
                "--dataset",
            )
        for key in ("max_tokens", "samples", "batch_size"):
            if int(getattr(self, key)) < 1:
                raise ConfigError(f"must be >= 1, got {getattr(self, key)}", f"--{key.replace('_', '-')}")
        if self.temperature is not None and self.temperature < 0:
            raise ConfigError(f"must be >= 0 (0 = greedy), got {self.temperature}", "--temperature")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"must be >= 1, got {self.limit}", "--limit")

    @property
    def sampling_temperature(self) -> float:
        return float(self.temperature) if self.temperature is not None else (1.0 if self.samples > 1 else 0.0)


def spec_from_recipe(recipe: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's last held-out evaluation as :class:`EvalSpec` fields (empty if none)."""
    for stage in reversed(list(recipe.get("stages") or [])):
        ev = stage.get("eval") if isinstance(stage, Mapping) else None
        if isinstance(ev, Mapping) and ev.get("dataset") is not None:
            out = {"dataset": ev["dataset"], "renderer": stage.get("renderer", "auto")}
            sampler = ev.get("sampler") or stage.get("sampler")
            if sampler is not None:
                out["sampler"] = sampler
            for key in ("reward", "max_tokens"):
                if ev.get(key) is not None:
                    out[key] = ev[key]
            if (
                "reward" not in out
            ):  # the eval block's default: the stage's reward (tempering.training.stage.eval_reward)
                own = stage.get("reward")
                out["reward"] = own if isinstance(own, (str, Mapping)) else "tempering:exact_match"
            return out
    return {}


def dataset_spec(text: str) -> Any:
    """``--dataset``: a ``.jsonl`` path, a registered name, or a YAML mapping."""
    if text.endswith(".jsonl") and not text.lstrip().startswith("{"):
        return {"name": "jsonl", "path": text}
    return parse_value(text)


#: Dataset keys holding file paths, resolved by :func:`resolve_paths`.
PATH_KEYS = ("path", "data_files")


def resolve_paths(spec: object, base: object) -> Any:
    """A recipe's dataset spec with each relative file path (``path``, ``data_files``) that is
    not there from the current folder made absolute against ``base`` -- the folder the run
    resolved it from (``cwd`` in ``run.json``) -- where it is there: ``tempering eval RUN_DIR``
    then finds the recipe's data from any folder. Anything else is left as it is."""
    if not isinstance(base, str) or not isinstance(spec, Mapping):
        return spec

    def fix(value: object) -> Any:
        if isinstance(value, list):
            return [fix(v) for v in value]
        if not isinstance(value, str) or os.path.isabs(value) or os.path.exists(value):
            return value
        there = os.path.join(base, value)
        return there if os.path.exists(there) or any(c in value for c in "*?[") else value

    return {k: fix(v) if k in PATH_KEYS else v for k, v in spec.items()}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one example with ``c`` correct of ``n`` samples (k <= n):
    the chance that ``k`` samples drawn without replacement hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    ks = [1]
    while ks[-1] * 2 <= n:
        ks.append(ks[-1] * 2)
    return ks if ks[-1] == n else [*ks, n]


class EvalContext:
    """What building a sampler, dataset and reward needs from a stage's context, outside a run:
    the registry, the backend (its tokenizer) and paths named after the command's flags."""

    path = "eval"

    def __init__(self, registry: Registry, backend: Backend) -> None:
        self.registry, self.backend = registry, backend

    def build(self, kind: str, spec: object, key: str, **context: object) -> Any:
        return self.registry.build(kind, spec, f"--{key}", **context)

    def factory(self, kind: str, spec: object, key: str, **context: object) -> Any:
        return self.registry.factory(kind, spec, f"--{key}", **context)

    def check(self, kind: str, spec: object, key: str, context: Iterable[str] = ()) -> None:
        self.registry.check(kind, spec, f"--{key}", context)


@dataclass
class EvalReport:
    """The metrics, every sample as a rollout-log record, the calibration of forecasts (None
    without probability answers) and the files written."""

    metrics: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    calibration: Any = None
    files: dict[str, str] = field(default_factory=dict)


def evaluate_policy(backend: Backend, spec: EvalSpec, registry: Registry | None = None) -> EvalReport:
    """Sample ``spec.samples`` rollouts per example of ``spec.dataset`` with ``backend`` through
    the spec's sampler, score them, and compute the metrics (see the module docs)."""

    spec.check()
    registry = registry or get_registry()
    ctx = EvalContext(registry, backend)
    try:
        examples = load_examples(ctx, spec.dataset, "dataset")
    except TemperingError:
        raise
    except (OSError, ValueError, TypeError) as exc:  # a missing file, a bad row: one line, as a run says it
        raise ConfigError(f"the dataset does not load: {type(exc).__name__}: {exc}", "--dataset") from None
    if spec.limit is not None:
        examples = examples[: spec.limit]
    if not examples:
        raise ConfigError("the dataset has no rows", "--dataset")
    reward = RewardRunner(ctx.build("reward", spec.reward, "reward")) if spec.reward is not None else None
    sampler = build_sampler(ctx, spec.sampler or "completion", "sampler", reward, spec.renderer)
    params = SamplingParams(max_tokens=int(spec.max_tokens), temperature=spec.sampling_temperature)
    groups: list[Group] = []
    for start in range(0, len(examples), spec.batch_size):
        chunk = examples[start : start + spec.batch_size]
        groups += collect(sampler, backend, chunk, int(spec.samples), params, first_id=start).groups
    metrics = score_groups(groups, spec.success_threshold)
    forecasts = forecasts_of(groups, spec.outcome_key, registry)
    cal = None
    if forecasts:
        cal = calibration([p for p, _ in forecasts], [y for _, y in forecasts])
        metrics.update(cal.metrics())
    trainer_step = int(getattr(backend, "step", 0) or 0)
    records = [
        {
            "v": rollout_log.FORMAT_VERSION,
            "row": None,
            "stage": "eval",
            "step": trainer_step,
            "kind": "eval",
            **rollout_log.sample_record(s, g, i, trainer_step=trainer_step),
        }
        for g in groups
        for i, s in enumerate(g.samples)
    ]
    return EvalReport(metrics, records, cal)


def score_groups(groups: Sequence[Group], success_threshold: float = 1.0) -> dict[str, Any]:
    """Mean reward, accuracy and pass@k over groups of samples of one example each. Failed and
    masked samples count as wrong with reward 0, as in a stage's evaluation; scored samples are
    also counted by their reward's label (``outcome/<label>``)."""
    samples = [s for g in groups for s in g.samples]
    rewards = [0.0 if (s.failed or s.masked) else float(s.reward) for s in samples]
    n = max(len(samples), 1)
    correct = lambda ss: sum(not (s.failed or s.masked) and s.reward >= success_threshold - 1e-9 for s in ss)
    out: dict[str, Any] = {
        "examples": float(len(groups)),
        "samples": float(len(samples)),
        "reward/mean": sum(rewards) / n,
        "accuracy": correct(samples) / n,
        "failed": float(sum(s.failed for s in samples)),
    }
    sizes = {len(g.samples) for g in groups}
    if len(sizes) == 1 and (size := sizes.pop()) > 1:
        for k in ks_for(size):
            out[f"pass@{k}"] = sum(pass_at_k(size, correct(g.samples), k) for g in groups) / len(groups)
    extra = rollout_metrics(groups)
    out.update({k: v for k, v in extra.items() if k.startswith("env/") and isinstance(v, float)})
    out.update(failure_metrics(samples))
    out.update(outcome_metrics(samples))
    return out


def check_spec(registry: Registry, spec: EvalSpec) -> None:
    """The spec's values and the names and keys of its components, without building them."""

    spec.check()
    ctx = EvalContext(registry, cast("Backend", None))  # only checks: nothing is built, no backend
    ctx.check("dataset", spec.dataset, "dataset")
    if spec.reward is not None:
        ctx.check("reward", spec.reward, "reward")
    check_sampler(ctx, spec.sampler or "completion", "sampler")  # type: ignore[arg-type]  # it needs a BuildContext only
    check_renderer(ctx, spec.renderer)


def run_eval(
    target: str,
    spec: Mapping[str, Any],
    out: str | None = None,
    step: int | None = None,
    registry: Registry | None = None,
) -> EvalReport:
    """Evaluate a run's checkpoint (``target`` a run folder: ``step``, default the latest) or a
    Hugging Face model folder; ``spec`` holds the given :class:`EvalSpec` fields (a run's recipe
    fills the rest). Writes ``eval.json``, ``rollouts.jsonl`` and, for forecasts,
    ``reliability.png`` into ``out``."""
    registry = registry or get_registry()
    given = {k: v for k, v in spec.items() if v is not None}
    unknown = set(given) - {f.name for f in fields(EvalSpec)}
    if unknown:
        raise ConfigError(f"unknown eval setting '{sorted(unknown)[0]}'", "eval")
    model_folder = os.path.isfile(os.path.join(target, "config.json"))  # an export, a download
    run = None if model_folder else RunDir.open(target, "RUN_DIR|MODEL_DIR")
    if model_folder and step is not None:
        raise ConfigError(f"'{target}' is a model folder, not a run: it has no checkpoints to pick", "--step")
    defaults = spec_from_recipe(run.recipe) if run else {}
    if run is not None and defaults.get("dataset") is not None:  # the recipe's relative paths: the run's folder
        defaults["dataset"] = resolve_paths(defaults["dataset"], run.info().get("cwd"))
    if run is None and (renderer := exported_renderer(target)):
        defaults["renderer"] = renderer
    resolved = EvalSpec(**{**defaults, **given})
    check_spec(registry, resolved)  # a typo fails before a model loads
    with ExitStack() as stack:
        if run is None:
            backend = registry.build("backend", {"name": "local", "model": target}, "backend")
            stack.callback(getattr(backend, "close", lambda: None))
            source = {"model": os.path.abspath(target)}
            out = out or os.path.join("evals", os.path.basename(os.path.abspath(target)))
        else:
            backend, ckpt = stack.enter_context(run_backend(run, step, registry))
            source = {
                "run": os.path.abspath(target),
                "checkpoint": os.path.abspath(ckpt["path"]),  # absolute, like "run"
                "global_step": ckpt["global_step"],
            }
            out = out or os.path.join(target, "evals", f"step{int(ckpt['global_step']):06d}")
        report = evaluate_policy(backend, resolved, registry)
        recorded = replace(
            resolved, renderer=resolved_name(resolved.renderer, backend.tokenizer, model_renderer(backend))
        )  # not "auto"
    return write_report(report, recorded, source, out)


def write_report(report: EvalReport, spec: EvalSpec, source: Mapping[str, Any], out: str) -> EvalReport:
    """Write ``eval.json`` (what was evaluated, how, and the metrics), ``rollouts.jsonl`` and,
    for forecasts, ``reliability.png`` into ``out``; their paths go to ``report.files``."""
    os.makedirs(out, exist_ok=True)
    report.files["rollouts"] = os.path.join(out, rollout_log.FILENAME)
    if os.path.exists(report.files["rollouts"]):
        os.remove(report.files["rollouts"])
    rollout_log.append(report.files["rollouts"], report.records)
    if report.calibration is not None:
        report.files["reliability"] = reliability_diagram(report.calibration, os.path.join(out, "reliability.png"))
    report.files["metrics"] = os.path.join(out, "eval.json")
    payload = {
        "source": dict(source),
        "spec": rollout_log.jsonable(asdict(spec)),
        "metrics": rollout_log.jsonable(report.metrics),
    }
    with open(report.files["metrics"], "w", encoding="utf-8") as fh:
        json.dump(payload, fh, indent=2)
    return report
