"""A weighted sum of other rewards, each built through the registry by name/spec.

::

    reward:
      name: weighted
      rewards:
        - {name: exact_match, weight: 0.8}
        - {name: math_answer, weight: 0.2, abs_tol: 0.01}

If any component fails (raises, returns NaN/inf) the combination fails: a partial sum would be
a different reward, silently. The components' feedback is joined, one line per component that
said something, each led by its label (``exact_match: expected '42', got '41'``).

A component that samples the policy being trained (a
:class:`~tempering.interfaces.PolicyReward`, such as ``monitor``) makes the sum one too: the
batch is scored at once, that component with the batch's policy, the others sample by sample.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tempering.interfaces import BatchScores, Policy, PolicyReward, RewardResult
from tempering.plugins.rewards.common import RewardError, as_finite, info_of, is_async_callable, resolve_reward
from tempering.rollouts.feedback import feedback_of, join_feedback
from tempering.types import Sample


class WeightedReward:
    """``sum_i w_i * r_i`` (divided by ``sum_i w_i`` when ``normalize``); sync components only.
    Use :func:`weighted` to build one: it picks :class:`AsyncWeightedReward` when a component
    is async."""

    def __init__(self, components: list[tuple[str, Any, float]], normalize: bool = False) -> None:
        if not components:
            raise ValueError("weighted: 'rewards' is empty; list at least one {name: ..., weight: ...}")
        self.components = components
        self.normalize = normalize
        total = sum(w for _, _, w in components)
        if normalize and total == 0:
            raise ValueError("weighted: normalize=true needs weights that do not sum to 0")
        self._scale = 1.0 / total if normalize else 1.0
        hints = [getattr(r, "max_concurrency", None) for _, r, _ in components]
        limits = [h for h in hints if isinstance(h, int) and h > 0]
        self.max_concurrency = min(limits) if limits else None

    def _combine(self, values: list[Any]) -> RewardResult:
        parts: dict[str, float] = {}
        infos: dict[str, Any] = {}
        notes: list[str] = []
        total = 0.0
        for (name, _, weight), value in zip(self.components, values):
            if isinstance(value, BaseException):
                raise RewardError(f"weighted: component '{name}' failed: {type(value).__name__}: {value}") from value
            x = as_finite(value, f"weighted: component '{name}'")
            try:
                note = feedback_of(value, f"weighted: component '{name}'")
            except TypeError as exc:
                raise RewardError(str(exc)) from None
            parts[name] = x
            if part_info := info_of(value):
                infos[name] = part_info
            if note is not None:
                notes.append(f"{name}: {note}")
            total += weight * x
        info: dict[str, Any] = {"components": parts}
        if infos:
            info["infos"] = infos
        return RewardResult(total * self._scale, info, feedback=join_feedback(notes))

    def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        values: list[Any] = []
        for _name, reward, _ in self.components:
            try:
                value = reward(completion, example)
            except Exception as exc:  # noqa: BLE001 - reported with the component's name
                value = exc
            if inspect.isawaitable(value):
                if hasattr(value, "close"):
                    value.close()
                value = TypeError("returned an awaitable to a sync weighted reward")
            values.append(value)
        return self._combine(values)

    async def aclose(self) -> None:
        for _, reward, _ in self.components:
            close = getattr(reward, "aclose", None)
            if close is not None:
                out = close()
                if inspect.isawaitable(out):
                    await out


class AsyncWeightedReward(WeightedReward):
    """:class:`WeightedReward` with at least one async component: components run
    concurrently (sync ones inline), so the call's time is that of the slowest one."""

    async def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:  # type: ignore[override]
        async def one(reward: Any) -> Any:
            value = reward(completion, example)
            return await value if inspect.isawaitable(value) else value

        values = await asyncio.gather(*(one(r) for _, r, _ in self.components), return_exceptions=True)
        for v in values:
            if isinstance(v, asyncio.CancelledError):
                raise v
        return self._combine(list(values))


