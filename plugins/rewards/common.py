"""Shared pieces of the built-in rewards: errors, number parsing, resolving a reward from a
spec, per-event-loop state and an HTTP POST with retries.

Public (no leading underscore): environments that score with a reward (``search``) and
third-party rewards use the same pieces rather than copies.

Nothing here imports httpx at module level: listing plugins must stay fast.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import math
import random
import re
import threading
import weakref
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any, Generic, TypeVar, cast

from tempering.interfaces import RewardResult
from tempering.rollouts.feedback import FEEDBACK_KEY

T = TypeVar("T")


# --------------------------------------------------------------------------- errors
class RewardError(Exception):
    """A reward could not score a sample. Raised (never turned into a 0) so that the runner
    records the sample as failed and masks it out of the loss."""


class RewardTimeout(RewardError, TimeoutError):
    """A reward call took longer than its timeout (counted in ``ScoreStats.timeouts``)."""


# --------------------------------------------------------------------------- numbers
# A number as written in model output: optional sign, thousands separators, decimals,
# an exponent, an optional "/denominator" and an optional percent sign. The look-behind keeps
# "x2" or "10-5" from yielding "2" / "-5" (a hyphen after a word character is not a sign).
NUMBER_RE = re.compile(
    r"""
    (?<![\w.])
    (?P<sign>[-+])?
    (?P<num>\d{1,3}(?:,\d{3})+(?![\d,])(?:\.\d+)? | \d+(?:\.\d+)? | \.\d+)
    (?P<exp>[eE][-+]?\d+)?
    (?:\s*/\s*(?P<den>\d+(?:\.\d+)?)(?![\d.]*/))?
    (?P<pct>\s*%)?
    """,
    re.VERBOSE,
)


class NumberToken:
    """One number found in text: its exact value (a :class:`~fractions.Fraction`), the text
    it came from and whether it carried a percent sign (``value`` is then the number before
    the sign: ``"50%"`` has value 50)."""

    __slots__ = ("text", "value", "percent", "start", "end")

    def __init__(self, text: str, value: Fraction, percent: bool, start: int, end: int) -> None:
        self.text, self.value, self.percent, self.start, self.end = text, value, percent, start, end

    def __repr__(self) -> str:
        return f"NumberToken({self.text!r}, {self.value}, percent={self.percent})"


def _token(m: re.Match[str]) -> NumberToken | None:
    num = m.group("num").replace(",", "")
    try:
        value = Fraction(num + (m.group("exp") or ""))
        if m.group("den") is not None:
            den = Fraction(m.group("den"))
            if den == 0:
                return None
            value /= den
    except (ValueError, ZeroDivisionError):
        return None
    if m.group("sign") == "-":
        value = -value
    return NumberToken(m.group(0).strip(), value, m.group("pct") is not None, m.start(), m.end())


def find_numbers(text: str) -> list[NumberToken]:
    """Every number in ``text``, in order (after normalising unicode minus signs)."""
    text = normalize_minus(text)
    return [t for m in NUMBER_RE.finditer(text) if (t := _token(m)) is not None]


def parse_number(text: str) -> NumberToken | None:
    """``text`` as one number if that is all it is (surrounding spaces, ``$`` and a final
    period allowed), else ``None``."""
    t = normalize_minus(text).strip().strip("$").strip()
    if t.endswith(".") and not t.endswith(".."):
        t = t[:-1].rstrip()
    m = NUMBER_RE.fullmatch(t)
    return _token(m) if m else None


def normalize_minus(text: str) -> str:
    return text.replace("\u2212", "-").replace("\u2013", "-").replace("\u2014", "-")


def as_finite(value: object, what: str) -> float:
    """``value`` (a number, :class:`RewardResult` or ``{"reward": ...}``) as a finite float,
    or a :class:`RewardError` naming ``what``. As strict as the reward runner
    (:func:`tempering.rollouts.scoring.reward_number`): ``"1.0"`` is not a number."""
    from tempering.rollouts.scoring import RewardValueError, reward_number

    if isinstance(value, RewardResult):
        value = value.reward
    elif isinstance(value, Mapping):
        value = value.get("reward")
    try:
        return reward_number(value)
    except RewardValueError as exc:
        raise RewardError(f"{what} {exc}") from None


def info_of(value: object) -> dict[str, Any]:
    """A reward return's diagnostics: a :class:`RewardResult`'s ``info``, or a mapping's keys
    but ``reward`` and ``feedback`` (as the reward runner reads them)."""
    if isinstance(value, RewardResult):
        return dict(value.info)
    if isinstance(value, Mapping):
        return {k: v for k, v in value.items() if k not in ("reward", FEEDBACK_KEY)}
    return {}


def json_safe(obj: object) -> Any:
    """``obj`` with what JSON cannot hold replaced: NaN/inf become ``None``, unknown objects
    their ``str``."""
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in obj]
    if isinstance(obj, Fraction):
        return float(obj)
    return str(obj)


# --------------------------------------------------------------------------- resolving rewards
def load_target(target: str) -> Any:
    """Import ``"module:attr"`` (``attr`` may be dotted)."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"'{target}' is not of the form module:attr")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def resolve_reward(spec: Any, params: Mapping[str, Any] | None = None, path: str = "reward") -> Callable[..., Any]:
    """A reward from ``spec``:

    * a class: instantiated with ``params``; any other callable: used as it is;
    * ``"module:attr"``: imported; a class is instantiated with ``params``;
    * a registered name (``"exact_match"``, or ``"dist:name"``) or a mapping
      ``{name: ..., <params>}``: built through the registry, like any component.
    """
    params = dict(params or {})
    if inspect.isclass(spec):
        return cast("Callable[..., Any]", spec(**params))
    if callable(spec) and not isinstance(spec, str):
        if params:
            raise ValueError(f"{path}: params are only allowed with a reward name or 'module:attr', not an object")
        return spec
    import_error: Exception | None = None
    if isinstance(spec, str) and ":" in spec:
        try:
            obj = load_target(spec)
        except (ImportError, AttributeError, ValueError) as exc:
            obj, import_error = None, exc  # maybe "dist:name": let the registry resolve it
        if obj is not None:
            if inspect.isclass(obj):
                return cast("Callable[..., Any]", obj(**params))
            if params:
                raise ValueError(f"{path}: '{spec}' is a function; params {sorted(params)} cannot be passed to it")
            if not callable(obj):
                raise TypeError(f"{path}: '{spec}' is a {type(obj).__name__}, not a reward function")
            return obj
    from tempering.errors import ConfigError, UnknownComponentError
    from tempering.registry import get_registry

    if isinstance(spec, str):
        spec = {"name": spec, **params} if params else spec
    elif params:
        spec = {**dict(spec), **params}
    try:
        return get_registry().build("reward", spec, path)
    except UnknownComponentError as exc:
        if import_error is None:
            raise
        raise ConfigError(
            f"'{spec}' is neither an importable module:attr ({type(import_error).__name__}: {import_error}) "
            f"nor a registered reward ({str(exc).splitlines()[0]})",
            path,
        ) from None


