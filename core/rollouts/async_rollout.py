"""Asynchronous rollouts: sample and score groups *while* the trainer trains, with bounded staleness.

:class:`AsyncRollouts` owns a producer -- an asyncio event loop on a thread of its own -- that
keeps rolling out chunks of groups through the stage's sampler (single-turn completions or
multi-turn episodes: :mod:`tempering.rollouts.rollout`) with the newest sampler snapshot it may use. Up
to ``chunks_in_flight`` chunks run at once, so the rewards (or tool calls) of one chunk overlap
with the sampling of the next and with training. The trainer calls
:meth:`AsyncRollouts.next_batch` for each step and :meth:`AsyncRollouts.publish` with a fresh
sampler after each optimizer step.

Staleness. Batch ``b`` (the groups the trainer's ``b``-th loop step trains on) may only be
sampled with weights published after loop step ``b - k`` or later, ``k = max_steps_off_policy``.
A sample's staleness at training time is ``trainer optimizer step - policy_version``, the
version of its *oldest* turn for a multi-turn trajectory; the gate makes it at most ``k``
(optimizer steps never outnumber loop steps). ``k = 0`` is
synchronous on-policy training (the producer waits for the weights of the current step);
``k = 1`` samples batch ``b + 1`` while step ``b`` trains. ``fixed_staleness`` samples batch
``b`` with exactly the weights of step ``max(0, b - k)`` even when newer ones exist, so that
every batch is exactly ``k`` steps stale and a run is reproducible from its seed.

:meth:`next_batch` still checks each group against the bound, in case a sampler stamps an
older version than the gate expected (a sampler that failed to reload its weights): such a
group is never trained on; its prompt is re-sampled with the newest sampler, up to
``max_resamples`` times per slot, and counted. Groups within the bound are kept and corrected
by the loss (importance weights), never discarded.

Sampling clients. A backend with ``sampling_client()`` (the local backend; Tinker's
``save_weights_and_get_sampling_client``) returns a future of a client whose ``sample`` runs
concurrently with training and stamps the snapshot's ``policy_version``. Any other backend is
used as its own sampler: its ``sample`` is called from the producer thread (on the local
backend it then queues behind training calls, so only reward scoring overlaps).

Resuming. Groups are trained in the order they were planned (slot ``b * P + i`` is the
``i``-th group of batch ``b``), so after each batch :attr:`AsyncRollouts.position` is the
example-stream position just past it; a resumed stage restarts the producer there.
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from tempering.interfaces import Backend, Sampler, SamplingClient
from tempering.rollouts.data import ExampleStream
from tempering.rollouts.rollout import RolloutBatch
from tempering.rollouts.scoring import ScoreStats
from tempering.types import Group, SamplingParams

__all__ = ["AsyncRollouts", "RolloutBatch", "StalenessError", "sampler_of"]


class StalenessError(RuntimeError):
    """A slot's group stayed beyond the staleness bound after every allowed re-sample."""


@dataclass
class _Published:
    index: int  # loop steps completed when the snapshot was taken
    client: SamplingClient | Future[SamplingClient]


@dataclass
class _Slot:
    slot: int
    example: dict[str, Any]
    position_after: int  # stream position after this slot's example was taken
    attempts: int = 0
    reward_metrics: dict[str, float] = field(default_factory=dict)  # its chunk's, from a PolicyReward


def sampler_of(backend: Backend) -> Future[SamplingClient]:
    """A future of a sampler of the backend's current weights: ``backend.sampling_client()``
    when the backend has one, else the backend itself (which samples its live weights)."""
    make = getattr(backend, "sampling_client", None)
    if callable(make):
        return make()
    done: Future[SamplingClient] = Future()
    done.set_result(backend)
    return done


