"""One GRPO optimizer step: ours (``GRPO.train_step`` on ``LocalBackend``) vs ``trl.GRPOTrainer`` (TRL 1.16).

Both sides train the same tiny Llama (``tempering.plugins.models.tiny:tiny_llama``, default
sizes, seed 0; TRL loads it from a ``save_pretrained`` folder) on the same task: per optimizer
step ``--prompts`` arithmetic prompts x ``--group`` completions of at most ``--max-tokens``
tokens, sampled at temperature 1 with the transformers ``generate`` (no vLLM), scored by a Python
exact-match reward, group-normalised advantages, the clipped surrogate with ``loss_type=dapo``,
``beta=0`` (no reference model), AdamW (lr, betas 0.9/0.95, eps 1e-8, no weight decay, grad
clip 1.0, constant schedule), float32 on CPU, one process, ``torch.set_num_threads(1)``.

One optimizer step is, on both sides: generate ``prompts x group`` completions, score them,
compute advantages, one training forward + backward over all of them, clip, AdamW step. (TRL:
``per_device_train_batch_size = prompts x group``, ``gradient_accumulation_steps=1``, so
``steps_per_generation=1`` and ``generation_batch_size = prompts x group``; with
``num_iterations=1`` the step is on-policy and TRL skips the extra "old logprobs" forward. Ours:
temperature 1 with no top-k/top-p, so the sampler's logprobs are the old logprobs and there is no
recompute forward either.)

Measurements are interleaved in ONE run: ``trainer.train(max_steps=warmup + n)`` drives TRL,
and a ``TrainerCallback`` times each TRL step from ``on_step_begin`` to ``on_step_end``
(generation + rewards + loss + backward + clip + optimizer step + scheduler; not the data
loader fetch nor the logging that the Trainer does between steps, printed separately: ~2 ms)
and then runs and times our steps, so the sides alternate TRL, ours, TRL, ours, ... The first
``warmup`` steps of each side are discarded; medians and IQRs are over the rest, and the ratio
is given both of the medians and as the median of per-pair ratios.

Three columns for ours: ``ours`` is the like-for-like one (``log_kl=False``: at ``beta=0`` TRL
computes no reference logprobs either); ``ours default`` is the GRPO stage's defaults
(``log_kl=True, kl_every=10``: one no-grad forward every 10 steps to log the KL to the
stage-start policy); ``ours kl/step`` logs it every step (``kl_every=1``) (``--no-log-kl``
drops the last two). Steps are the stage's own ``train_step`` (the RL engine:
rollouts through the ``completion`` sampler, advantages, batch, training calls). TRL's ``GRPOConfig`` defaults to
``gradient_checkpointing=True`` (the forward is recomputed in backward); we never checkpoint, so
it is off here for the same compute (``--trl-gradient-checkpointing`` keeps TRL's default, which
makes TRL slower). The untrained model never answers correctly, so every reward is 0 and every
advantage 0; neither side skips such a batch (ours: ``drop_zero_variance=False``), so the
compute per step is the same as with reward spread.

"Model time" is measured by wrapping, in this script only, each model's ``generate`` and
``forward`` (forwards inside ``generate`` count as generate) and ``torch.Tensor.backward``;
"overhead" = step - (generate + forward + backward): everything a framework does around the
model (tokenising, decoding, rewards, advantages, batching/padding, logprob gathering and the
loss maths, optimizer step, bookkeeping). Our sampler-logprob recorder runs inside
``generate`` as a logits processor, so it counts as generate time.

Run: ``python benchmarks/grpo_step_vs_trl.py [--steps 10] [--warmup 3] [--prompts 16]
[--group 8] [--max-tokens 8] [--lr 1e-5] [--threads 1] [--no-log-kl]
[--trl-gradient-checkpointing] [--json out.json] [--model tiny_llama --model-kwargs JSON --device
cpu|cuda --dtype float32|bfloat16] [--lora RANK [--lora-alpha A]]`` (``--model`` and the three
after it change the model and where both sides run it: ``benchmarks/gpu_check.sh`` uses them for
a 1.5B-parameter model on a lent GPU; ``--model smollm2`` is the real SmolLM2-135M-Instruct, which
TRL loads from its cached converted folder; ``--lora`` trains the same peft ``LoraConfig`` --
rank, alpha, dropout 0, all linear layers -- on both sides, asserted by the trainable parameter
count). Ours renders the prompt text as it is (``renderer: raw``), as TRL gets it. The default run
takes about 40-70 s on 2 CPU cores (``import trl`` alone is ~11 s). The machine's load average
is printed at the start and the end: on a shared machine other processes slow both sides, which
makes the ratio noisier but not biased toward either side (they alternate step by step).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


# ---------------------------------------------------------------------------- instrumentation
@dataclass
class ModelTimer:
    """Seconds spent in one model's generate / forward and in backward, while ``active``."""

    generate: float = 0.0
    forward: float = 0.0
    backward: float = 0.0
    decode_steps: int = 0  # generate's new positions (padded width), summed over calls
    _in_generate: bool = False

    def reset(self) -> None:
        self.generate = self.forward = self.backward = 0.0
        self.decode_steps = 0

    @property
    def model(self) -> float:
        return self.generate + self.forward + self.backward


