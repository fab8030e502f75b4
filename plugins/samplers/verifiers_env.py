"""Environments from ``verifiers`` (0.4): the ``verifiers`` sampler and the ``verifiers`` dataset.

A verifiers environment package (the Prime Environments Hub's format: a taskset, a harness, a
rubric of ``@vf.reward`` functions, ``load_environment``) is installed like any package and named
by its id::

    dataset: {name: verifiers, id: my-env}                     # its tasks, one row each
    sampler: {name: verifiers, id: my-env, args: {taskset: {...}}}

Each sample is one verifiers episode (``Env.run_episode``) whose model is the stage's policy: the
episode's client points at its own address on the policy's OpenAI-compatible endpoint (verifiers'
*eval* client relays every request there unchanged), so the calls are recorded token-exactly and
trained like the ``agent`` sampler's, and the episode's reward is the sum of its traces' rewards
(the rubric's). An episode that verifiers reports as not ok (a harness, task or scoring error)
fails with its first error and traceback.

verifiers pins its own dependencies (``mcp``, ``openai`` 2.x) and conflicts with other agent
formats' (OpenEnv's ``mcp``): it is the ``verifiers`` extra, kept in a venv of its own in CI.
Its agents run in the ``subprocess`` runtime (on this machine) unless ``args`` says otherwise.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import math
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from tempering.errors import ConfigError
from tempering.plugins.samplers.agent import EndpointSampler, HarnessThread, Outcome, guarded
from tempering.plugins.samplers.openai_endpoint import MODEL_NAME, EpisodeCalls, PolicyEndpoint
from tempering.rollouts.episode import ModelQueue
from tempering.schema import Problem

VERIFIERS_HINT = "pip install 'tempering[verifiers]'"


def env_config(id: str, args: Mapping[str, Any] | None, seats: Sequence[str] = ("agent",)) -> dict[str, Any]:
    """The verifiers env config of ``id`` with ``args`` over it (one level deep: ``args:
    {taskset: {...}}`` adds taskset keys); each of the env config's agent ``seats`` (``agent``
    for a plain taskset, the roles an environment declares: textarena's ``player``) runs
    locally (``subprocess``) unless ``args`` says otherwise."""
    config: dict[str, Any] = {"taskset": {"id": id}, **{seat: {"runtime": {"type": "subprocess"}} for seat in seats}}
    for key, value in dict(args or {}).items():
        config[key] = (
            {**config[key], **value} if isinstance(config.get(key), dict) and isinstance(value, Mapping) else value
        )
    return config


def agent_seats(id: str) -> list[str]:
    """The agent fields of ``id``'s env config class (its ``AgentConfig`` seats)."""
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import env_config_type

    fields = env_config_type(id).model_fields
    return [
        name
        for name, f in fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, vf.AgentConfig)
    ]


