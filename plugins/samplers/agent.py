"""The ``agent`` sampler: episodes played by the user's own harness, through the policy's endpoint.

A harness is an async function the user already has, written against the plain ``openai`` SDK::

    async def run(client: openai.AsyncOpenAI, example: dict) -> float | None | dict:
        ...  # any number of client.chat.completions.create(...) calls, tools, context edits
        return reward

named in the recipe by its import path (``sampler: {name: agent, harness: my_agent:run}``, the
working folder on ``sys.path``, as for the ``python`` reward). Each sample is one episode: the
harness gets a fresh client whose ``base_url`` is the episode's own address on the stage's
:class:`~tempering.plugins.samplers.openai_endpoint.PolicyEndpoint` and whose ``api_key`` is the
endpoint's token; the endpoint samples the stage's policy and records every call token-exactly.

Training rows are built from those calls (:func:`episode_rows`): a call whose prompt starts with
every token of an existing row (the previous prompt plus what was sampled) extends that row with
its new tokens (weight 0) and its completion (weight 1, with the sampler's logprobs); a call that
extends no row -- a harness that edited, summarized or truncated its context -- starts a new row,
as a renderer that rewrites history does for the ``environment`` sampler. Never a row with tokens
the model did not see.

What the harness returns is the episode's reward: a number (a
:class:`~tempering.rollouts.feedback.Scored` carries feedback), ``None`` to have the stage's
``reward`` score the last completion's text, or a mapping ``{"reward": ..., "metrics": {...},
"feedback": "..."}``. A harness that raises fails its episode (cause ``harness_error``, its
traceback in ``rollouts.jsonl``); one that does not return within ``harness_timeout`` seconds is
cut off (cause ``harness_timeout``); one that never called the model fails too
(``no_model_calls``): there is nothing to train. Each harness runs on an event loop of its own
in a daemon thread, so one that blocks (a synchronous ``time.sleep``, a subprocess ``wait``)
blocks only its own episode. ``max_concurrent`` bounds the episodes in flight.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import numbers
import ssl
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tempering.errors import ConfigError, UnknownComponentError
from tempering.plugins.samplers.common import with_stops
from tempering.plugins.samplers.openai_endpoint import (
    Call,
    EndpointLimits,
    EpisodeCalls,
    PolicyEndpoint,
    finish_reason,
)
from tempering.registry import get_registry
from tempering.rollouts.episode import ModelQueue
from tempering.rollouts.feedback import feedback_of
from tempering.rollouts.loop_thread import LoopThread
from tempering.rollouts.rollout import Rollout, SamplerContext
from tempering.rollouts.scoring import ScoreStats, reward_number
from tempering.rollouts.trajectory import Trajectory, Turn
from tempering.runs.failures import debug, format_traceback, mark_failed
from tempering.schema import Problem
from tempering.types import Completion, Group, Sample, SamplingParams, Segment

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import SamplingClient

#: ``pip install`` hint for the client the harness is given.
OPENAI_HINT = "pip install 'tempering[openai]'"


class HarnessTimeout(Exception):
    """A harness did not return within ``harness_timeout`` (failure cause ``harness_timeout``)."""


@dataclass
class Outcome:
    """How an episode's harness ended: its return ``value``, or the ``error`` text, failure
    ``cause`` and traceback."""

    value: Any = None
    error: str | None = None
    cause: str | None = None
    traceback: str | None = None


class HarnessThread(LoopThread):
    """The loop thread harness code runs on (:class:`~tempering.rollouts.loop_thread.LoopThread`),
    with a bounded wait: a harness that blocks cannot freeze the sampler's loop (which batches
    every episode's model calls), and one that hangs is cut off."""

    def __init__(self, name: str = "tempering-harness") -> None:
        super().__init__(name)

    async def run(self, coro: Coroutine[Any, Any, Any], timeout: float | None, what: str) -> Any:
        """``await coro`` on this thread's loop within ``timeout`` seconds (None = no limit);
        :class:`HarnessTimeout` naming ``what`` past it (the coroutine is cancelled)."""
        done = self.submit(coro)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), timeout)
        except (TimeoutError, asyncio.TimeoutError):
            done.cancel()
            raise HarnessTimeout(f"{what} did not return within {timeout:g} s") from None