class PolicyWeightedReward(AsyncWeightedReward):
    """:class:`AsyncWeightedReward` with a component that samples the policy: scores whole
    batches (:class:`~tempering.interfaces.PolicyReward`). Each component scores the batch
    concurrently; a sample's sum fails if any of its components failed for it, and the policy
    components' batch metrics are the sum's."""

    async def score_batch(self, samples: Sequence[Sample], policy: Policy) -> BatchScores:
        async def one(reward: Callable[..., Any], s: Sample) -> Any:
            try:
                value = reward(s.completion.text, s.example)
                return await value if inspect.isawaitable(value) else value
            except Exception as exc:  # noqa: BLE001 - reported with the component's name
                return exc

        async def column(reward: Callable[..., Any]) -> tuple[list[Any], dict[str, float]]:
            if isinstance(reward, PolicyReward):
                try:
                    scored = await reward.score_batch(samples, policy)
                except Exception as exc:  # noqa: BLE001 - fails this component for every sample
                    return [exc] * len(samples), {}
                return list(scored.results), dict(scored.metrics)
            return list(await asyncio.gather(*(one(reward, s) for s in samples))), {}

        columns = await asyncio.gather(*(column(r) for _, r, _ in self.components))
        results: list[float | RewardResult | BaseException] = []
        for i in range(len(samples)):
            try:
                results.append(self._combine([values[i] for values, _ in columns]))
            except Exception as exc:  # noqa: BLE001 - this sample's sum fails, alone
                results.append(exc)
        metrics = {k: v for _, m in columns for k, v in m.items()}
        return BatchScores(results, metrics)


def _entry(i: int, entry: Any, path: str) -> tuple[str, Any, float]:
    """One ``rewards`` entry -> (label, reward, weight)."""
    where = f"{path}.rewards[{i}]"
    weight: Any = 1.0
    if isinstance(entry, Sequence) and not isinstance(entry, str) and len(entry) == 2:
        spec, weight = entry  # (spec_or_object, weight)
    elif isinstance(entry, Mapping) or type(entry).__module__.startswith("omegaconf"):
        from omegaconf import DictConfig, OmegaConf

        if isinstance(entry, DictConfig):
            entry = OmegaConf.to_container(entry, resolve=True)
        entry = dict(entry)
        weight = entry.pop("weight", 1.0)
        if "reward" in entry:
            spec = entry.pop("reward")
            if entry:
                raise ValueError(f"{where}: with 'reward:' give only 'weight' beside it (got {sorted(entry)})")
        elif "name" in entry:
            spec = entry
        else:
            raise ValueError(f"{where}: give 'name: <reward>' (plus its params) or 'reward: <spec>', and 'weight'")
    else:
        spec = entry
    try:
        weight = float(weight)
    except (TypeError, ValueError):
        raise ValueError(f"{where}.weight: expected a number, got {weight!r}") from None
    reward = resolve_reward(spec, path=where)
    if isinstance(spec, Mapping):
        label = str(spec.get("name"))
    elif isinstance(spec, str):
        label = spec
    else:
        label = getattr(reward, "__name__", None) or type(reward).__name__
    return label, reward, weight


def weighted(rewards: object, normalize: bool = False) -> WeightedReward:
    """Build a weighted combination. ``rewards`` entries: ``{name: ..., weight: w, <params>}``,
    ``{reward: <spec or object>, weight: w}``, ``[spec, w]`` or a bare spec (weight 1)."""
    if type(rewards).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        rewards = OmegaConf.to_container(rewards, resolve=True)
    if not isinstance(rewards, Sequence) or isinstance(rewards, str):
        raise ValueError("weighted.rewards: expected a list of {name: ..., weight: ...}")
    components: list[tuple[str, Any, float]] = []
    seen: dict[str, int] = {}
    for i, entry in enumerate(rewards):
        label, reward, weight = _entry(i, entry, "weighted")
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:
            label = f"{label}#{seen[label]}"
        components.append((label, reward, weight))
    cls: type[WeightedReward] = WeightedReward
    if any(isinstance(r, PolicyReward) for _, r, _ in components):
        cls = PolicyWeightedReward
    elif any(is_async_callable(r) for _, r, _ in components):
        cls = AsyncWeightedReward
    return cls(components, normalize=normalize)