def error_line(exc: BaseException) -> str:
    """verifiers' error in one line with its cause: a pydantic validation error's every
    ``field.path: message`` (its first line only counts the errors), else the text's lines."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            found = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in errors()]
        except Exception:  # noqa: BLE001 - not pydantic's: fall back to the text
            found = []
        if found:
            return f"{type(exc).__name__}: " + "; ".join(found)
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text or 'no message'}"


def id_problem(id: object) -> str | None:
    """Why ``id`` names no installed verifiers environment, in one line; None when it does."""
    if not isinstance(id, str) or not id.strip():
        return f"needs the id of an installed verifiers environment, got {id!r}"
    if importlib.util.find_spec("verifiers") is None:
        return f"verifiers is not installed: {VERIFIERS_HINT}"
    module = id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return (
            f"no verifiers environment '{id}' is installed (looked for the module '{module}'): pip install "
            "the environment's package, or check the id"
        )
    return None


@lru_cache(maxsize=8)
def _load(id: str, args_key: str) -> Any:
    import json

    import verifiers.v1 as vf

    config = vf.resolve_env_config(env_config(id, json.loads(args_key), agent_seats(id)))
    return vf.load_environment(config)


def load_env(id: str, args: Mapping[str, Any] | None, path: str) -> Any:
    """The verifiers ``Env`` (cached per id and args); any failure is one :class:`ConfigError`."""
    import json

    problem = id_problem(id)
    if problem is not None:
        raise ConfigError(problem, f"{path}.id")
    try:
        return _load(id, json.dumps(dict(args or {}), sort_keys=True, default=str))
    except Exception as exc:  # noqa: BLE001 - verifiers' own validation, as one line
        raise ConfigError(f"verifiers could not load '{id}': {error_line(exc)}", path) from None


def verifiers_tasks(id: str, args: Mapping[str, Any] | None = None, size: int | None = None) -> list[dict[str, Any]]:
    """The environment's tasks as rows: ``task`` (its index, which the sampler plays) and
    ``prompt`` (its text, for logs and the completion sampler)."""
    env = load_env(id, args, "dataset")
    if size is None and not env.taskset.bounded:
        raise ConfigError(
            f"verifiers environment '{id}' has an endless taskset: set the dataset's size (size: 1000)", "dataset"
        )
    return [
        {"task": i, "prompt": task.data.prompt_text, "verifiers_id": id}
        for i, task in enumerate(itertools.islice(env.taskset, size))
    ]


@dataclass
class VerifiersSampler(EndpointSampler):
    """Config keys: ``id`` (an installed verifiers environment, required), ``args`` (verifiers
    env config over the defaults), and the ``agent`` sampler's ``harness_timeout``,
    ``max_concurrent``, ``max_total_tokens``, ``max_n``, ``batch_wait``. Examples need ``task``,
    the task's index (the ``verifiers`` dataset's rows have it)."""

    id: str = ""
    args: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Any:
        problem = id_problem(config.get("id"))
        if problem is not None:
            yield Problem("id", problem)
        yield from EndpointSampler.limit_problems(config)

    def __post_init__(self) -> None:
        super().__post_init__()
        self._env = load_env(self.id, self.args, self.path)
        # read lazily, as far as the highest task index a step plays: a taskset may never end
        self._tasks: list[Any] = []
        self._reader = iter(self._env.taskset)
        self._read_all = False

    def _task(self, example: Mapping[str, Any]) -> Any:
        index = example.get("task")
        while isinstance(index, int) and index >= len(self._tasks) and not self._read_all:
            try:
                self._tasks.append(next(self._reader))
            except StopIteration:
                self._read_all = True
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(self._tasks):
            known = f"0..{len(self._tasks) - 1}" if self._read_all else "an index >= 0"
            raise ValueError(
                f"the example's 'task' must be a task index of '{self.id}' ({known}), "
                f"got {index!r}; use dataset: {{name: verifiers, id: {self.id}}}"
            )
        return self._tasks[index]

    async def play(
        self, endpoint: PolicyEndpoint, queue: ModelQueue, jobs: Sequence[tuple[int, dict[str, Any]]]
    ) -> list[tuple[EpisodeCalls, Outcome]]:
        """Every job as one verifiers episode, all on one loop (verifiers serves its
        interception server there for the whole batch), each within ``harness_timeout``."""
        import verifiers.v1 as vf

        main = asyncio.get_running_loop()
        var = f"TEMPERING_ENDPOINT_TOKEN_{secrets.token_hex(4).upper()}"  # verifiers reads keys from the environment
        os.environ[var] = endpoint.token
        episodes = [endpoint.open_episode(key) for key, _ in jobs]
        gate_size = self.max_concurrent

        async def one(gate: asyncio.Semaphore, episode: EpisodeCalls, example: dict[str, Any]) -> Outcome:
            async with gate:
                main.call_soon_threadsafe(queue.join, episode.key)
                try:
                    task = self._task(example)
                    client = vf.EvalClientConfig(base_url=episode.base_url, api_key_var=var)
                    ctx = vf.ModelContext(model=MODEL_NAME, client=client)
                    run = asyncio.wait_for(self._env.run_episode(task, ctx), self.harness_timeout)
                    outcome = await guarded(_timed(run, self.harness_timeout), self.path)
                    return outcome if outcome.error is not None else episode_outcome(outcome.value)
                finally:
                    endpoint.end_episode(episode)
                    main.call_soon_threadsafe(queue.leave, episode.key)

        async def batch() -> list[Outcome]:
            gate = asyncio.Semaphore(gate_size)
            async with self._env.serving():
                return list(await asyncio.gather(*(one(gate, ep, dict(ex)) for ep, (_, ex) in zip(episodes, jobs))))

        runner = HarnessThread("tempering-verifiers")
        waves = math.ceil(len(jobs) / max(1, gate_size))
        limit = None if self.harness_timeout is None else self.harness_timeout * waves + 60.0
        try:
            outcomes = await guarded(runner.run(batch(), limit, "the verifiers batch"), self.path)
        finally:
            runner.close()
            os.environ.pop(var, None)
        if outcomes.error is not None:  # the batch itself failed (serving, a blocked loop): every episode with it
            return [(ep, outcomes) for ep in episodes]
        return list(zip(episodes, outcomes.value))


async def _timed(run: Any, timeout: float | None) -> Any:
    from tempering.plugins.samplers.agent import HarnessTimeout

    try:
        return await run
    except (TimeoutError, asyncio.TimeoutError):
        raise HarnessTimeout(f"the verifiers episode did not return within {timeout:g} s") from None


def episode_outcome(episode: Any) -> Outcome:
    """A verifiers ``Episode`` as the harness's outcome: the sum of its traces' rewards and
    their metrics, or its first error (with verifiers' traceback)."""
    errors = list(episode.errors) + [e for t in episode.traces for e in t.errors]
    if not episode.ok or (errors and not episode.traces):
        first = errors[0] if errors else None
        message = (
            f"verifiers: {first.type}: {first.message}" if first is not None else "verifiers: the episode is not ok"
        )
        return Outcome(error=message, cause="verifiers_error", traceback=getattr(first, "traceback", None))
    metrics: dict[str, float] = {}
    for trace in episode.traces:
        for name, value in trace.metrics.items():
            if value is not None:
                metrics[f"vf_{name}"] = metrics.get(f"vf_{name}", 0.0) + float(value)
    return Outcome(value={"reward": float(sum(t.reward for t in episode.traces)), "metrics": metrics})