def load_harness(target: object, path: str) -> Callable[..., Any]:
    """The harness ``target`` names: a registered harness (``register_harnesses``, an entry-point
    plugin's: ``name`` or ``dist:name``), ``module:function`` (imported with the working folder
    on ``sys.path``; tried first when that module exists), or a callable given from Python. Any
    failure is one :class:`ConfigError`."""
    if callable(target):
        return target
    from tempering.plugins.rewards.python import load_function

    module, sep, _ = target.partition(":") if isinstance(target, str) else ("", "", "")
    if isinstance(target, str) and not (sep and _importable(module)):
        registry = get_registry()
        try:
            found = registry.get("harness", target).load()
        except UnknownComponentError as exc:
            if not sep:  # not module:function either: one line, the registry's first and the known names
                known = ", ".join(registry.names("harness")) or "none"
                raise ConfigError(
                    f"{str(exc).splitlines()[0]} Registered harnesses: {known}; or give "
                    "'module:function', an async def run(client, example)",
                    path,
                ) from None
        else:
            if not callable(found):
                raise ConfigError(
                    f"the registered harness '{target}' is a {type(found).__name__}, not a function", path
                )
            return found
    fn = load_function(target, path)
    if not callable(fn):
        raise ConfigError(f"'{target}' is a {type(fn).__name__}, not a function", path)
    return fn


def _importable(module: str) -> bool:
    """Whether ``module`` can be found (the working folder included, as ``load_function`` looks)."""
    from tempering.plugins.rewards.python import working_folder_on_path

    working_folder_on_path()
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def openai_missing() -> bool:
    return importlib.util.find_spec("openai") is None


