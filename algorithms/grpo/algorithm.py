"""GRPO-style RLVR: sample a group per prompt, score with a verifiable reward, train on
group-relative advantages with a clipped policy-gradient loss."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from tempering.data import ExampleStream, load_examples
from tempering.evaluate import StageEvaluator
from tempering.progress import progress
from tempering.rollout import recompute_sampler_logprobs, sample_groups, score_groups, should_recompute
from tempering.scoring import RewardRunner
from tempering.errors import ConfigError
from tempering.stage import EvalConfig, OptimizerConfig, check_stage, sub_config
from tempering.types import Batch, Datum, Group, SamplingParams

from tempering.algorithms.grpo.advantages import zero_variance_groups
from tempering.algorithms.grpo.loss import k3_kl


@dataclass
class GRPO:
    """One optimizer step per batch of ``prompts_per_step x group_size`` on-policy samples.

    ``recompute_logprobs``: the ratio's "old" logprobs are the sampler's own when sampling was
    plain (temperature 1, no top-k/top-p), and a forward pass of the same weights otherwise
    (``auto``), because the sampler's logprobs are those of the tempered/filtered distribution
    while the trainer scores the untempered policy: using them would make an on-policy step
    look off-policy.
    """

    dataset: Any = field(default_factory=lambda: {"name": "arithmetic"})
    reward: Any = "exact_match"
    advantage: Any = "group_norm"
    loss: Any = "grpo"
    steps: int = 50
    prompts_per_step: int = 16
    group_size: int = 8
    max_tokens: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list = field(default_factory=list)  # type: ignore[type-arg]
    optimizer: Any = field(default_factory=lambda: {"learning_rate": 1e-4})
    drop_zero_variance: bool = False
    recompute_logprobs: str = "auto"  # auto | always | never
    reward_timeout: float = 60.0
    success_threshold: float = 1.0
    eval: Any = field(default_factory=dict)
    log_kl: bool = True  # log KL to the reference each step (one extra forward pass)
    #: KL reference: the policy as this stage began (after an SFT/DPO warmup: what TRL's
    #: ref_model would be) or the backend's base (LoRA adapter off / initial weights).
    reference: str = "stage_start"  # stage_start | base
    seed: int = 0

    def validate(self, ctx: Any) -> None:
        """Check every nested block before any stage trains."""
        if self.recompute_logprobs not in ("auto", "always", "never"):
            raise ConfigError(f"use auto, always or never (got '{self.recompute_logprobs}')", f"{ctx.path}.recompute_logprobs")
        if self.reference not in ("stage_start", "base"):
            raise ConfigError(f"use stage_start or base (got '{self.reference}')", f"{ctx.path}.reference")
        check_stage(ctx, self, ("reward", "advantage", "loss"))

    def run(self, ctx: Any) -> dict[str, Any]:
        path = ctx.path
        self.validate(ctx)
        opt = sub_config(OptimizerConfig, self.optimizer, f"{path}.optimizer")
        ev = sub_config(EvalConfig, self.eval, f"{path}.eval")
        reward = ctx.build("reward", self.reward, "reward")
        estimator = ctx.build("advantage", self.advantage, "advantage")
        loss = ctx.build("loss", self.loss, "loss")
        if getattr(loss, "max_completion_length", 0) is None:
            loss.max_completion_length = self.max_tokens  # Dr. GRPO's constant normaliser
        runner = RewardRunner(reward, timeout=self.reward_timeout)
        examples = load_examples(ctx, self.dataset, "dataset")
        state = ctx.resume_state or {}
        stream = ExampleStream(examples, seed=self.seed + ctx.seed, position=int(state.get("position", 0)))
        start = int(state.get("step", 0))
        evaluator = StageEvaluator(ctx, ev)
        sampling = SamplingParams(self.max_tokens, self.temperature, self.top_p, self.top_k, list(self.stop))
        recompute = should_recompute(self.recompute_logprobs, sampling)
        if self.reference == "stage_start" and not hasattr(ctx.backend, "snapshot"):
            warnings.warn(f"{path}.reference: this backend cannot snapshot weights; using its base as the "
                          "KL reference", RuntimeWarning, stacklevel=2)
            self.reference = "base"
        if start == 0 and self.reference == "stage_start" and (getattr(loss, "beta", 0.0) or self.log_kl):
            ctx.backend.snapshot(self._ref_name(ctx)).result()  # saved in checkpoints: resume keeps it
        last: dict[str, Any] = {}
        if start == 0 and (first := evaluator.run(at_start=True)):
            ctx.log(first)
            last.update(first)
        bar = progress(self.steps, f"{ctx.stage_id} (grpo)", initial=start)
        for step in range(start, self.steps):
            if not ctx.budget_left():
                break
            metrics = self._step(ctx, stream, runner, estimator, loss, sampling, recompute, opt.adam(step, self.steps))
            ctx.end_step({"step": step + 1, "position": stream.position})
            if ev.every and (step + 1) % ev.every == 0 and step + 1 < self.steps:
                metrics.update(evaluator.run())
            ctx.log(metrics)
            last.update(metrics)
            bar.update(1)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", acc=f"{metrics['accuracy']:.2f}")
        bar.close()
        if final := evaluator.run():
            ctx.log(final)
            last.update(final)
        keep = ("reward/mean", "accuracy", "loss", "kl", "kl_ref")
        return {k: v for k, v in last.items() if k in keep or k.startswith("eval/")}

    def _step(self, ctx: Any, stream: ExampleStream, runner: RewardRunner, estimator: Any, loss: Any,
              sampling: SamplingParams, recompute: bool, adam: Any) -> dict[str, Any]:
        backend = ctx.backend
        t0 = time.perf_counter()
        groups = sample_groups(backend, stream.take(self.prompts_per_step), self.group_size, sampling)
        t_sample = time.perf_counter() - t0
        stats = score_groups(runner, groups)
        t_reward = time.perf_counter() - t0 - t_sample
        batch, info = self.build_batch(groups, estimator)
        metrics: dict[str, Any] = {**info, **stats.as_metrics(), "sample_time": t_sample, "reward_time": t_reward}
        if batch is None:  # every group was dropped: nothing to learn from this batch
            metrics.update(loss=0.0, skipped=1.0, step_time=time.perf_counter() - t0)
            return metrics
        if recompute:
            recompute_sampler_logprobs(backend, batch)
        if getattr(loss, "beta", 0.0) or self.log_kl:
            if self.reference == "stage_start":
                ref = backend.logprobs(batch, weights=self._ref_name(ctx)).result()
            else:
                ref = backend.logprobs(batch, reference=True).result()
            for d, lp in zip(batch.data, ref):
                d.extra["ref_logprobs"] = list(lp)
            metrics["kl_ref"] = self._kl_to_reference(batch)
        t1 = time.perf_counter()
        fb = backend.forward_backward(batch, loss)
        op = backend.optim_step(adam)  # submitted back to back, awaited together
        metrics.update(fb.result())
        metrics.update(op.result())
        metrics["train_time"] = time.perf_counter() - t1
        metrics["step_time"] = time.perf_counter() - t0
        n_tokens = sum(len(s.completion.tokens) for g in groups for s in g.samples)
        metrics["tokens_per_s"] = n_tokens / metrics["step_time"]
        metrics["skipped"] = 0.0
        return metrics

    @staticmethod
    def _ref_name(ctx: Any) -> str:
        return f"reference/{ctx.stage_id}"

    @staticmethod
    def _kl_to_reference(batch: Batch) -> float:
        """Token-mean k3 estimate of KL(policy || reference) on the sampled tokens, from the
        behaviour logprobs: logged even when the loss has no KL term (``beta = 0``)."""
        t = batch.to_tensors()
        mask = t["weights"] > 0
        if not mask.any():
            return 0.0
        return float(k3_kl(t["sampler_logprobs"], t["ref_logprobs"], mask)[mask].mean())

    def build_batch(self, groups: list[Group], estimator: Any) -> tuple[Batch | None, dict[str, float]]:
        """Advantages over the non-failed samples, then one :class:`Datum` per sample
        (see :func:`build_group_batch`)."""
        return build_group_batch(groups, estimator, self.drop_zero_variance, self.success_threshold)


def build_group_batch(
    groups: list[Group], estimator: Any, drop_zero_variance: bool = False, success_threshold: float = 1.0
) -> tuple[Batch | None, dict[str, float]]:
    """Advantages over the non-failed samples, then one :class:`Datum` per sample.

    Failed samples and (optionally) zero-variance groups get weight 0: they stay visible
    in the metrics but do not move the policy. Shared with the off-policy stage.
    """
    samples = [s for g in groups for s in g.samples]
    gids = torch.tensor([g.group_id for g in groups for _ in g.samples])
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    valid = torch.tensor([not s.failed for s in samples])
    adv = torch.zeros_like(rewards)
    if valid.any():
        adv[valid] = estimator(rewards[valid], gids[valid]).float()
    zero_var = torch.zeros_like(valid)
    if valid.any():
        zero_var[valid] = zero_variance_groups(rewards[valid], gids[valid])
    keep = valid & ~zero_var if drop_zero_variance else valid
    lengths = [len(s.completion.tokens) for s in samples]
    ok = rewards[valid]
    info = {
        "reward/mean": float(ok.mean()) if len(ok) else 0.0,
        "reward/std": float(ok.std()) if len(ok) > 1 else 0.0,
        "accuracy": float((ok >= success_threshold - 1e-9).float().mean()) if len(ok) else 0.0,
        "groups/zero_variance_frac": float(zero_var[valid].float().mean()) if valid.any() else 0.0,
        "advantage/abs_mean": float(adv[keep].abs().mean()) if keep.any() else 0.0,
        "completion/mean_len": sum(lengths) / max(len(lengths), 1),
        "completion/stop_frac": sum(s.completion.stop_reason == "stop" for s in samples) / max(len(samples), 1),
    }
    if not keep.any():
        return None, info
    data = [
        Datum.from_completion(s.completion, advantage=float(a), weight=1.0 if k else 0.0)
        for s, a, k in zip(samples, adv.tolist(), keep.tolist())
    ]
    return Batch(data, meta={"num_groups": len(groups)}), info
