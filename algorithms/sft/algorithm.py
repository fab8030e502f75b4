"""SFT stage: teacher-forced cross-entropy on (prompt, answer) rows."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tempering.data import ExampleStream, encode_completion, encode_prompt, load_examples
from tempering.errors import ConfigError
from tempering.evaluate import StageEvaluator
from tempering.progress import progress
from tempering.stage import EvalConfig, OptimizerConfig, check_stage, sub_config
from tempering.types import Batch, Datum


def sft_datum(prompt: list[int], completion: list[int], weight: float) -> Datum:
    tokens = prompt + completion
    n_prompt = len(prompt) - 1
    return Datum(tokens[:-1], tokens[1:], [0.0] * n_prompt + [weight] * len(completion))


@dataclass
class SFT:
    """Train on ``dataset`` rows' ``prompt`` -> ``completion_key`` (token-mean cross-entropy)."""

    dataset: Any = field(default_factory=lambda: {"name": "arithmetic"})
    completion_key: str = "answer"
    steps: int = 100
    batch_size: int = 64
    optimizer: Any = field(default_factory=lambda: {"learning_rate": 1e-3})
    loss: Any = "cross_entropy"
    eval: Any = field(default_factory=dict)
    seed: int = 0

    def validate(self, ctx: Any) -> None:
        """Check every nested block before any stage trains."""
        check_stage(ctx, self)

    def run(self, ctx: Any) -> dict[str, Any]:
        path = ctx.path
        opt = sub_config(OptimizerConfig, self.optimizer, f"{path}.optimizer")
        ev = sub_config(EvalConfig, self.eval, f"{path}.eval")
        loss = ctx.build("loss", self.loss, "loss")
        examples = load_examples(ctx, self.dataset, "dataset")
        missing = [e for e in examples[:1] if self.completion_key not in e]
        if missing:
            raise ConfigError(f"rows have no '{self.completion_key}' (keys: {sorted(missing[0])})", f"{path}.completion_key")
        state = ctx.resume_state or {}
        stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))
        start = int(state.get("step", 0))
        evaluator = StageEvaluator(ctx, ev)
        tok = ctx.backend.tokenizer
        last: dict[str, Any] = {}
        if start == 0 and (first := evaluator.run(at_start=True)):
            ctx.log(first)
            last.update(first)
        bar = progress(self.steps, f"{ctx.stage_id} (sft)", initial=start)
        for step in range(start, self.steps):
            if not ctx.budget_left():
                break
            t0 = time.perf_counter()
            rows = stream.take(self.batch_size)
            pairs = [(encode_prompt(tok, r), encode_completion(tok, str(r[self.completion_key]))) for r in rows]
            n_tokens = sum(len(c) for _, c in pairs)
            batch = Batch([sft_datum(p, c, 1.0 / n_tokens) for p, c in pairs])
            fb = ctx.backend.forward_backward(batch, loss)
            op = ctx.backend.optim_step(opt.adam(step, self.steps))
            metrics = {**fb.result(), **op.result()}
            metrics.update(step_time=time.perf_counter() - t0, tokens=n_tokens)
            metrics["tokens_per_s"] = n_tokens / metrics["step_time"]
            ctx.end_step({"step": step + 1, "position": stream.position})
            if ev.every and (step + 1) % ev.every == 0 and step + 1 < self.steps:
                metrics.update(evaluator.run())
            ctx.log(metrics)
            last.update(metrics)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}")
        bar.close()
        last.update(evaluator.run())
        if "eval/accuracy" in last:
            ctx.log({k: v for k, v in last.items() if k.startswith("eval/")})
        return {k: v for k, v in last.items() if k in ("loss", "nll") or k.startswith("eval/")}