@dataclass
class EndpointSampler:
    """What the samplers that serve the policy as an endpoint share (``agent``, ``verifiers``):
    config keys ``harness_timeout`` (seconds per episode, default 600, null = no limit),
    ``max_concurrent`` (episodes in flight, default 64), ``max_total_tokens`` (a call's prompt
    plus completion, 0 = no budget; past it the endpoint answers ``context_length_exceeded``),
    ``max_n`` (the largest ``n`` a call may ask for), ``batch_wait`` (seconds a model call
    waits for other episodes' before its batch goes; null = lockstep, until every live episode
    waits) and ``lockstep_wait`` (in lockstep, seconds a batch waits for an episode that has not
    called before it goes without it, at most half of ``harness_timeout``; null = no limit),
    ``n_choices`` (``used``: of a call with ``n > 1`` only the choices a later call continued
    train; ``all``: every choice, with the episode's reward) and ``log_token_ids`` (each call's
    token ids and logprobs in ``rollouts.jsonl``'s ``calls``; off for long episodes, whose
    prompts repeat the history). A
    harness can always hang before its next call, and lockstep cannot tell a hang from slow
    harness code: without the bound one hung harness would hold every other episode's calls
    until all of them timed out.
    The stage's ``max_tokens`` caps each call, its ``temperature`` / ``top_p`` are the ones a
    call may ask for. A subclass plays the episodes (:meth:`play`)."""

    harness_timeout: float | None = 600.0
    max_concurrent: int = 64
    max_total_tokens: int = 0
    max_n: int = 8
    batch_wait: float | None = None
    lockstep_wait: float | None = 5.0
    n_choices: str = "used"
    log_token_ids: bool = True
    context: SamplerContext | None = field(default=None, repr=False)

    @staticmethod
    def limit_problems(config: Mapping[str, Any]) -> Any:
        for key in ("harness_timeout", "lockstep_wait"):
            timeout = config.get(key)
            if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
                yield Problem(key, f"must be > 0 (seconds) or null for no limit, got {timeout}")
        if config.get("n_choices", "used") not in N_CHOICES:
            yield Problem("n_choices", f"must be one of {', '.join(N_CHOICES)}, got {config.get('n_choices')!r}")
        for key, low in (("max_concurrent", 1), ("max_n", 1), ("max_total_tokens", 0)):
            value = config.get(key)
            if value is not None and value < low:
                yield Problem(key, f"must be >= {low}, got {value}")

    def __post_init__(self) -> None:
        self.path = self.context.path if self.context is not None else "sampler"
        self._warned_reward = False

    @property
    def reward_runner(self) -> Any:
        return self.context.reward if self.context is not None else None

    def straggler_wait(self) -> float | None:
        """How long a lockstep batch waits for an episode that has not called: ``lockstep_wait``,
        at most half of ``harness_timeout`` (so the others' calls go well before their own
        timeout)."""
        half = None if self.harness_timeout is None else self.harness_timeout / 2
        waits = [w for w in (self.lockstep_wait, half) if w]
        return min(waits) if waits else None

    # ------------------------------------------------------------------ sampling
    async def sample(
        self,
        client: SamplingClient,
        examples: list[dict[str, Any]],
        group_size: int,
        params: SamplingParams,
        first_id: int = 0,
    ) -> Rollout:
        assert self.context is not None, "AgentSampler needs its stage's context"
        renderer = self.context.renderer()
        params = with_stops(params, renderer.stop())
        queue = ModelQueue(client, params, self.batch_wait, seed=params.seed, lockstep_wait=self.straggler_wait())
        loop = asyncio.get_running_loop()

        def model(key: int, prompt: list[int], max_tokens: int) -> Future[Completion]:
            return asyncio.run_coroutine_threadsafe(queue.sample(key, prompt, max_tokens), loop)

        limits = EndpointLimits(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            max_total_tokens=self.max_total_tokens,
            max_n=self.max_n,
            timeout=self.harness_timeout,
            keys={k: f"{self.path}.{k}" for k in ("max_total_tokens", "max_n")}
            | {"temperature": "temperature", "top_p": "top_p", "timeout": f"{self.path}.harness_timeout"},
        )
        jobs = [(i * group_size + j, example) for i, example in enumerate(examples) for j in range(group_size)]
        t0 = time.perf_counter()
        with PolicyEndpoint(model, renderer, self.context.tokenizer, limits) as endpoint:
            played = await self.play(endpoint, queue, jobs)
        t1 = time.perf_counter()
        groups, to_score, calls = [], [], 0
        for i, example in enumerate(examples):
            samples = []
            for j in range(group_size):
                episode, outcome = played[i * group_size + j]
                calls += len(episode.calls)
                sample, by_stage = self._sample(example, episode.calls, outcome)
                samples.append(sample)
                if by_stage:
                    to_score.append(sample)
            groups.append(Group(dict(example), samples, group_id=first_id + i))
        stats = ScoreStats()
        if to_score:
            if self.context.reward is None:
                for s in to_score:
                    mark_failed(
                        s, "no_reward", "the harness returned None (score by the stage), and the stage has no reward"
                    )
            else:
                stats = await self.context.reward.ascore(to_score)
        metrics = {"time/episodes": t1 - t0, "time/reward": time.perf_counter() - t1, "env/model_calls": float(calls)}
        return Rollout(groups, stats, metrics)

    async def play(
        self, endpoint: PolicyEndpoint, queue: ModelQueue, jobs: Sequence[tuple[int, dict[str, Any]]]
    ) -> list[tuple[EpisodeCalls, Outcome]]:
        """Every job's episode on ``endpoint``: its calls and how it ended, in job order."""
        raise NotImplementedError

    # ------------------------------------------------------------------ results
    def _sample(self, example: dict[str, Any], calls: list[Call], outcome: Outcome) -> tuple[Sample, bool]:
        """The episode as a sample, and whether the stage's reward scores it (the harness
        returned None)."""
        traj = trajectory_of(calls, self.n_choices, self.log_token_ids)
        last = traj.turns[-1].completion if traj.turns else Completion([], [], [], "error")
        if traj.turns:
            last.text = traj.turns[-1].response.text
        sample = Sample(example=dict(example), completion=last, trajectory=traj)
        sample.reward_info = {"stop": traj.stop, "turns": len(traj.turns)}
        if outcome.error is not None:
            traj.stop, traj.failure, traj.traceback = "error", outcome.cause, outcome.traceback
            traj.errors.insert(0, outcome.error)
            mark_failed(sample, outcome.cause or "harness_error", outcome.error, outcome.traceback)
            return sample, False
        if not calls:
            traj.stop = "error"
            mark_failed(sample, "no_model_calls", "the harness returned without calling the model: nothing to train")
            return sample, False
        if not traj.segments:  # every call was an n > 1 call none of whose choices was continued
            sample.masked = True
        try:
            reward, metrics, note = read_result(outcome.value)
        except (TypeError, ValueError) as exc:  # RewardValueError (NaN, inf) says its own cause
            traj.stop = "error"
            mark_failed(sample, getattr(exc, "cause", "harness_error"), f"harness: {exc}")
            return sample, False
        for k, v in metrics.items():
            traj.count(k, v)
        if note:
            traj.feedback.append(note)
            sample.feedback = note
        if reward is None:
            return sample, True
        sample.reward = reward
        self._warn_reward_unused()
        return sample, False

    def _warn_reward_unused(self) -> None:
        key = self.context.reward_key if self.context is not None else None
        if key is None or self._warned_reward:
            return
        self._warned_reward = True
        warnings.warn(
            f"tempering: {key} is not used for the episodes whose harness returns a reward: the harness's number "
            f"wins. To score the last answer with {key}, return None from the harness; otherwise remove {key}",
            UserWarning,
            stacklevel=2,
        )


