"""Running episodes: the loop between a model, a renderer and an environment.

:func:`run_episode` plays one episode -- reset, then render / sample / parse / step until the
environment is done or a limit is hit -- and returns its :class:`~tempering.rollouts.trajectory.Trajectory`
(token-exact rows built by appending). It never raises for the environment's sake: an
environment that raises ends the episode as ``error`` with the text kept, and ``cleanup`` runs
in every case.

:class:`ModelQueue` lets many episodes share one model efficiently. Each episode simply awaits
``queue.sample(prompt)``; the queue gathers the requests of concurrent episodes into one
batched ``sample`` call (one ``generate`` on the local backend). By default it sends a batch
once *every* live episode is waiting for the model (lockstep: reproducible, since the batch's
make-up does not depend on timing); ``batch_wait`` seconds instead bound how long a request
waits for the others, so one slow tool does not hold everyone up.

:class:`EnvironmentCalls` runs an episode's environment code (``reset``, ``step``,
``cleanup``, the group score) on an event loop of its own, in a daemon thread, each call bounded
by ``env_timeout`` (the sampler's key). Why off the sampler's loop: an environment that blocks
(a synchronous ``time.sleep``, a subprocess ``wait`` inside ``async def step``) would freeze
the loop the model queue and every other episode run on -- no timeout could fire and the run
would hang at 0% forever. On its own loop it blocks only its own episode, which fails as a
counted ``env_timeout`` naming the key once the limit passes.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tempering.rollouts.chat import ParsedResponse, assign_call_ids, check_messages
from tempering.rollouts.feedback import feedback_of
from tempering.rollouts.loop_thread import LoopThread
from tempering.rollouts.trajectory import Trajectory, TrajectoryBuilder, Turn
from tempering.runs.failures import debug, format_traceback
from tempering.types import Completion, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import SamplingClient
    from tempering.rollouts.renderer import Renderer

LIMIT_ACTIONS = ("zero", "mask")
#: The parse error of a turn the token limit cut before its stop token (environments may treat
#: it apart from a malformed turn: the ``openenv`` environment's ``cut_turn``).
CUT_TURN = "the turn hit the token limit before its stop token"


@dataclass
class EpisodeLimits:
    """Per-episode limits and what reaching them does.

    ``max_turns``: model turns at most. ``max_total_tokens``: the context budget, prompt and
    everything since included (0 = none); a turn may not sample past it. ``tool_timeout``:
    seconds per tool call unless the environment sets its own. ``on_max_turns`` /
    ``on_context_limit``: ``zero`` (the episode is trained with reward 0) or ``mask`` (it is
    kept out of the loss and the advantages, like a failure, but counted apart).
    ``env_timeout``: seconds per environment call (reset, step, cleanup, group score; None = no
    limit); ``env_timeout_key``: its config key, named in the failure's message.
    """

    max_turns: int = 8
    max_total_tokens: int = 0
    tool_timeout: float | None = 30.0
    on_max_turns: str = "zero"
    on_context_limit: str = "zero"
    env_timeout: float | None = 600.0
    env_timeout_key: str = "sampler.env_timeout"


class EnvironmentTimeout(Exception):
    """An environment call did not return within ``env_timeout`` (the failure cause ``env_timeout``)."""


class EnvironmentCalls:
    """One episode's environment calls, on an event loop of its own in a daemon thread (see the
    module docs). Calls are awaited from the sampler's loop with the timeout; a call that times
    out is cancelled (an ``await`` that never finishes ends there; code that blocks its thread
    cannot be stopped, so its thread is left behind, like a timed-out sync tool's).
    """

    def __init__(self, timeout: float | None, key: str) -> None:
        self.timeout, self.key = timeout, key
        self.stuck = False  # a timed-out call still holds the loop: later calls would only wait too
        self.worker = LoopThread("tempering-environment")

    async def call(self, what: str, fn: Callable[..., Any], *args: object) -> Any:
        """``await fn(*args)`` (or its plain value) on the episode's loop, within the timeout;
        :class:`EnvironmentTimeout` past it, naming ``what`` and the key."""
        if self.stuck:
            raise EnvironmentTimeout(
                f"environment.{what}() was not called: an earlier call still blocks "
                f"the episode ({self.key}={self.timeout:g})"
            )

        async def run() -> Any:
            value = fn(*args)
            return await value if inspect.isawaitable(value) else value

        done = self.worker.submit(run())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(done), self.timeout)
        except TimeoutError:
            done.cancel()
            await asyncio.sleep(0.05)  # a cancelled await ends at once; a blocked thread does not
            self.stuck = not done.done()
            raise EnvironmentTimeout(
                f"environment.{what}() did not return within {self.timeout:g} s ({self.key}; raise it for "
                f"slower environments, or set it to null for no limit)"
            ) from None

    def close(self) -> None:
        """Stop the loop (once the thread is free: a blocked one stops when its call returns)."""
        self.worker.close()


class ModelQueue:
    """Batches concurrent episodes' sample requests into shared ``client.sample`` calls.

    ``client`` is a backend or a sampling client (``sample(prompts, n, params) -> Future``).
    Each request may have its own token limit: a batch samples up to the largest and cuts
    each completion to its own (the first ``m`` tokens of a longer sample are a sample of
    ``m`` tokens). ``seed`` derives a per-call seed from the call's index, so that lockstep
    batching samples reproducibly.

    Episodes are known by key (:meth:`join`, :meth:`leave`; a request names its episode's key).
    Lockstep (``batch_wait`` None) sends a batch once every live episode waits for the model.
    ``lockstep_wait`` (seconds, None = no limit) bounds how long a batch waits for live
    episodes that have not asked: past it the batch goes without them, and they are left out
    of the lockstep until their next request -- so an episode whose own code hangs (an agent
    harness that never calls the model) holds the others once, for ``lockstep_wait``, never
    until its timeout.
    """

    def __init__(
        self,
        client: SamplingClient,
        params: SamplingParams,
        batch_wait: float | None = None,
        seed: int | None = None,
        lockstep_wait: float | None = None,
    ) -> None:
        self.client = client
        self.params = params
        self.batch_wait = batch_wait
        self.lockstep_wait = lockstep_wait
        self.seed = seed
        self.calls = 0
        self._live: set[int] = set()
        self._excused: set[int] = set()  # live episodes the lockstep no longer waits for
        self._waiting: dict[int, int] = {}  # episode key -> its requests pending or in flight
        self._pending: list[tuple[int, list[int], int, asyncio.Future[Completion]]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # the loop keeps only weak references to tasks

    @property
    def live(self) -> int:
        """How many episodes are live (joined, not left)."""
        return len(self._live)

    def join(self, *keys: int) -> None:
        """Count the episodes ``keys`` as live (before they start: no half batches)."""
        self._live.update(keys)

    def leave(self, key: int) -> None:
        """Episode ``key`` ended: batches stop waiting for it."""
        self._live.discard(key)
        self._excused.discard(key)
        self._maybe_flush()

    async def sample(self, key: int, prompt: list[int], max_tokens: int) -> Completion:
        """One completion of ``prompt`` for episode ``key`` (which also orders a batch's requests)."""
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self._excused.discard(key)  # asking again: back in the lockstep
        self._waiting[key] = self._waiting.get(key, 0) + 1
        self._pending.append((key, list(prompt), int(max_tokens), future))
        self._maybe_flush()
        return await future

    def _maybe_flush(self) -> None:
        if not self._pending:
            return
        if self._live - self._excused <= self._waiting.keys():  # every episode in the lockstep waits
            self._flush()
        elif self._timer is None:
            if self.batch_wait is not None:
                self._timer = asyncio.get_running_loop().call_later(self.batch_wait, self._flush)
            elif self.lockstep_wait is not None:
                self._timer = asyncio.get_running_loop().call_later(self.lockstep_wait, self._go_without_stragglers)

    def _go_without_stragglers(self) -> None:
        self._timer = None
        self._excused |= self._live - self._waiting.keys()
        self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._pending:
            return
        batch = sorted(self._pending, key=lambda r: r[0])
        self._pending = []
        task = asyncio.ensure_future(self._run(batch))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _done(self, key: int) -> None:
        left = self._waiting.pop(key) - 1
        if left:
            self._waiting[key] = left

    async def _run(self, batch: list[tuple[int, list[int], int, asyncio.Future[Completion]]]) -> None:
        params = replace(self.params, max_tokens=max(r[2] for r in batch))
        if self.seed is not None:
            params = replace(params, seed=(self.seed * 1_000_003 + self.calls * 7919) % 2**31)
        self.calls += 1
        try:
            out = await asyncio.wrap_future(self.client.sample([r[1] for r in batch], 1, params))
        except BaseException as exc:  # noqa: BLE001 - every waiting episode gets the error
            for *_, fut in batch:
                if not fut.done():
                    fut.set_exception(exc)
            return
        finally:
            for key, *_ in batch:
                self._done(key)
        for (_, _, limit, fut), (completion, *_) in zip(batch, out):
            if not fut.done():
                fut.set_result(_cut(completion, limit))


def _cut(c: Completion, limit: int) -> Completion:
    if len(c.tokens) <= limit:
        return c
    return replace(c, tokens=c.tokens[:limit], logprobs=c.logprobs[:limit], stop_reason="length", text="")


async def run_episode(
    env: Any,
    example: dict[str, Any],
    renderer: Renderer,
    queue: ModelQueue,
    key: int,
    limits: EpisodeLimits,
    max_tokens: int,
) -> tuple[Trajectory, float | None]:
    """Play one episode. Returns the trajectory and its reward: the sum of the environment's
    step rewards, or ``None`` when the final step left scoring to the stage's reward.

    The caller counts the episode in ``queue`` (:meth:`ModelQueue.join`) *before* any episode
    of the batch starts, so the first requests do not go out as a half batch; the episode
    leaves the queue when it ends.

    ``trajectory.stop`` is ``done``, ``max_turns``, ``context``, ``parse_error`` or ``error``;
    on ``error`` the first entry of ``trajectory.errors`` is the exception's text.
    ``trajectory.feedback`` collects, in order, each turn's error texts (failed tool calls) and
    ``StepResult.feedback``, then a line when the episode ran out of turns or context.
    """
    traj = Trajectory()
    builder = TrajectoryBuilder()
    total: float | None = 0.0
    calls = EnvironmentCalls(limits.env_timeout, limits.env_timeout_key)
    if getattr(env, "tool_timeout", None) is None:
        try:
            env.tool_timeout = limits.tool_timeout
        except AttributeError:  # a frozen or slotted environment keeps its own
            pass
    try:
        messages = check_messages(await calls.call("reset", env.reset, dict(example)), "environment.reset() returned")
        tools = [t.spec() for t in env.tools()]
        traj.messages, traj.tools = messages, tools
        traj.stop = "max_turns"
        for turn in range(limits.max_turns):
            prompt = renderer.render_prompt(model_view(env, messages), tools or None)
            builder.observe(prompt.tokens)
            room = max_tokens
            if limits.max_total_tokens:
                room = min(room, limits.max_total_tokens - builder.num_tokens)
                if room <= 0:
                    traj.stop = "context"
                    break
            completion = await queue.sample(key, prompt.tokens, room)
            builder.act(completion.tokens, completion.logprobs)
            if room < max_tokens and completion.stop_reason != "stop" and len(completion.tokens) >= room:
                traj.turns.append(Turn(len(prompt.tokens), completion, _parse(prompt, completion)))
                traj.stop = "context"  # the budget, not max_tokens, cut this turn
                break
            response = _parse(prompt, completion)
            assign_call_ids(response.tool_calls, turn)
            messages.append(response.to_message())
            result = await calls.call("step", env.step, response)
            traj.turns.append(
                Turn(
                    len(prompt.tokens), completion, response, list(result.messages), result.reward, dict(result.metrics)
                )
            )
            for k, v in result.metrics.items():
                traj.count(k, float(v))
            traj.errors += [e for e in result.errors if e][: max(0, 5 - len(traj.errors))]
            said = feedback_of(result, "environment.step()")
            traj.feedback += [e for e in result.errors if e] + ([said] if said and said not in result.errors else [])
            total = None if result.reward is None else (total or 0.0) + float(result.reward)
            messages += check_messages(result.messages, "environment.step() returned")
            if result.done:
                traj.stop = "parse_error" if response.parse_error is not None else "done"
                break
        if traj.stop == "max_turns":
            traj.feedback.append(f"no final answer within max_turns={limits.max_turns} turns")
        elif traj.stop == "context":
            traj.feedback.append(
                f"no final answer within the context budget (max_total_tokens={limits.max_total_tokens})"
            )
    except Exception as exc:  # an environment bug fails this episode, not the run
        if debug():
            raise  # TEMPERING_DEBUG: the first failure ends the run in its own traceback
        traj.stop = "error"
        traj.failure = "env_timeout" if isinstance(exc, EnvironmentTimeout) else "episode_error"
        traj.traceback = None if isinstance(exc, EnvironmentTimeout) else format_traceback(exc)
        traj.errors.insert(0, f"{type(exc).__name__}: {exc}")
    finally:
        queue.leave(key)
        try:
            await calls.call("cleanup", env.cleanup)
        except Exception as exc:  # noqa: BLE001 - counted and shown, never raised
            traj.count("cleanup_errors")
            traj.errors.append(f"cleanup: {type(exc).__name__}: {exc}")
        calls.close()
    traj.segments = builder.segments
    traj.count("turns", float(len(traj.turns)))
    traj.count("row_splits", float(builder.splits))
    return traj, total


def model_view(env: object, messages: list[Any]) -> list[Any]:
    """What the model sees of ``messages``: the environment's :meth:`~tempering.rollouts.environment.Environment.view`
    (on a copy, so a view cannot edit the history), or all of it."""
    view = getattr(env, "view", None)
    if view is None:
        return messages
    return check_messages(view([dict(m) for m in messages]), "environment.view() returned")


def _parse(prompt: Any, completion: Completion) -> ParsedResponse:
    """The renderer's parse, with a turn cut by the token limit always a parse error (its tool
    call or answer is incomplete even when the prefix happens to parse)."""
    try:
        response = prompt.parse(completion.tokens)
    except Exception as exc:  # noqa: BLE001 - a parser bug is a malformed turn, not a crash
        response = ParsedResponse(parse_error=f"{type(exc).__name__}: {exc}")
    if completion.stop_reason != "stop" and response.parse_error is None:
        response.parse_error = CUT_TURN
    return response