def reward_name(reward: object) -> str:
    name = getattr(reward, "__name__", None) or type(reward).__name__
    return str(name)


def is_async_callable(fn: object) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


# --------------------------------------------------------------------------- per-loop state
class LoopLocal(Generic[T]):
    """One value per running event loop, made by ``factory()`` on first use in that loop.

    asyncio objects (semaphores, HTTP connection pools) belong to the loop they were first
    used in; :meth:`RewardRunner.score` runs a fresh loop per batch, so a reward that keeps
    such objects across calls keeps one set per loop. Entries die with their loop.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._values: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        with self._lock:
            if loop not in self._values:
                self._values[loop] = self._factory()
            return self._values[loop]

    def pop(self) -> T | None:
        """Remove and return the current loop's value (``None`` if it has none)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        with self._lock:
            return self._values.pop(loop, None)


# --------------------------------------------------------------------------- HTTP
RETRY_STATUS = {408, 425, 429, 500, 502, 503, 504}


#: The environment variable holding the reward server's shared secret: read by the server
#: (:mod:`~tempering.plugins.rewards.server`) and the client (:mod:`~tempering.plugins.rewards.remote`).
TOKEN_ENV = "TEMPERING_REWARD_TOKEN"


class HTTPRewardError(RewardError):
    """An HTTP call behind a reward failed for good (after retries, or a non-retryable status)."""