@dataclass
class AgentSampler(EndpointSampler):
    """Config keys: ``harness`` (required: an ``async def run(client, example)``, as a registered
    harness name -- a plugin's ``register_harnesses`` -- or ``module:function``), and the endpoint
    samplers' ``harness_timeout``, ``max_concurrent``, ``max_total_tokens``, ``max_n``,
    ``batch_wait`` (:class:`EndpointSampler`)."""

    harness: Any = None

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Any:
        if openai_missing():
            yield Problem(
                "",
                f"the agent sampler gives harnesses an openai.AsyncOpenAI client, and openai is not "
                f"installed: {OPENAI_HINT}",
            )
        yield from EndpointSampler.limit_problems(config)
        if config.get("harness") is None:
            yield Problem(
                "harness", "the agent sampler needs 'harness: module:function', an async def run(client, example)"
            )
            return
        try:
            fn = load_harness(config["harness"], "")
        except ConfigError as exc:
            yield Problem("harness", str(exc))
            return
        try:
            inspect.signature(fn).bind(None, None)
        except TypeError:
            yield Problem("harness", f"'{config['harness']}' must take (client, example)")
        except ValueError:  # no signature (a builtin): let the call decide
            pass

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.harness is None:
            raise ConfigError(
                "the agent sampler needs 'harness: module:function', an async def run(client, example)",
                f"{self.path}.harness",
            )
        self._harness = load_harness(self.harness, f"{self.path}.harness")

    async def play(
        self, endpoint: PolicyEndpoint, queue: ModelQueue, jobs: Sequence[tuple[int, dict[str, Any]]]
    ) -> list[tuple[EpisodeCalls, Outcome]]:
        """Every job's episode, at most ``max_concurrent`` at once, each harness on a loop of
        its own. An episode joins the model queue when it starts and leaves when it ends, so
        lockstep batching waits only for episodes in flight."""
        gate = asyncio.Semaphore(self.max_concurrent)

        async def one(key: int, example: dict[str, Any]) -> tuple[EpisodeCalls, Outcome]:
            async with gate:
                queue.join(key)
                episode = endpoint.open_episode(key)
                runner = HarnessThread()
                try:
                    coro = run_harness(
                        self._harness, episode.base_url, endpoint.token, dict(example), self.harness_timeout
                    )
                    outcome = await guarded(runner.run(coro, self.harness_timeout, "the harness"), self.path)
                finally:
                    endpoint.end_episode(episode)
                    queue.leave(key)
                    runner.close()
                return episode, outcome

        return list(await asyncio.gather(*(one(key, example) for key, example in jobs)))


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every episode's client. The endpoint is plain HTTP on loopback, but
    httpx builds a context (loading the CA bundle) for each new client unless given one: ~90 ms
    a client, which made client creation the slowest part of a batch of short episodes."""
    return ssl.create_default_context()


async def run_harness(harness: Any, base_url: str, token: str, example: dict[str, Any], timeout: float | None) -> Any:
    """One episode on the harness's loop: a fresh ``AsyncOpenAI`` client for the episode's
    address, the harness, the client closed after."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    http = DefaultAsyncHttpxClient(verify=_tls_context())
    client = AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0, timeout=timeout, http_client=http)
    try:
        value = harness(client, example)
        return await value if inspect.isawaitable(value) else value
    finally:
        await client.close()