_ACTIVE: list[ModelTimer | None] = [None]  # whose step is running (backward is a global patch)


def instrument(model: Any, timer: ModelTimer) -> None:
    """Wrap ``model.generate`` and ``model.forward`` (on the instance) to add time to ``timer``."""
    gen, fwd = model.generate, model.forward

    @functools.wraps(gen)
    def generate(*args: Any, **kwargs: Any) -> Any:
        timer._in_generate = True
        t0 = time.perf_counter()
        try:
            out = gen(*args, **kwargs)
        finally:
            timer.generate += time.perf_counter() - t0
            timer._in_generate = False
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(out, torch.Tensor) and isinstance(ids, torch.Tensor):
            timer.decode_steps += out.shape[1] - ids.shape[1]
        return out

    @functools.wraps(fwd)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if timer._in_generate:
            return fwd(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fwd(*args, **kwargs)
        finally:
            timer.forward += time.perf_counter() - t0

    model.generate, model.forward = generate, forward


def instrument_engine(engine: Any, timer: ModelTimer) -> None:
    """Count the vLLM engine's ``sample`` (weight sync + generation) as generate time."""
    sample = engine.sample

    @functools.wraps(sample)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return sample(*args, **kwargs)
        finally:
            timer.generate += time.perf_counter() - t0

    engine.sample = timed


def patch_backward() -> None:
    orig = torch.Tensor.backward

    @functools.wraps(orig)
    def backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        timer = _ACTIVE[0]
        t0 = time.perf_counter()
        try:
            return orig(self, *args, **kwargs)
        finally:
            if timer is not None:
                timer.backward += time.perf_counter() - t0

    torch.Tensor.backward = backward  # type: ignore[method-assign]


@dataclass
class StepRecord:
    seconds: float
    generate: float
    forward: float
    backward: float
    optimizer: float
    tokens: int  # completion tokens kept (up to and including eos), all rows
    decode_steps: int  # generate's padded width (new positions per row)

    @property
    def overhead(self) -> float:
        return self.seconds - (self.generate + self.forward + self.backward)


# ---------------------------------------------------------------------------- the two sides
def lora_params(args: argparse.Namespace) -> dict[str, Any] | None:
    """Our backend's ``lora:`` block for ``--lora RANK`` (``None``: full fine-tuning). The
    backend turns it into ``peft.LoraConfig(r, lora_alpha, lora_dropout, target_modules,
    task_type="CAUSAL_LM")``: :func:`trl_peft_config` is the same config for TRL."""
    if not args.lora:
        return None
    return {
        "rank": args.lora,
        "alpha": args.lora_alpha or 2.0 * args.lora,
        "dropout": 0.0,
        "target_modules": "all-linear",
    }


def trl_peft_config(args: argparse.Namespace) -> Any:
    params = lora_params(args)
    if params is None:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=params["rank"],
        lora_alpha=params["alpha"],
        lora_dropout=params["dropout"],
        target_modules=params["target_modules"],
        task_type="CAUSAL_LM",
    )


