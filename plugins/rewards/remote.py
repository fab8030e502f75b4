"""A reward computed by an HTTP server (``tempering serve-reward MODULE:FUNC``).

Protocol (see :mod:`tempering.plugins.rewards.server`): ``POST {url}/score`` with
``{"samples": [{"completion": str, "example": {...}}, ...]}``; the reply is
``{"rewards": [float | null, ...], "errors": [str | null, ...], "infos": [{...}, ...],
"feedbacks": [str | null, ...]}`` with one entry per sample, so one bad sample fails alone;
``infos`` and ``feedbacks`` are optional. A sample's feedback comes back as the
``RewardResult.feedback`` the server's reward gave it (:mod:`tempering.rollouts.feedback`).

Each call retries connection errors, timeouts and 429/5xx with exponential backoff; at most
``concurrency`` requests are in flight; with ``batch_size > 1`` calls that arrive within
``batch_wait`` seconds of each other share one request. A sample the server could not score,
or a request that still fails after the retries, raises: the runner records a failure.

A server started with a token (``$TEMPERING_REWARD_TOKEN``) gets it back as
``Authorization: Bearer <token>``, read from the environment variable ``token_env`` names --
never from the recipe, whose resolved copy is written to ``run.json``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from tempering.interfaces import RewardResult
from tempering.plugins.rewards.common import (  # TOKEN_ENV: re-exported (defined beside the server's helpers)
    TOKEN_ENV,
    HTTPRewardError,
    LoopLocal,
    MicroBatcher,
    RewardError,
    post_json,
)
from tempering.schema import Problem, check_config_at, field_values


class RemoteRewardError(RewardError):
    """The server answered, but reported an error for this sample."""


class _LoopState:
    """What one event loop needs: an HTTP client and the request limit."""

    def __init__(self, concurrency: int, timeout: float | None) -> None:
        import httpx

        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self.client = httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)
        self.sem = asyncio.Semaphore(concurrency)


@dataclass
class RemoteReward:
    """Scores samples on a reward server at ``url`` (``http://host:port``; ``/score`` is
    appended unless the path already ends with it).

    ``timeout``: seconds per HTTP attempt; ``retries``: extra attempts after the first;
    ``backoff``: first retry delay, doubled each time up to ``backoff_max``; ``concurrency``:
    requests in flight; ``batch_size``: samples per request (1 = one request per sample);
    ``batch_wait``: how long a partial batch waits for more samples; ``token_env``: the
    environment variable whose value, if set, is sent as the bearer token (``""``: none). Mind
    the runner's own ``timeout`` (``reward_timeout``): it should exceed
    ``(retries + 1) * timeout`` plus backoff.
    """

    url: str
    timeout: float = 30.0
    retries: int = 3
    backoff: float = 0.2
    backoff_max: float = 5.0
    concurrency: int = 16
    batch_size: int = 1
    batch_wait: float = 0.01
    headers: dict = field(default_factory=dict)
    token_env: str = TOKEN_ENV

    @staticmethod
    def serve(target: str, **options: Any) -> None:
        """The other end: serve ``target`` (``MODULE:FUNC`` or a registered reward name) for
        remote rewards to call, until interrupted -- ``tempering serve-reward``, which finds it
        here through the registry (``options``: :func:`tempering.plugins.rewards.server.serve`'s)."""
        from tempering.plugins.rewards.server import serve  # lazy: a client never loads the server

        serve(target, **options)

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem]:
        """The URL's scheme and the counts' ranges (the registry's check before building;
        ``__post_init__`` runs it too, for a reward built in Python)."""
        url = config["url"]
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            yield Problem("url", f"expected http(s)://host:port, got {url!r}")
        for key, low in (("batch_size", 1), ("concurrency", 1), ("retries", 0)):
            if config[key] < low:
                yield Problem(key, f"must be >= {low}, got {config[key]}")

    def __post_init__(self) -> None:
        check_config_at(type(self), field_values(self), "remote")
        token = os.environ.get(self.token_env) if self.token_env else None
        # Not a dataclass field: stays out of repr() and of anything that prints the config.
        self._headers = {**dict(self.headers), **({"Authorization": f"Bearer {token.strip()}"} if token else {})}
        base = self.url.rstrip("/")
        self.endpoint = base if base.endswith("/score") else base + "/score"
        self._state: LoopLocal[_LoopState] = LoopLocal(lambda: _LoopState(self.concurrency, self.timeout))
        self._batcher = MicroBatcher(self._send, self.batch_size, self.batch_wait)
        self.requests = 0  # HTTP requests that got an answer (for tests and metrics)

    # ------------------------------------------------------------------ public
    async def __call__(self, completion: str, example: Mapping[str, Any]) -> Any:
        item = {"completion": completion, "example": dict(example)}
        if self.batch_size == 1:
            (result,) = await self._send([item])
            if isinstance(result, BaseException):
                raise result
        else:
            result = await self._batcher.submit(item)
        return _unwrap(result)

    async def score_many(self, items: list[tuple[str, Mapping[str, Any]]]) -> list[Any]:
        """Score many samples in requests of ``batch_size``; returns a reward or the exception
        per sample (nothing raises for a single bad sample)."""
        payload = [{"completion": c, "example": dict(e)} for c, e in items]
        chunks = [payload[i : i + self.batch_size] for i in range(0, len(payload), self.batch_size)]
        out: list[Any] = []
        for res in await asyncio.gather(*(self._send(c) for c in chunks), return_exceptions=True):
            if isinstance(res, BaseException):
                out += [res] * self.batch_size
            else:
                out += res
        out = out[: len(items)]
        return [r if isinstance(r, BaseException) else _try_unwrap(r) for r in out]

    async def aclose(self) -> None:
        """Close this event loop's HTTP client (the next call opens a new one)."""
        await self._batcher.drain()
        state = self._state.pop()
        if state is not None:
            await state.client.aclose()

    # ------------------------------------------------------------------ HTTP
    async def _send(self, items: list[dict[str, Any]]) -> list[Any]:
        """One request for ``items``; per-item results (``(reward, info)`` or an exception)."""
        state = self._state.get()
        async with state.sem:
            reply = await post_json(
                state.client,
                self.endpoint,
                {"samples": items},
                retries=self.retries,
                backoff=self.backoff,
                backoff_max=self.backoff_max,
                timeout=self.timeout,
                headers=self._headers,
                what="reward request",
            )
        self.requests += 1
        return _parse_reply(reply, len(items), self.endpoint)