async def guarded(run: Awaitable[Any], path: str) -> Outcome:
    """The outcome of a harness run: its value, or the failure it counts as (never raised,
    except under ``TEMPERING_DEBUG``)."""
    try:
        return Outcome(value=await run)
    except HarnessTimeout as exc:
        return Outcome(
            error=f"{exc} ({path}.harness_timeout; raise it for slower harnesses, or null for no limit)",
            cause="harness_timeout",
        )
    except Exception as exc:
        if debug():
            raise
        return Outcome(
            error=f"harness: {type(exc).__name__}: {exc}", cause="harness_error", traceback=format_traceback(exc)
        )


def read_result(value: object) -> tuple[float | None, dict[str, float], str | None]:
    """A harness's return value as ``(reward or None, metrics, feedback)``."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"reward", "metrics", "feedback"}
        if unknown:
            raise ValueError(f"returned a mapping with unknown keys {sorted(unknown)}; use reward, metrics, feedback")
        reward, note = read_result(value.get("reward"))[::2]
        metrics = {str(k): float(v) for k, v in dict(value.get("metrics") or {}).items()}
        feedback = value.get("feedback")
        return reward, metrics, str(feedback) if feedback else note
    if value is None:
        return None, {}, None
    if isinstance(value, (str, bytes)) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"returned a {type(value).__name__}; return a number, None (the stage's reward scores) or "
            "{'reward': ..., 'metrics': {...}, 'feedback': ...}"
        )
    return reward_number(value), {}, feedback_of(value, "the harness")


def episode_rows(calls: Sequence[Call]) -> tuple[list[Segment], int]:
    """Training rows of an episode's calls, in the order they were answered, and how many
    calls started a new row although rows existed (``row_splits``).

    A call extends the longest row whose tokens are a prefix of its prompt (weight 0 on the
    prompt's new tokens, weight 1 and the sampler's logprobs on its completion); a call that
    extends none starts a row of its own. Every sampled token is in exactly one row."""
    rows: list[Segment] = []
    splits = 0
    for call in calls:
        prompt = list(call.prompt)
        best = None
        for row in rows:
            n = len(row.tokens)
            if n <= len(prompt) and prompt[:n] == row.tokens and (best is None or n > len(best.tokens)):
                best = row
        if best is None:
            splits += bool(rows)
            best = Segment(prompt, [0.0] * len(prompt), [0.0] * len(prompt))
            rows.append(best)
        else:
            best.extend(prompt[len(best.tokens) :], 0.0)
        best.extend(list(call.completion.tokens), 1.0, list(call.completion.logprobs))
    return rows, splits


def call_record(call: Call, trained: bool, token_ids: bool = True) -> dict[str, Any]:
    """One model call as ``rollouts.jsonl`` keeps it (its ``calls`` field): the request's
    messages and tools (chat calls; None for text completions), what came back, whether it
    trained, and -- with ``token_ids`` -- the exact ids and the sampler's logprobs."""
    record: dict[str, Any] = {
        "messages": call.messages,
        "tools": call.tools,
        "completion": call.response.text if call.messages is not None else call.response.raw,
        "finish_reason": finish_reason(call.completion, call.response),
        "tool_calls": [c.to_openai() for c in call.response.tool_calls] or None,
        "n": call.choices,
        "trained": trained,
        "policy_version": call.completion.policy_version,
    }
    if token_ids:
        record.update(
            prompt_ids=list(call.prompt),
            completion_ids=list(call.completion.tokens),
            logprobs=list(call.completion.logprobs),
        )
    return record