def trainable_count(model: Any) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def exact_match(completion: str, answer: str) -> float:
    """The one reward both sides use (same as the ``exact_match`` component's defaults)."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


class Ours:
    """A GRPO stage's ``train_step`` on a LocalBackend, set up the way ``Stage.run`` sets it up."""

    def __init__(
        self, args: argparse.Namespace, examples: list[dict[str, Any]], out_dir: str, log_kl: bool, kl_every: int = 10
    ) -> None:
        from tempering.algorithms.grpo.algorithm import GRPO
        from tempering.plugins.backends.local.backend import LocalBackend
        from tempering.registry import get_registry
        from tempering.training.recipe import RunContext
        from tempering.training.stage import OptimizerConfig

        registry = get_registry()
        self.backend = LocalBackend(
            model=args.model,
            model_kwargs=args.model_kwargs,
            seed=0,
            num_threads=args.threads,
            device=args.device,
            dtype=args.dtype,
            lora=lora_params(args),
            engine=args.engine,
            vllm=args.vllm,
        )
        self.ctx = RunContext(registry, self.backend, {}, out_dir, [], 0)  # no loggers, no checkpoints
        self.grpo = GRPO(
            dataset=examples,
            reward=lambda text, ex: exact_match(text, ex["answer"]),
            advantage="group_norm",
            loss={"name": "grpo", "loss_type": "dapo", "beta": 0.0, "epsilon_low": 0.2, "epsilon_high": 0.2},
            steps=args.warmup + args.steps,
            prompts_per_step=args.prompts,
            group_size=args.group,
            max_tokens=args.max_tokens,
            temperature=1.0,
            optimizer={"learning_rate": args.lr},
            log_kl=log_kl,
            kl_every=kl_every,
            renderer="raw",  # the prompt text as it is, as TRL gets it
        )
        self.grpo._optimizer = OptimizerConfig(
            learning_rate=args.lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=1.0
        )
        self.grpo.setup(self.ctx, {})  # what Stage.run does before the first step (incl. the KL reference)
        self.timer = ModelTimer()
        instrument(self.backend.model, self.timer)
        if self.backend._vllm is not None:  # the engine samples, not model.generate: time its calls
            instrument_engine(self.backend._vllm, self.timer)
        self._opt_seconds = 0.0
        inner = self.backend._optim_step  # LocalBackend._submit looks the bound method up per call

        def timed_optim_step(params: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(params)
            finally:
                self._opt_seconds += time.perf_counter() - t0

        self.backend._optim_step = timed_optim_step  # type: ignore[method-assign]
        self.step_index = 0
        self.last_metrics: dict[str, Any] = {}

    def step(self) -> StepRecord:
        self.timer.reset()
        self._opt_seconds = 0.0
        _ACTIVE[0] = self.timer
        t0 = time.perf_counter()
        m = self.grpo.train_step(self.ctx, self.step_index)
        dt = time.perf_counter() - t0
        _ACTIVE[0] = None
        self.step_index += 1
        self.last_metrics = m
        tokens = round(m["completion/mean_len"] * self.grpo.prompts_per_step * self.grpo.group_size)
        t = self.timer
        return StepRecord(dt, t.generate, t.forward, t.backward, self._opt_seconds, tokens, t.decode_steps)


def trl_vllm_config(args: argparse.Namespace) -> dict[str, Any]:
    """TRL's generation: ``generate`` (``--trl-vllm off``), or its vLLM colocate mode (an engine in
    the trainer's process, weights loaded in memory, the mode TRL recommends on one GPU) with the
    same memory share as ours (``gpu_memory_utilization`` of ``--vllm``, default 0.3)."""
    if args.trl_vllm == "off":
        return {"use_vllm": False}
    share = float((args.vllm or {}).get("gpu_memory_utilization", 0.3))
    return {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": share}


def build_trl(
    args: argparse.Namespace, examples: list[dict[str, Any]], model_dir: str, out_dir: str, on_step: Callable[[], None]
):
    """A TRL 1.16 GRPOTrainer whose one optimizer step is one generation batch of
    ``prompts x group`` completions, plus the callback that times its steps."""
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback

    assert trl.__version__.startswith("1.16"), f"this benchmark targets TRL 1.16, found {trl.__version__}"
    rows = args.prompts * args.group
    config = trl.GRPOConfig(
        output_dir=os.path.join(out_dir, "trl_out"),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=args.device == "cpu",
        bf16=args.dtype == "bfloat16",
        fp16=False,
        seed=0,
        dataloader_num_workers=0,
        model_init_kwargs={"dtype": args.dtype},
        per_device_train_batch_size=rows,
        gradient_accumulation_steps=1,
        num_generations=args.group,
        # generation_batch_size / steps_per_generation left unset: TRL derives steps_per_generation =
        # gradient_accumulation_steps = 1 and generation_batch_size = rows (asserted below).
        num_iterations=1,
        max_completion_length=args.max_tokens,
        pad_to_multiple_of=None,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        **trl_vllm_config(args),
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        mask_truncated_completions=False,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=args.warmup + args.steps,
        logging_steps=10**6,
        log_completions=False,
        # TRL's GRPOConfig turns activation checkpointing on by default (recomputing the forward in
        # backward to save memory); we never do, so by default it is off here too: same compute.
        gradient_checkpointing=args.trl_gradient_checkpointing,
    )
    assert (config.steps_per_generation, config.generation_batch_size) == (1, rows), (
        config.steps_per_generation,
        config.generation_batch_size,
    )

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [exact_match(c, a) for c, a in zip(completions, answer)]

    # Enough distinct prompts that TRL's RepeatSampler never runs out in max_steps.
    dataset = Dataset.from_list([{"prompt": e["prompt"], "answer": e["answer"]} for e in examples])
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = trl.GRPOTrainer(
        model=model_dir,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=trl_peft_config(args),
    )
    assert next(trainer.model.parameters()).dtype == getattr(torch, args.dtype)

    timer = ModelTimer()
    instrument(trainer.model, timer)
    tokens = [0]
    inner_generate = trainer._generate

    def counting_generate(prompts: list) -> Any:
        out = inner_generate(prompts)
        tokens[0] += sum(len(ids) for ids in out[1])  # completion_ids_list: up to and including eos
        return out

    trainer._generate = counting_generate  # type: ignore[method-assign]
    records: list[StepRecord] = []
    between: list[float] = []  # TRL's loop outside the timed window: data fetch, logging (our steps excluded)
    checkpointing = args.trl_gradient_checkpointing

    class StepTimer(TrainerCallback):
        t0 = t_opt = opt = 0.0
        t_left: float | None = None

        def on_step_begin(self, args, state, control, **kw):
            if not records:  # the Trainer switches checkpointing on in train(), so check here
                model = trainer.model  # the attribute's name before transformers 5.2x (the vLLM venv's)
                on = getattr(model, "is_activation_checkpointing", None)
                on = model.is_gradient_checkpointing if on is None else on
                assert on == checkpointing, "gradient_checkpointing"
            timer.reset()
            tokens[0] = 0
            _ACTIVE[0] = timer
            self.t0 = time.perf_counter()
            if self.t_left is not None:
                between.append(self.t0 - self.t_left)

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.t_opt = time.perf_counter()

        def on_optimizer_step(self, args, state, control, **kw):
            self.opt = time.perf_counter() - self.t_opt

        def on_step_end(self, args, state, control, **kw):
            dt = time.perf_counter() - self.t0
            _ACTIVE[0] = None
            records.append(
                StepRecord(dt, timer.generate, timer.forward, timer.backward, self.opt, tokens[0], timer.decode_steps)
            )
            on_step()  # our steps, right after each of TRL's: the sides alternate
            self.t_left = time.perf_counter()

    trainer.add_callback(StepTimer())
    return trainer, records, between, config


# ---------------------------------------------------------------------------- reporting
def median_iqr(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return statistics.median(xs), q[0], q[2]


def summary(recs: list[StepRecord]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("seconds", "generate", "forward", "backward", "optimizer", "overhead"):
        med, lo, hi = median_iqr([getattr(r, key) for r in recs])
        out[key] = {"median": med, "q1": lo, "q3": hi}
    shares = [r.overhead / r.seconds for r in recs]
    med, lo, hi = median_iqr(shares)
    out["overhead_share"] = {"median": med, "q1": lo, "q3": hi}
    out["tokens"] = {
        "median": statistics.median(r.tokens for r in recs),
        "min": min(r.tokens for r in recs),
        "max": max(r.tokens for r in recs),
    }
    out["decode_steps"] = statistics.median(r.decode_steps for r in recs)
    out["steps"] = [r.__dict__ for r in recs]
    return out


def fmt(s: dict[str, float], scale: float = 1000.0, unit: str = "ms") -> str:
    return f"{s['median'] * scale:8.1f} {unit} [IQR {s['q1'] * scale:.1f}-{s['q3'] * scale:.1f}]"


def model_folder(args: argparse.Namespace, tmp: str) -> str:
    """A Hugging Face folder holding the weights ``LocalBackend(model=args.model, seed=0)``
    builds, for TRL: SmolLM2's cached conversion, or a registered builder's model saved."""
    if args.model == "smollm2":
        if args.model_kwargs:
            raise SystemExit("--model smollm2 takes no --model-kwargs")
        from tempering.plugins.models.smollm2 import smollm2_folder

        return smollm2_folder()
    from tempering.plugins.backends.local.model_source import registered_builder

    model, tokenizer = registered_builder(args.model)(**{**args.model_kwargs, "seed": 0})
    folder = os.path.join(tmp, "model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps per side (after warmup)")
    p.add_argument("--warmup", type=int, default=3, help="discarded steps per side")
    p.add_argument("--prompts", type=int, default=16, help="prompts per optimizer step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt (num_generations)")
    p.add_argument("--max-tokens", type=int, default=8, help="max completion tokens")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (both sides, one process)")
    p.add_argument(
        "--trl-gradient-checkpointing",
        action="store_true",
        help="leave TRL's default gradient_checkpointing=True on (more compute on TRL's side)",
    )
    p.add_argument(
        "--no-log-kl",
        dest="with_log_kl",
        action="store_false",
        help="skip the 'ours default' and 'ours kl/step' columns (KL logging: extra reference forwards)",
    )
    p.add_argument("--json", default=None, help="also write the raw per-step numbers here")
    p.add_argument(
        "--engine",
        default="generate",
        choices=("generate", "vllm", "auto"),
        help="ours' sampling engine (backend.engine); vllm needs the vLLM venv (docs/local-scale.md)",
    )
    p.add_argument(
        "--trl-vllm",
        default="off",
        choices=("off", "colocate"),
        help="TRL's generation: generate (off) or its vLLM colocate mode (a GPU with vLLM installed)",
    )
    p.add_argument(
        "--vllm",
        type=json.loads,
        default=None,
        help='ours\' backend.vllm block as JSON, e.g. \'{"enforce_eager": false, "kv_cache_space_gib": 2}\'',
    )
    p.add_argument("--model", default="tiny_llama", help="a registered model builder (tiny_llama, tiny_qwen3, ...)")
    p.add_argument(
        "--model-kwargs",
        type=json.loads,
        default={},
        metavar="JSON",
        help='its keys, e.g. \'{"hidden_size": 2048, "num_layers": 28}\' (a Qwen3-1.7B shape: benchmarks/gpu_check.sh)',
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda (both sides)")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="weights and compute (both sides)"
    )
    p.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="train a LoRA adapter of this rank on both sides (all linear layers, dropout 0); 0: full FT",
    )
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    args = p.parse_args(argv)

    import warnings

    from transformers.utils import logging as hf_logging

    warnings.filterwarnings("ignore", category=FutureWarning)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    patch_backward()

    from tempering.plugins.datasets.arithmetic import arithmetic

    examples = arithmetic("train")
    with tempfile.TemporaryDirectory(prefix="grpo_bench_") as tmp:
        model_dir = model_folder(args, tmp)

        # "ours": beta 0 and no KL logging, i.e. exactly TRL's work at beta 0. "ours default": the
        # GRPO stage's defaults (log_kl with kl_every=10: one no-grad reference forward every 10
        # steps). "ours kl/step": the KL logged at every step (kl_every=1), the old default.
        sides = {"ours": Ours(args, examples, os.path.join(tmp, "ours"), log_kl=False)}
        if args.with_log_kl:
            sides["ours default"] = Ours(args, examples, os.path.join(tmp, "ours_default"), log_kl=True)
            sides["ours kl/step"] = Ours(args, examples, os.path.join(tmp, "ours_kl"), log_kl=True, kl_every=1)
        n_params = sum(t.numel() for t in sides["ours"].backend.model.parameters())
        recs: dict[str, list[StepRecord]] = {name: [] for name in sides}
        order = list(sides)

        def our_steps() -> None:
            for name in order:
                recs[name].append(sides[name].step())
            order.append(order.pop(0))  # rotate: no side always runs right after TRL's step

        t0 = time.perf_counter()
        trainer, trl_records, between, config = build_trl(args, examples, model_dir, tmp, our_steps)
        trl_setup = time.perf_counter() - t0
        n_trainable = trainable_count(trainer.model)
        for side in sides.values():
            assert trainable_count(side.backend.model) == n_trainable, "both sides must train the same parameters"
            impls = {side.backend.model.config._attn_implementation, trainer.model.config._attn_implementation}
            assert len(impls) == 1, f"attention implementations differ: {impls}"
            assert side.backend._submit(torch.get_num_threads).result() == args.threads  # the worker thread too
        assert torch.get_num_threads() == args.threads
        trainer.train()
        for side in sides.values():
            side.backend.close()
    load_end = os.getloadavg()

    n = args.warmup + args.steps
    recs["TRL"] = trl_records
    assert all(len(r) == n for r in recs.values()), {k: len(v) for k, v in recs.items()}
    res = {name: summary(r[args.warmup :]) for name, r in recs.items()}
    t_med = res["TRL"]["seconds"]["median"]
    ratios = {name: res[name]["seconds"]["median"] / t_med for name in sides}
    mean = {name: statistics.mean(r.seconds for r in recs[name][args.warmup :]) for name in recs}
    mean_ratios = {name: mean[name] / mean["TRL"] for name in sides}
    pair = {
        name: median_iqr([a.seconds / b.seconds for a, b in zip(recs[name][args.warmup :], trl_records[args.warmup :])])
        for name in sides
    }
    gaps = between[max(args.warmup - 1, 0) :]  # gaps[i] precedes measured step i + 1
    between_med = statistics.median(gaps) if gaps else float("nan")

    rows = args.prompts * args.group
    cols = list(recs)
    w = 34
    print()
    versions = f"transformers {sys.modules['transformers'].__version__}, torch {torch.__version__}"
    print(
        f"GRPO step, ours vs TRL {sys.modules['trl'].__version__} ({versions}, {args.threads} thread(s), "
        f"{os.cpu_count()} CPUs)"
    )
    tuning = f"LoRA r={args.lora} alpha={lora_params(args)['alpha']:g}" if args.lora else "full FT"
    print(
        f"model {args.model} ({n_params / 1e6:.2f}M params, {tuning}: {n_trainable / 1e6:.2f}M trainable, "
        f"{args.dtype}, {args.device}); per step {args.prompts} prompts x "
        f"{args.group} completions = {rows} rows, max {args.max_tokens} tokens, lr {args.lr}, dapo, beta 0; "
        f"TRL gradient_checkpointing={args.trl_gradient_checkpointing}"
    )
    print(
        f"{args.warmup} warmup + {args.steps} measured steps per side, interleaved (TRL step, then ours); medians [IQR]"
    )
    print(
        f"load average (1/5/15 min) at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
        f"at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}"
    )
    print()
    print(f"{'':32}" + "".join(f"{c:>{w}}" for c in cols))
    for key, label in (
        ("seconds", "step"),
        ("generate", "  generate"),
        ("forward", "  forward (outside generate)"),
        ("backward", "  backward"),
        ("optimizer", "  optimizer step (clip+AdamW)"),
        ("overhead", "  overhead = step - model"),
    ):
        print(f"{label:32}" + "".join(f"{fmt(res[c][key]):>{w}}" for c in cols))
    print(f"{'overhead share':32}" + "".join(f"{fmt(res[c]['overhead_share'], 100, '%'):>{w}}" for c in cols))
    print(
        f"{'completion tokens / step':32}"
        + "".join(
            f"{res[c]['tokens']['median']:>{w - 16}.0f} [{res[c]['tokens']['min']}-{res[c]['tokens']['max']}]".rjust(w)
            for c in cols
        )
    )
    print(f"{'generate width (new positions)':32}" + "".join(f"{res[c]['decode_steps']:>{w}.0f}" for c in cols))
    print()
    for name in sides:
        med, lo, hi = pair[name]
        print(
            f"ratio {name}/TRL (median step times): {ratios[name]:.3f}   (per interleaved pair: median {med:.3f}, "
            f"IQR {lo:.3f}-{hi:.3f}; mean step times: {mean_ratios[name]:.3f}; target <= 1.0)"
        )
    print(f"TRL loop between timed steps (data fetch, logging): median {between_med * 1000:.1f} ms, not counted above")
    print(f"TRL trainer setup {trl_setup:.1f} s (incl. import trl); whole run {time.perf_counter() - t_start:.1f} s")
    for name, side in sides.items():
        engine = side.backend._vllm
        if engine is not None and engine.sync_seconds:
            syncs = engine.sync_seconds[1:] or engine.sync_seconds  # the first push is the engine's start
            print(f"{name}: vLLM weight sync median {statistics.median(syncs) * 1000:.0f} ms over {len(syncs)} syncs")
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        print(f"peak GPU memory (both sides, one process): {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB")
    if args.json:
        keys = (
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_generations",
            "generation_batch_size",
            "steps_per_generation",
            "num_iterations",
            "max_completion_length",
            "loss_type",
            "beta",
            "learning_rate",
            "gradient_checkpointing",
        )
        with open(args.json, "w") as fh:
            json.dump(
                {
                    "args": vars(args),
                    "load_start": load_start,
                    "load_end": load_end,
                    "results": res,
                    "ratios": ratios,
                    "mean_ratios": mean_ratios,
                    "trl_between_steps": between,
                    "trl_config": {k: getattr(config, k) for k in keys},
                },
                fh,
                indent=2,
                default=str,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
