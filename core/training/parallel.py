"""Train recipes in worker processes, several at once, timed: the machinery behind the domain
specialists (``specialists`` stage, ``examples/domain_specialists``).

Every worker is forked from one ``multiprocessing`` *forkserver* that imported torch and
transformers once (:data:`PRELOAD` plus the caller's modules) and never ran a torch op, so a
worker starts in a fraction of a second with no inherited threads or locks: importing torch
anew costs 10+ CPU-seconds per process on a busy machine, which would swamp a short run. Each
worker trains its recipe (:func:`train_one`), then answers prompts greedily with the trained
model. The parent times a batch of jobs from their launch to the end of the last training (the
answers afterwards are not counted) and samples the machine's load average meanwhile, since
other jobs on a shared machine change any speed-up.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import Backend
    from tempering.training.recipe import Recipe

#: Imported once by the fork server (callers add their own modules).
PRELOAD = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.generation.utils",
    "tempering.training.recipe",
    "tempering.training.evaluate",
    "tempering.training.parallel",
)

#: Tokens a greedy answer may take (short-answer Q&A).
ANSWER_TOKENS = 16


def cpu_seconds() -> float:
    """User + system CPU time of this process."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def build_backend(recipe: Recipe) -> Any:
    """The recipe's backend, seeded like ``run_recipe`` would (one seed for the whole recipe)."""
    from tempering.registry import get_registry
    from tempering.training.recipe import _accepts

    registry = get_registry()
    spec = dict(recipe.backend) if isinstance(recipe.backend, Mapping) else {"name": recipe.backend}
    if "seed" not in spec and _accepts(registry, spec, "seed"):
        spec["seed"] = recipe.seed
    return registry.build("backend", spec, "backend")


def answer_with(
    backend: Backend, prompts: Sequence[str | Mapping[str, Any]], max_tokens: int = ANSWER_TOKENS, batch_size: int = 256
) -> list[str]:
    """Greedy answers of ``backend``'s current model to ``prompts`` (text, or dataset rows),
    rendered as a stage renders them (a chat model's template for an instruct model)."""
    from tempering.training.evaluate import evaluate

    rows = [dict(p) if isinstance(p, Mapping) else {"prompt": p} for p in prompts]
    texts: list[str] = []
    evaluate(
        backend,
        rows,
        None,
        max_tokens,
        batch_size=batch_size,
        on_groups=lambda groups: texts.extend(g.samples[0].completion.text for g in groups),
    )
    return texts


def samples_seen(recipe: Recipe) -> dict[str, int]:
    """What a run trains on: SFT rows plus GRPO completions (prompts x group size)."""
    out = {"sft_rows": 0, "grpo_prompts": 0, "grpo_completions": 0}
    for s in recipe.stages:
        if s["name"] == "sft":
            out["sft_rows"] += int(s["steps"]) * int(s.get("batch_size", 64))
        elif s["name"] == "grpo":
            prompts = int(s["steps"]) * int(s.get("prompts_per_step", 16))
            out["grpo_prompts"] += prompts
            out["grpo_completions"] += prompts * int(s.get("group_size", 8))
    out["total"] = out["sft_rows"] + out["grpo_completions"]
    return out


def train_one(job: Mapping[str, Any]) -> dict[str, Any]:
    """In a worker process: run ``job["recipe"]``, then answer ``job["prompts"]`` (greedy,
    ``job["max_tokens"]``) with the trained model; then, if given, ``job["then"]`` (another
    recipe continuing from these weights, and its prompts). Times are ``time.time()`` stamps,
    so that the parent can tell training from answering."""
    os.environ.setdefault("TEMPERING_PROGRESS", "0")
    t_start, cpu_start = time.time(), cpu_seconds()
    import torch

    torch.set_num_threads(1)  # also what the local backend's num_threads: 1 does
    from tempering.training.recipe import read_progress

    max_tokens = int(job.get("max_tokens", ANSWER_TOKENS))

    def one(recipe: Recipe, backend: Backend, prompts: Sequence[Any]) -> dict[str, Any]:
        t0, c0 = time.time(), cpu_seconds()
        result = recipe.run(backend=backend)
        t1, c1 = time.time(), cpu_seconds()
        answers = answer_with(backend, prompts, max_tokens) if prompts else []
        progress = read_progress(result.output_dir) or {}
        return {
            "output_dir": result.output_dir,
            "checkpoint": progress.get("checkpoint"),
            "completed": progress.get("completed", []),
            "stages": result.stages,
            "samples_seen": samples_seen(recipe),
            "train_started": t0,
            "train_ended": t1,
            "train_wall_s": t1 - t0,
            "train_cpu_s": c1 - c0,
            "answers": answers,
            "eval_wall_s": time.time() - t1,
        }

    recipe = job["recipe"]
    backend = build_backend(recipe)
    out = one(recipe, backend, job.get("prompts", ()))
    out["setup_wall_s"] = out["train_started"] - t_start
    if job.get("then"):
        out["then"] = one(job["then"]["recipe"], backend, job["then"].get("prompts", ()))
    if hasattr(backend, "close"):
        backend.close()
    out.update(process_started=t_start, cpu_s=cpu_seconds() - cpu_start, pid=os.getpid())
    return out


