"""Held-out evaluation: greedy (or sampled) completions scored by a reward."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tempering.data import encode_prompt
from tempering.scoring import RewardRunner
from tempering.types import Sample, SamplingParams


def evaluate(
    backend: Any,
    examples: Sequence[Mapping[str, Any]],
    reward: Callable[..., Any],
    max_tokens: int,
    temperature: float = 0.0,
    batch_size: int = 256,
    success_threshold: float = 1.0,
) -> dict[str, float]:
    """Mean reward and accuracy (share of rewards >= ``success_threshold``) on ``examples``."""
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    runner = RewardRunner(reward)
    rewards: list[float] = []
    failed = 0
    for start in range(0, len(examples), batch_size):
        chunk = [dict(e) for e in examples[start : start + batch_size]]
        prompts = [encode_prompt(backend.tokenizer, e) for e in chunk]
        completions = backend.sample(prompts, 1, params).result()
        samples = [Sample(example=e, completion=c[0]) for e, c in zip(chunk, completions)]
        stats = runner.score(samples)
        failed += stats.failed
        rewards += [s.reward for s in samples]
    n = max(len(rewards), 1)
    return {
        "eval/reward": sum(rewards) / n,
        "eval/accuracy": sum(r >= success_threshold - 1e-9 for r in rewards) / n,
        "eval/failed": float(failed),
        "eval/n": float(len(rewards)),
    }


class StageEvaluator:
    """A stage's held-out evaluation (:class:`tempering.stage.EvalConfig`), when configured."""

    def __init__(self, ctx: Any, cfg: Any) -> None:
        from tempering.data import load_examples

        self.ctx, self.cfg = ctx, cfg
        self.examples = load_examples(ctx, cfg.dataset, "eval.dataset") if cfg.dataset is not None else None
        self.reward = ctx.build("reward", cfg.reward, "eval.reward") if self.examples else None

    def run(self, at_start: bool = False) -> dict[str, float]:
        if not self.examples or (at_start and not self.cfg.at_start):
            return {}
        return evaluate(self.ctx.backend, self.examples, self.reward, self.cfg.max_tokens, self.cfg.temperature)