#: ``n_choices``: which choices of an ``n > 1`` call train.
N_CHOICES = ("used", "all")


def used_calls(calls: Sequence[Call]) -> list[Call]:
    """The calls whose completion the harness used: every call of ``n: 1``, and each choice of
    an ``n > 1`` call that a later call continued (its prompt holds the choice's prompt and
    sampled tokens: the harness sent that choice back). A choice no later call continued --
    one the harness threw away, or any choice of the episode's last call -- cannot be told
    from a discarded one, so it is left out."""
    kept = []
    for i, call in enumerate(calls):
        seen = [*call.prompt, *call.completion.tokens]
        if call.choices <= 1 or any(later.prompt[: len(seen)] == seen for later in calls[i + 1 :]):
            kept.append(call)
    return kept


def trajectory_of(calls: Sequence[Call], n_choices: str = "used", token_ids: bool = True) -> Trajectory:
    """The episode as a :class:`~tempering.rollouts.trajectory.Trajectory`: one turn per call,
    the rows of :func:`episode_rows` (of :func:`used_calls` unless ``n_choices`` is ``all``;
    ``unused_choices`` counts the rest), the last chat call's transcript and tools, and every
    call as a record for the rollout log (:func:`call_record`)."""
    traj = Trajectory()
    trained = list(calls) if n_choices == "all" else used_calls(calls)
    traj.segments, splits = episode_rows(trained)
    kept = {id(c) for c in trained}
    traj.calls = [call_record(c, id(c) in kept, token_ids) for c in calls]
    if len(trained) < len(calls):
        traj.count("unused_choices", float(len(calls) - len(trained)))
    traj.turns = [Turn(len(c.prompt), c.completion, c.response) for c in calls]
    chats = [c for c in calls if c.messages is not None]
    if chats:
        traj.messages = [*chats[-1].messages, chats[-1].response.to_message()]  # type: ignore[misc]
        traj.tools = list(chats[-1].tools or [])
    traj.count("turns", float(len(calls)))
    traj.count("row_splits", float(splits))
    tool_calls = sum(len(c.response.tool_calls) for c in calls)
    if tool_calls:
        traj.count("tool_calls", float(tool_calls))
    errors = [c.response.parse_error for c in calls if c.response.parse_error and c.completion.stop_reason == "stop"]
    if errors:
        traj.count("parse_errors", float(len(errors)))
    return traj


__all__ = [
    "AgentSampler",
    "EndpointSampler",
    "Outcome",
    "call_record",
    "episode_rows",
    "read_result",
    "trajectory_of",
    "used_calls",
]
