"""Run a CPU-heavy reward in worker processes, with a per-call timeout.

A sync reward runs inline in the training process and holds the GIL: a 50 ms checker over 64
samples is 3.2 s of wall clock. :class:`ProcessPoolReward` sends each call to a
``concurrent.futures.ProcessPoolExecutor`` instead; its ``__call__`` is ``async`` so the
:class:`~tempering.rollouts.scoring.RewardRunner` keeps ``workers`` calls in flight at once and can
stream results as they complete.

A call that exceeds ``timeout`` is a failure (:class:`RewardTimeout`, counted as a timeout).
Its worker may be stuck for good (an infinite loop), and a process pool cannot kill one worker:
the pool is *retired* -- later calls go to a fresh pool -- and its processes are killed as soon
as the calls still running on them have finished (those are not failed on its account).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import inspect
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from typing import Any

from tempering.plugins.rewards.common import LoopLocal, RewardError, RewardTimeout, resolve_reward
from tempering.schema import Problem, check_config_at, field_values

# ----------------------------------------------------------------------------- worker side
_WORKER_CACHE: dict[str, Any] = {}


def _worker_reward(key: str | None, spec: object, params: Mapping[str, Any]) -> Any:
    if key is None:  # a picklable callable, sent with each call
        return spec
    reward = _WORKER_CACHE.get(key)
    if reward is None:
        reward = _WORKER_CACHE[key] = resolve_reward(spec, params, path="process_pool.reward")
    return reward


def _call_in_worker(key: str | None, spec: object, params: Mapping[str, Any], completion: str, example: dict) -> Any:
    value = _worker_reward(key, spec, params)(completion, example)
    if inspect.isawaitable(value):  # an async reward in a worker: give it a loop of its own

        async def wait() -> Any:
            return await value

        value = asyncio.run(wait())
    return value


def _init_worker(ready: Any, key: str | None, spec: object, params: Mapping[str, Any]) -> None:
    """Runs once in each new worker: import and build the reward, then say so. A build error
    is not raised here (it would break the whole pool): the first call raises it instead."""
    try:
        _worker_reward(key, spec, params)
    except BaseException:  # noqa: BLE001
        pass
    finally:
        ready.release()


def _noop() -> int:
    return os.getpid()


# ----------------------------------------------------------------------------- parent side
class _Pool:
    """One executor plus the bookkeeping needed to retire it safely.

    A new pool starts all its workers at once and builds the reward in each
    (:meth:`_start`, in a helper thread); calls wait for that (``ready``) before their
    timeout starts, so process start-up never counts against a call.
    """

    def __init__(
        self,
        workers: int,
        start_method: str,
        key: str | None,
        spec: object,
        params: Mapping[str, Any],
        startup_timeout: float,
    ) -> None:
        ctx = multiprocessing.get_context(start_method)
        self.workers = workers
        self._ready_sem = ctx.Semaphore(0)
        self.executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers,
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(self._ready_sem, key if isinstance(spec, (str, Mapping)) else None, spec, params),
        )
        self.active = 0  # calls submitted here that are neither finished nor given up on
        self.retired = False
        self.killed = False
        self.ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._startup_timeout = startup_timeout
        threading.Thread(target=self._start, name="process-pool-start", daemon=True).start()

    def _start(self) -> None:
        try:
            for _ in range(self.workers):  # each submit with no idle worker spawns one
                self.executor.submit(_noop)
            deadline = time.monotonic() + self._startup_timeout
            for _ in range(self.workers):
                if not self._ready_sem.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    raise RewardError(f"process_pool: workers did not start within {self._startup_timeout:.0f}s")
            self.ready.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiting calls
            self.ready.set_exception(exc if isinstance(exc, Exception) else RewardError(repr(exc)))

    def kill(self) -> None:
        if self.killed:
            return
        self.killed = True
        processes = list((getattr(self.executor, "_processes", None) or {}).values())
        for p in processes:  # a hung worker ignores shutdown(): kill it
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.executor.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            try:
                p.join(timeout=1.0)
            except Exception:  # noqa: BLE001
                pass

    def pids(self) -> list[int]:
        return sorted(p.pid for p in (getattr(self.executor, "_processes", None) or {}).values() if p.pid)


@dataclass
class ProcessPoolReward:
    """Runs ``reward`` in ``workers`` processes; each call must finish within ``timeout`` s.

    ``reward``: ``"module:func"`` (a class there is instantiated with ``params``), a registered
    reward name (built with ``params`` in each worker), or -- from Python -- any picklable
    callable (a module-level function). The reward must be importable in a fresh process
    (``start_method`` ``spawn`` or ``forkserver``): define it in a module, not in ``__main__``
    of an interactive session. ``workers`` 0 means one per CPU core. A new pool (the first,
    or one replacing a recycled pool) starts all workers and builds the reward in each before
    any call's ``timeout`` starts; ``startup_timeout`` bounds that.
    """

    reward: Any
    params: dict = field(default_factory=dict)
    workers: int = 0
    timeout: float = 30.0
    start_method: str = "spawn"
    startup_timeout: float = 120.0

    def __post_init__(self) -> None:
        if self.start_method not in multiprocessing.get_all_start_methods():
            raise ValueError(
                f"process_pool.start_method: '{self.start_method}' is not available here; "
                f"use one of {multiprocessing.get_all_start_methods()}"
            )
        if self.timeout is not None and self.timeout <= 0:
            raise ValueError("process_pool.timeout must be > 0")
        self.workers = int(self.workers) or (os.cpu_count() or 1)
        check_config_at(type(self), field_values(self), "process_pool")
        if isinstance(self.reward, (str, Mapping)):
            self._key: str | None = json.dumps([self.reward, self.params], sort_keys=True, default=str)
            self._spec: Any = dict(self.reward) if isinstance(self.reward, Mapping) else self.reward
        elif callable(self.reward):
            if self.params:
                raise ValueError("process_pool: 'params' only apply to a reward given by name or 'module:attr'")
            self._key, self._spec = None, self.reward
        else:
            raise TypeError(f"process_pool.reward: expected a name, 'module:func' or a callable, got {self.reward!r}")
        self.__name__ = f"process_pool({self._label()})"
        self.max_concurrency = self.workers  # read by RewardRunner: its timeout then excludes queueing
        self._pool: _Pool | None = None
        self._lock = threading.Lock()
        self._slots: LoopLocal[asyncio.Semaphore] = LoopLocal(lambda: asyncio.Semaphore(self.workers))
        self.recycled = 0  # pools retired because a call timed out or the pool broke

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem]:
        """Before anything trains (the registry's check; ``__post_init__`` runs it too): a
        ``"module:attr"`` target's module must exist -- else every call would fail in its
        worker. A registered ``"dist:name"`` reward is fine too."""
        reward = config["reward"]
        if not isinstance(reward, str) or ":" not in reward:
            return
        module = reward.partition(":")[0]
        try:
            if importlib.util.find_spec(module) is not None:
                return
        except (ImportError, ValueError):
            pass
        from tempering.errors import UnknownComponentError
        from tempering.registry import get_registry

        try:
            get_registry().get("reward", reward)
        except UnknownComponentError:
            yield Problem(
                "reward",
                f"cannot import module '{module}' (of '{reward}') and no reward is registered under that "
                "name; check the module's name and that it is installed",
            )

    def _label(self) -> str:
        if isinstance(self.reward, str):
            return self.reward
        if isinstance(self.reward, Mapping):
            return str(self.reward.get("name"))
        return getattr(self.reward, "__qualname__", None) or type(self.reward).__name__

    # ------------------------------------------------------------------ pool management
    def _acquire(self) -> _Pool:
        with self._lock:
            if self._pool is None:
                self._pool = _Pool(
                    self.workers, self.start_method, self._key, self._spec, self.params, self.startup_timeout
                )
            self._pool.active += 1
            return self._pool

    def _release(self, pool: _Pool) -> None:
        with self._lock:
            pool.active -= 1
            kill = pool.retired and pool.active == 0
        if kill:
            pool.kill()

    def _retire(self, pool: _Pool) -> None:
        with self._lock:
            if pool.retired:
                return
            pool.retired = True
            self.recycled += 1
            if self._pool is pool:
                self._pool = None

    def start(self) -> list[int]:
        """Start every worker now and build the reward in each (otherwise the first call
        does). Returns the worker pids."""
        pool = self._acquire()
        try:
            pool.ready.result()
            return pool.pids()
        except Exception:
            self._retire(pool)
            raise
        finally:
            self._release(pool)

    def close(self) -> None:
        """Stop the workers. The reward stays usable: a later call starts a new pool."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.retired = True
            pool.kill()

    def __enter__(self) -> ProcessPoolReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:  # picklable as a config, without its pool
        return {
            k: getattr(self, k) for k in ("reward", "params", "workers", "timeout", "start_method", "startup_timeout")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    # ------------------------------------------------------------------ calls
    async def __call__(self, completion: str, example: Mapping[str, Any]) -> Any:
        async with self._slots.get():  # queue here, so the timeout below measures run time
            pool = self._acquire()
            try:
                try:
                    await asyncio.wrap_future(pool.ready)  # start-up is not part of the timeout
                    fut = pool.executor.submit(
                        _call_in_worker, self._key, self._spec, self.params, completion, dict(example)
                    )
                except (BrokenProcessPool, RuntimeError, RewardError) as exc:  # broken or shut down under us
                    self._retire(pool)
                    raise RewardError(f"{self.__name__}: worker pool unavailable ({exc}); it was recycled") from exc
                try:
                    return await asyncio.wait_for(asyncio.wrap_future(fut), self.timeout)
                except asyncio.TimeoutError:
                    self._retire(pool)  # the worker may never come back
                    raise RewardTimeout(
                        f"{self.__name__}: call took longer than {self.timeout}s; its worker pool was recycled"
                    ) from None
                except BrokenProcessPool as exc:  # a worker died (segfault, os._exit, OOM kill)
                    self._retire(pool)
                    raise RewardError(f"{self.__name__}: a worker process died ({exc}); the pool was recycled") from exc
            finally:
                self._release(pool)