async def post_json(
    client: Any,
    url: str,
    payload: object,
    *,
    retries: int,
    backoff: float,
    backoff_max: float,
    timeout: float | None,
    headers: Mapping[str, str] | None = None,
    what: str = "request",
) -> Any:
    """POST ``payload`` as JSON and return the decoded reply.

    Retries ``retries`` times on connection errors, timeouts and statuses 408/425/429/5xx,
    sleeping ``backoff * 2**attempt`` (capped at ``backoff_max``, with +-25 % jitter) between
    tries. Other 4xx statuses and undecodable replies fail at once.
    """
    import httpx

    body = json.dumps(payload, default=str).encode()
    hdrs = {"content-type": "application/json", **dict(headers or {})}
    last: str = ""
    for attempt in range(retries + 1):
        if attempt:
            delay = min(backoff_max, backoff * 2 ** (attempt - 1)) * random.uniform(0.75, 1.25)
            await asyncio.sleep(delay)
        try:
            resp = await client.post(url, content=body, headers=hdrs, timeout=timeout)
        except httpx.TimeoutException as exc:
            last = f"timed out after {timeout}s ({type(exc).__name__})"
            continue
        except httpx.TransportError as exc:
            last = f"{type(exc).__name__}: {exc}"
            continue
        if resp.status_code in RETRY_STATUS or resp.status_code >= 500:
            last = f"HTTP {resp.status_code}: {resp.text[:200]}"
            continue
        if resp.status_code >= 400:
            raise HTTPRewardError(f"{what} to {url} failed with HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json()
        except ValueError:
            raise HTTPRewardError(f"{what} to {url} returned non-JSON: {resp.text[:200]!r}") from None
    raise HTTPRewardError(f"{what} to {url} failed after {retries + 1} attempt(s): {last}")


# --------------------------------------------------------------------------- micro-batching
class _BatchState:
    def __init__(self) -> None:
        self.pending: list[tuple[Any, asyncio.Future[Any]]] = []
        self.handle: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task[None]] = set()


class MicroBatcher:
    """Groups single calls into batches: ``await submit(item)`` waits until ``batch_size``
    items are pending or ``batch_wait`` seconds have passed since the first, then
    ``await send(items)`` runs once for the batch and must return one result per item (an
    exception instance fails only its own item). State is kept per event loop."""

    def __init__(self, send: Callable[[list[Any]], Any], batch_size: int, batch_wait: float) -> None:
        self.send, self.batch_size, self.batch_wait = send, batch_size, batch_wait
        self._state: LoopLocal[_BatchState] = LoopLocal(_BatchState)

    async def submit(self, item: object) -> Any:
        state = self._state.get()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        state.pending.append((item, fut))
        if len(state.pending) >= self.batch_size:
            self._flush(state)
        elif state.handle is None:
            state.handle = loop.call_later(self.batch_wait, self._flush, state)
        result = await fut
        if isinstance(result, BaseException):
            raise result
        return result

    async def drain(self) -> None:
        """Send what is pending and wait for the batches in flight (this loop's)."""
        state = self._state.pop()
        if state is None:
            return
        self._flush(state)
        if state.tasks:
            await asyncio.gather(*state.tasks, return_exceptions=True)

    def _flush(self, state: _BatchState) -> None:
        if state.handle is not None:
            state.handle.cancel()
            state.handle = None
        while state.pending:
            batch, state.pending = state.pending[: self.batch_size], state.pending[self.batch_size :]
            task = asyncio.ensure_future(self._run(batch))
            state.tasks.add(task)
            task.add_done_callback(state.tasks.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future[Any]]]) -> None:
        live = [(item, f) for item, f in batch if not f.done()]  # callers that gave up are gone
        if not live:
            return
        try:
            results = list(await self.send([item for item, _ in live]))
            if len(results) != len(live):
                raise RewardError(f"batch of {len(live)} returned {len(results)} results")
        except Exception as exc:  # noqa: BLE001 - delivered to every caller of the batch
            results = [exc] * len(live)
        for (_, f), res in zip(live, results):
            if not f.done():
                f.set_result(res)