class AsyncRollouts:
    """A background producer of scored groups for an RL stage (see the module docstring).

    Args:
        backend: has ``step`` (the trainer's optimizer steps).
        stream: the examples; the producer takes from it (no one else may, once started).
        sampler: rolls out and scores a chunk (:class:`tempering.interfaces.Sampler`).
        group_size: samples per prompt.
        groups_per_batch: groups per trainer step (``P``).
        params: sampling settings; ``params.seed`` is replaced per call when ``seed`` is set.
        max_steps_off_policy: the staleness bound ``k`` (>= 0).
        groups_per_sample: prompts per sample call (a chunk; never spans two batches).
            Smaller chunks reach the reward sooner; larger ones sample more efficiently.
        fixed_staleness: sample batch ``b`` with exactly the weights of step ``max(0, b - k)``.
        first_batch: the index of the first batch to produce (the resumed step).
        last_batch: produce no batch with this index or later (the stage's ``steps``); None = no end.
        seed: per-call sampling seeds derived from it and the slot (reproducible sampling);
            ``None`` leaves ``params.seed`` as given.
        max_resamples: re-samples allowed per slot for a group found beyond the bound.
        chunks_in_flight: chunks rolled out concurrently (their sampling queues on the
            backend's sampler; their scoring and tool calls overlap).
    """

    def __init__(
        self,
        backend: Backend,
        stream: ExampleStream,
        sampler: Sampler,
        *,
        group_size: int,
        groups_per_batch: int,
        params: SamplingParams,
        max_steps_off_policy: int = 1,
        groups_per_sample: int = 0,
        fixed_staleness: bool = False,
        first_batch: int = 0,
        last_batch: int | None = None,
        seed: int | None = None,
        max_resamples: int = 2,
        chunks_in_flight: int = 2,
    ) -> None:
        if group_size < 1 or groups_per_batch < 1:
            raise ValueError(
                f"AsyncRollouts: group_size and groups_per_batch must be >= 1 ({group_size}, {groups_per_batch})"
            )
        if max_steps_off_policy < 0:
            raise ValueError(f"AsyncRollouts: max_steps_off_policy must be >= 0, got {max_steps_off_policy}")
        self.backend = backend
        self.stream = stream
        self.sampler = sampler
        self.group_size = group_size
        self.per_batch = groups_per_batch
        self.params = params
        self.k = max_steps_off_policy
        self.chunk = groups_per_sample if groups_per_sample > 0 else groups_per_batch
        self.fixed = fixed_staleness
        self.seed = seed
        self.max_resamples = max_resamples
        self.chunks_in_flight = max(1, int(chunks_in_flight))
        self.stats = ScoreStats()
        self.position = stream.position

        self._first_slot = first_batch * groups_per_batch
        self._end_slot = None if last_batch is None else last_batch * groups_per_batch
        self._next_slot = self._first_slot  # next slot the producer plans
        self._lock = threading.Lock()
        self._ready_cond = threading.Condition(self._lock)
        self._published: list[_Published] = []
        self._ready: dict[int, tuple[Group, _Slot]] = {}
        self._resample: collections.deque[_Slot] = collections.deque()
        self._error: BaseException | None = None
        self._closed = False
        self._counts: collections.Counter[str] = collections.Counter()  # resampled, sample_calls, ...
        # oldest publication index of each chunk planned but not yet given its sampler: under
        # fixed staleness that publication must outlive the planner running ahead of it
        self._unpicked: collections.Counter[int] = collections.Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._started = threading.Event()

    # ------------------------------------------------------------------ trainer side
    def start(self, sampler: SamplingClient | Future[SamplingClient], index: int | None = None) -> None:
        """Publish the first sampler (or a future of one) and start producing."""
        self.publish(sampler, index=self._first_slot // self.per_batch if index is None else index)
        self._thread = threading.Thread(target=self._run_loop, name="tempering-rollouts", daemon=True)
        self._thread.start()
        self._started.wait()

    def publish(self, sampler: SamplingClient | Future[SamplingClient], index: int) -> None:
        """Make a sampler of the weights after ``index`` loop steps available to the producer."""
        with self._lock:
            if self._published and index < self._published[-1].index:
                raise ValueError(f"AsyncRollouts.publish: index {index} is older than {self._published[-1].index}")
            self._published.append(_Published(index, sampler))
        self._notify()

    def next_batch(self, step: int, timeout: float | None = None) -> RolloutBatch:
        """Block until every group of batch ``step`` is sampled and scored; re-sample any that
        is beyond the staleness bound. Groups come back in slot order."""
        t0 = time.perf_counter()
        first = step * self.per_batch
        slots = range(first, first + self.per_batch)
        trainer_version = int(getattr(self.backend, "step", 0))
        resampled = 0
        out: dict[int, tuple[Group, _Slot]] = {}
        with self._ready_cond:
            pending = set(slots)
            while pending:
                self._raise_if_failed()
                for slot in sorted(pending):
                    if slot not in self._ready:
                        continue
                    group, info = self._ready.pop(slot)
                    staleness = trainer_version - min(s.policy_version for s in group.samples)
                    if staleness > self.k:
                        if info.attempts >= self.max_resamples:
                            raise StalenessError(
                                f"group for slot {slot} is {staleness} steps stale (bound {self.k}) after "
                                f"{info.attempts} re-samples: the sampler's weights are not being updated"
                            )
                        info.attempts += 1
                        resampled += 1
                        self._counts["resampled"] += 1
                        self._resample.append(info)
                        self._notify()
                        continue
                    out[slot] = (group, info)
                    pending.discard(slot)
                if pending:
                    left = None if timeout is None else timeout - (time.perf_counter() - t0)
                    if left is not None and left <= 0:
                        raise TimeoutError(
                            f"AsyncRollouts.next_batch({step}): {len(pending)} groups not ready after {timeout}s"
                        )
                    self._ready_cond.wait(0.1 if left is None else min(0.1, left))
            queued = sum(1 for s in self._ready if s >= first + self.per_batch)
        groups = [out[s][0] for s in slots]
        self.position = max([self.position] + [out[s][1].position_after for s in slots])
        versions = [s.policy_version for g in groups for s in g.samples]
        stale = [trainer_version - v for v in versions]
        metrics = {
            "offpolicy/staleness_mean": sum(stale) / max(len(stale), 1),
            "offpolicy/staleness_max": float(max(stale, default=0)),
            "offpolicy/staleness_min": float(min(stale, default=0)),
            "offpolicy/resampled": float(resampled),
            "offpolicy/resampled_total": float(self._counts["resampled"]),
            "offpolicy/queued_groups": float(queued),
            "time/wait_rollouts": time.perf_counter() - t0,
        }
        metrics.update(_slot_mean([out[s][1].reward_metrics for s in slots]))
        return RolloutBatch(groups, metrics)

    def close(self) -> None:
        """Stop producing (in-flight sample calls finish on their own) and join the thread."""
        self._closed = True
        self._notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ shared helpers
    def _notify(self) -> None:
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(wake.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"asynchronous rollouts failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

    def _fail(self, exc: BaseException) -> None:
        with self._ready_cond:
            if self._error is None:
                self._error = exc
            self._ready_cond.notify_all()

    # ------------------------------------------------------------------ producer side
    def _run_loop(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # noqa: BLE001 - surfaced by next_batch
            self._fail(exc)
        finally:
            self._started.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._started.set()
        running: set[asyncio.Task[None]] = set()
        try:
            while not self._closed:
                for task in [t for t in running if t.done()]:
                    running.discard(task)
                    task.result()  # a chunk that failed: surface its error
                if len(running) >= self.chunks_in_flight:
                    await asyncio.wait(running, timeout=0.1, return_when=asyncio.FIRST_COMPLETED)
                    continue
                planned = self._plan()
                if planned is None:
                    await self._wait()
                    continue
                running.add(asyncio.ensure_future(self._roll_out(*planned)))
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            runner = getattr(self.sampler, "reward_runner", None)
            if runner is not None:
                await runner.aclose()

    async def _wait(self) -> None:
        assert self._wake is not None
        try:
            await asyncio.wait_for(self._wake.wait(), 0.1)
        except asyncio.TimeoutError:
            pass
        self._wake.clear()

    def _plan(self) -> tuple[list[_Slot], int] | None:
        """The next chunk to sample: re-sample requests first, else new slots of one batch.
        Returns the slots and the oldest publication index they may use."""
        with self._lock:
            if self._resample:
                chunk = [self._resample.popleft()]
                while self._resample and len(chunk) < self.chunk:
                    chunk.append(self._resample.popleft())
                return chunk, -1  # -1: the newest sampler
            batch = self._next_slot // self.per_batch
            end = min(self._next_slot + self.chunk, (batch + 1) * self.per_batch)
            if (self._end_slot is not None and self._next_slot >= self._end_slot) or not self._may_sample(batch):
                return None
            out = []
            for slot in range(self._next_slot, end):
                (example,) = self.stream.take(1)
                out.append(_Slot(slot, example, self.stream.position))
            self._next_slot = end
            if self.fixed:
                self._unpicked[max(0, batch - self.k)] += 1
            return out, max(0, batch - self.k)

    def _may_sample(self, batch: int) -> bool:
        """Batch ``batch`` may be sampled once weights of loop step ``batch - k`` (or later) exist."""
        return bool(self._published) and self._published[-1].index >= max(0, batch - self.k)

    def _pick(self, min_index: int) -> _Published:
        """The sampler a chunk uses: the newest (or, with ``fixed_staleness``, the oldest one
        at or after ``min_index``; -1 asks for the newest). Publications no later chunk can
        use are then dropped, freeing their weight snapshots."""
        with self._lock:
            pubs = self._published
            if min_index < 0 or not self.fixed:
                chosen = pubs[-1]
            else:
                chosen = next(p for p in pubs if p.index >= min_index)
            if not self.fixed:
                del pubs[:-1]
            else:
                if min_index >= 0:
                    self._unpicked[min_index] -= 1
                    if self._unpicked[min_index] <= 0:
                        del self._unpicked[min_index]
                # the oldest index a chunk may still ask for: planned ones first (the planner can
                # be a chunk or more ahead of the rollouts), then the next one to be planned
                need = min([*self._unpicked, max(0, self._next_slot // self.per_batch - self.k)])
                first = next((i for i, p in enumerate(pubs) if p.index >= need), len(pubs) - 1)
                del pubs[:first]
            return chosen

    async def _roll_out(self, chunk: list[_Slot], min_index: int) -> None:
        """Roll out one chunk with the sampler it may use and hand its groups to the trainer."""
        pub = self._pick(min_index)
        if isinstance(pub.client, Future):
            pub.client = await asyncio.wrap_future(pub.client)
        params = self.params
        if self.seed is not None:
            params = replace(params, seed=(self.seed * 1_000_003 + chunk[0].slot * 7919 + chunk[0].attempts) % 2**31)
        rollout = await self.sampler.sample(
            pub.client, [dict(s.example) for s in chunk], self.group_size, params, chunk[0].slot
        )
        self._counts["sample_calls"] += 1
        self.stats.scored += rollout.stats.scored
        self.stats.failed += rollout.stats.failed
        self.stats.timeouts += rollout.stats.timeouts
        with self._ready_cond:
            for info, group in zip(chunk, rollout.groups):
                group.group_id = info.slot
                info.reward_metrics = rollout.stats.metrics
                self._ready[info.slot] = (group, info)
            self._ready_cond.notify_all()


def _slot_mean(per_slot: list[dict[str, float]]) -> dict[str, float]:
    """The reward's batch metrics of a step's slots (each its chunk's), averaged over the slots
    that have them: a chunk weighs as many groups as it rolled out."""
    keys = {k for m in per_slot for k in m}
    return {k: sum(m[k] for m in per_slot if k in m) / sum(k in m for m in per_slot) for k in sorted(keys)}