def _noop(_: object = None) -> int:
    return os.getpid()


class LoadSampler:
    """Samples ``os.getloadavg()`` (1-minute) every ``every`` seconds in a background thread."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(self.every)

    def __enter__(self) -> LoadSampler:
        self.before = os.getloadavg()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.after = os.getloadavg()

    def summary(self) -> dict[str, float]:
        s = self.samples or [self.before[0]]
        return {
            "before_1min": round(self.before[0], 2),
            "before_5min": round(self.before[1], 2),
            "mean_1min": round(sum(s) / len(s), 2),
            "max_1min": round(max(s), 2),
            "after_1min": round(self.after[0], 2),
        }

    def until(self, start: float, end: float) -> dict[str, float]:
        """The summary over ``start..end`` only (samples are ``every`` seconds apart from ``start``)."""
        n = max(1, int((end - start) / self.every) + 1)
        s = self.samples[:n] or [self.before[0]]
        return {**self.summary(), "mean_1min": round(sum(s) / len(s), 2), "max_1min": round(max(s), 2)}


def mp_context(preload: Sequence[str] = ()) -> Any:
    """``forkserver`` (POSIX) preloading :data:`PRELOAD` and ``preload``; ``spawn`` where there is
    no fork."""
    import multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods():
        return get_context("spawn")
    ctx = get_context("forkserver")
    ctx.set_forkserver_preload([*PRELOAD, *preload])
    return ctx


def warm_up(preload: Sequence[str] = ()) -> float:
    """Start the fork server (it imports the preloaded modules) before anything is timed;
    returns the seconds taken."""
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=1, mp_context=mp_context(preload)) as pool:
        pool.submit(_noop).result()
    return time.perf_counter() - t0


def run_concurrently(
    jobs: Mapping[str, Mapping[str, Any]],
    fn: Callable[[Mapping[str, Any]], Any] = train_one,
    workers: int | None = None,
    preload: Sequence[str] = (),
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``fn(job)`` for every job, each in its own worker process, all at once.

    Returns the results by name and the timing: ``wall_s`` from the launch to the last
    result; with :func:`train_one`, ``train_wall_s`` from the launch to the end of the last
    job's training (its answers excluded) and the load average meanwhile."""
    with LoadSampler() as load:
        launched = time.time()
        with ProcessPoolExecutor(max_workers=workers or len(jobs), mp_context=mp_context(preload)) as pool:
            futures = {name: pool.submit(fn, job) for name, job in jobs.items()}
            results = {name: f.result() for name, f in futures.items()}
        ended = time.time()
    timing: dict[str, Any] = {"wall_s": ended - launched, "load": load.summary()}
    ends = [r["train_ended"] for r in results.values() if isinstance(r, Mapping) and "train_ended" in r]
    if ends:
        timing["train_wall_s"] = max(ends) - launched
        timing["load"] = load.until(launched, max(ends))
    return results, timing


def free_core_ratios(serial_cpu_s: float, parallel_cpu_s: Sequence[float]) -> dict[str, float]:
    """What the serial run / parallel runs wall-clock ratio would be without contention, from
    the CPU-seconds each run used: a run alone on a free core takes about its CPU time, so the
    parallel runs on as many free cores take the longest one's, and on 2 free cores at least
    half their sum. ``work_ratio``: the serial run's CPU work over the parallel runs' total."""
    longest, total = max(parallel_cpu_s), sum(parallel_cpu_s)
    return {
        f"ratio_cpu_estimate_{len(parallel_cpu_s)}_free_cores": serial_cpu_s / longest,
        "ratio_cpu_estimate_2_free_cores": serial_cpu_s / max(longest, total / 2),
        "work_ratio_generalist_over_specialists": serial_cpu_s / total,
    }