def _parse_reply(reply: object, n: int, url: str) -> list[Any]:
    if not isinstance(reply, Mapping) or not isinstance(reply.get("rewards"), list):
        raise HTTPRewardError(f"{url} answered {str(reply)[:200]!r}, not {{'rewards': [...], 'errors': [...]}}")
    rewards = reply["rewards"]
    errors = reply.get("errors") or [None] * len(rewards)
    infos = reply.get("infos") or [{}] * len(rewards)
    feedbacks = reply.get("feedbacks") or [None] * len(rewards)
    if not (len(rewards) == len(errors) == n):
        raise HTTPRewardError(f"{url} returned {len(rewards)} rewards / {len(errors)} errors for {n} samples")
    out: list[Any] = []
    for r, e, i, f in zip(
        rewards, errors, list(infos) + [{}] * (n - len(infos)), list(feedbacks) + [None] * (n - len(feedbacks))
    ):
        if e is not None:
            out.append(RemoteRewardError(f"server: {e}"))
        elif r is None:
            out.append(RemoteRewardError("server returned no reward and no error for this sample"))
        else:
            out.append((r, i or {}, f))
    return out


def _unwrap(result: Any) -> Any:
    """A server's ``(reward, info, feedback)`` as the reward's return: a float when that is all
    there is, else a :class:`RewardResult` (feedback that is not text fails in the runner)."""
    if isinstance(result, BaseException):
        raise result
    reward, info, feedback = result
    return RewardResult(float(reward), dict(info), feedback) if info or feedback is not None else float(reward)


def _try_unwrap(result: object) -> Any:
    try:
        return _unwrap(result)
    except Exception as exc:  # noqa: BLE001
        return exc
