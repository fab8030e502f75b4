"""The local training backend: Tinker's primitives on a transformers model in this process.

One object owns the policy model, its optimizer and the RNG, and exposes the same calls a
recipe makes on Tinker (``sample``, ``logprobs``, ``forward_backward``, ``optim_step``,
``save``/``load``), so a recipe never needs to know where it runs. Calls run in submission
order on one worker thread and return :class:`concurrent.futures.Future`: the loop can submit
``forward_backward`` and ``optim_step`` back to back and score rewards while the model works.
:meth:`LocalBackend.sampling_client` gives a sampler of a weight snapshot that runs on a second
thread with its own model copy, so sampling can overlap with training (asynchronous RL).

Things a recipe relies on, each tested in ``tests/test_local_backend.py``:

* sampler logprobs are those of the distribution actually sampled from (after temperature and
  top-k/top-p), and match a separate forward pass at temperature 1;
* ``reference=True`` scores with the LoRA adapter disabled, or (full fine-tuning) with the
  initial weights, rebuilt lazily from the same source and seed;
* ``weights=NAME`` scores with a named snapshot of the trainable weights (:meth:`snapshot`,
  :meth:`ema_update`): the "policy as it was at stage start" and EMA teachers of DPO and SDFT;
  snapshots are part of checkpoints;
* a checkpoint holds weights, optimizer state, step, every RNG and the caller's ``extra``, so a
  resumed run takes exactly the step an uninterrupted one would;
* under ``torchrun`` gradients are averaged across ranks before clipping, and rank 0 alone
  writes checkpoints; with ``parallel: fsdp`` weights, gradients and Adam's moments are sharded
  across ranks and checkpoints keep the single-process format (``tests/test_fsdp.py``).

This module imports torch and transformers at the top: the registry refers to it by a lazy
``"module:attr"`` string, so it is only imported when a local backend is actually built.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import os
import random
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import torch
from tempering.errors import ConfigError
from tempering.interfaces import Loss, at_positions, from_positions
import tempering.plugins.backends.local.distributed as distributed
import tempering.plugins.backends.local.sharding as sharding
from tempering.plugins.backends.common import float_metrics
from tempering.plugins.backends.local.logprobs import (
    model_logits,
    next_token_distributions,
    selected_token_logprobs,
    trained_positions,
)
from tempering.plugins.backends.local.model_source import (
    check_model,
    quiet_loading,
    registered_builder,
    source_folder,
)
from tempering.plugins.backends.local.stops import before_first, split_stop
from tempering.plugins.backends.local.vllm_engine import VllmEngine, check_engine
from tempering.types import AdamParams, Batch, Completion, SamplingParams
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

T = TypeVar("T")

DEFAULT_MODEL = "tiny_llama"


@dataclasses.dataclass
class LoraParams:
    """The ``lora:`` block: adapter rank, alpha, dropout and the modules it wraps (peft's
    ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``)."""

    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Any = "all-linear"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CHECKPOINT_FORMAT = 1
STATE_FILE, META_FILE = "state.pt", "meta.json"



def _run_on(executor: ThreadPoolExecutor | None, fn: Callable[..., T], *args: Any) -> Future[T]:
    """Submit ``fn`` to ``executor``, or run it inline into a finished future (unthreaded)."""
    if executor is not None:
        return executor.submit(fn, *args)
    future: Future[T] = Future()
    try:
        future.set_result(fn(*args))
    except BaseException as err:  # noqa: BLE001 - the future carries it to the caller
        future.set_exception(err)
    return future

class LocalBackend:
    """Train and sample a transformers causal LM in this process (CPU or one GPU per rank).

    Args:
        model: a model-builder name (``tiny_llama``, ``tiny_qwen`` or whatever ``model_builder``
            builds) or a Hugging Face path / hub name for ``AutoModelForCausalLM``.
        model_kwargs: keyword arguments for the builder, or for ``from_pretrained``.
        lora: ``None`` for full fine-tuning, else a dict with keys ``rank``, ``alpha``,
            ``dropout``, ``target_modules`` (defaults 32, 32, 0.0, ``"all-linear"``).
        seed: seeds model init, LoRA init and the global RNGs (offset by the rank, so data-
            parallel ranks sample different completions from one model).
        device: ``cpu``, ``cuda``, ``cuda:N`` or ``auto``; under torchrun ``cuda`` means the
            rank's local GPU.
        dtype: ``float32``, ``bfloat16`` or ``float16``.
        parallel: ``ddp`` (replicate the model, average gradients) or ``fsdp`` (shard weights,
            gradients and optimizer state across ranks, for a model larger than one device; see
            :mod:`~tempering.plugins.backends.local.sharding`). Under torchrun only: a single
            process has nothing to shard, so ``fsdp`` there is the plain single-process path.
        sample_batch_size: most sequences per ``generate`` call (bounds KV-cache memory).
        num_threads: if > 0, ``torch.set_num_threads`` for the process. Tiny models are
            fastest with 1; on a busy 2-core machine 2 threads can be 10x slower than 1.
        threaded: run calls on a worker thread (True) or inline, returning finished futures
            (handy for debugging: tracebacks point at the caller).
        engine: what ``sample`` and sampling clients generate with: ``generate`` (transformers)
            or ``vllm`` (an optional extra; :mod:`~tempering.plugins.backends.local.vllm_engine`).
        vllm: the vLLM engine's settings (:class:`~tempering.plugins.backends.local.vllm_engine.VllmParams`).
        model_builder: a runtime callable returning ``(model, tokenizer)``; not a config key.
    """

    #: ``forward_backward`` calls the loss on this backend's own training forward, so an
    #: on-policy stage can take the ratio's "old" logprobs from it, detached, instead of paying
    #: a second forward pass (GRPO's ``recompute_logprobs: auto``).
    LOSS_SEES_TRAINING_FORWARD: ClassVar[bool] = True
    #: The nested ``lora:`` block's schema (``tempering.registry.BLOCKS_HOOK``): its defaults in
    #: ``tempering show --resolved`` and its keys in docs/reference.md.
    config_blocks: ClassVar[dict[str, type]] = {"lora": LoraParams}

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        model_kwargs: Mapping[str, Any] | None = None,
        lora: Mapping[str, Any] | None = None,
        seed: int = 0,
        device: str = "cpu",
        dtype: str = "float32",
        parallel: str = "ddp",
        sample_batch_size: int = 256,
        num_threads: int = 0,
        threaded: bool = True,
        engine: str = "generate",
        vllm: Mapping[str, Any] | None = None,
        model_builder: Callable[..., tuple[Any, Any]] | None = None,
    ) -> None:
        self.check_params({"model": model, "model_kwargs": model_kwargs, "lora": lora, "device": device, "dtype": dtype,
                           "parallel": parallel,
                           "sample_batch_size": sample_batch_size, "model_builder": model_builder})  # fmt: skip
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.model_name = model
        self.model_kwargs = dict(model_kwargs or {})
        self.lora = _check_lora(lora, "backend.lora")
        self.seed = int(seed)
        self.rank = distributed.rank()
        self.world_size = distributed.world_size()
        self.device = _resolve_device(device, "backend.device")
        self.dtype = _resolve_dtype(dtype, "backend.dtype")
        self.sample_batch_size = sample_batch_size
        self._model_builder = model_builder
        self.step = 0

        base, self.tokenizer = self._build_base()
        self.pad_token_id, self.eos_token_ids = _special_ids(base, self.tokenizer)
        base.generation_config = self._neutral_generation_config()
        self.model = _apply_lora(base, self.lora, self.seed) if self.lora else base
        # one starting point even for unseeded builders
        distributed.broadcast_([p for p in self.model.parameters() if p.requires_grad])
        self._fingerprint = None if self.lora else _fingerprint(self.model)
        self._sharded = parallel == "fsdp" and self.world_size > 1
        if self._sharded:  # FSDP2: parameters become DTensors, so list them after this
            sharding.shard_model(self.model, self.dtype)
        self._trainable_named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self._trainable = [p for _, p in self._trainable_named]
        self._snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self._reference: Any = None
        self._optimizer: torch.optim.Optimizer | None = None
        _seed_everything(self.seed + self.rank)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tempering-local") if threaded else None
        # The sampling engine of sampling_client(): created on first use.
        self._threaded = threaded
        self._sampler_model: Any = None
        self._sampler_loaded: LocalSamplingClient | None = None
        self._sampler_executor: ThreadPoolExecutor | None = None
        vllm_params = check_engine(engine, vllm, "backend")
        if vllm_params is not None and self.world_size > 1:
            raise ConfigError("engine 'vllm' runs in a single process for now; use engine: generate under torchrun",
                              "backend.engine")  # fmt: skip
        self._vllm = VllmEngine(self, vllm_params) if vllm_params is not None else None

    @staticmethod
    def check_params(params: Mapping[str, Any], path: str = "backend") -> None:
        """Check what can be checked before a model is built or downloaded; the keys present only.

        ``Registry.check`` / ``build`` call this (the registry's ``check_params`` hook) and so does
        ``__init__``: ``lora``, ``dtype``, ``device``, ``sample_batch_size``, and the model source
        (:func:`~tempering.plugins.backends.local.model_source.check_model`: a registered
        builder and its ``model_kwargs``, a saved-model folder, or a hub id). Errors are one
        line under ``path``."""
        if "lora" in params:
            _check_lora(params["lora"], f"{path}.lora")
        if "dtype" in params:
            _resolve_dtype(params["dtype"], f"{path}.dtype")
        if "device" in params:
            _resolve_device(params["device"], f"{path}.device")
        if params.get("parallel", "ddp") not in sharding.PARALLEL_MODES:
            raise ConfigError(f"unknown mode {params['parallel']!r}; choose ddp (replicated) or fsdp (sharded)",
                              f"{path}.parallel")  # fmt: skip
        if params.get("sample_batch_size", 1) < 1:
            raise ConfigError(f"must be >= 1, got {params['sample_batch_size']}", f"{path}.sample_batch_size")
        if "engine" in params or "vllm" in params:
            check_engine(params.get("engine", "generate"), params.get("vllm"), path)
        if params.get("model_builder") is None:  # a runtime builder takes any name and arguments
            check_model(params.get("model", DEFAULT_MODEL), params.get("model_kwargs"), path)

    # ------------------------------------------------------------------ public primitives
    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        """``num_samples`` completions for each prompt (grouped per prompt, in order).

        Conventions (those of vLLM and the OpenAI API): ``tokens`` end with the eos / stop
        token or the token that completed a stop string, so training teaches stopping;
        ``text`` drops special tokens and ends before the first stop string. ``logprobs`` are
        under the distribution sampled from (after temperature, top-k, top-p); for greedy
        (``temperature=0``) they are the untempered model logprobs, since a point mass would
        carry no information. ``params.seed`` samples from a private RNG; without it the
        global RNG is used, which checkpoints save and restore.
        """
        return self._submit(self._sample, [list(p) for p in prompts], num_samples, params)

    def logprobs(
        self, batch: Batch, reference: bool = False, weights: str | None = None
    ) -> Future[list[list[float]]]:
        """Per-target-token logprobs of each row (one forward pass, no gradients).

        ``reference=True`` scores with the reference policy (adapter off / initial copy);
        ``weights="name"`` with the named snapshot (see :meth:`snapshot`)."""
        return self._submit(self._logprobs, batch, reference, weights)

    def distributions(
        self, batch: Batch, reference: bool = False, weights: str | None = None, topk: int | None = None
    ) -> Future[list[Any]]:
        """The next-token distribution at every target position of each row (no gradients).

        Returns one ``(T_i, V)`` float32 CPU tensor of log-probabilities (log-softmax over the
        vocabulary) per row, or with ``topk=K`` one ``(values, ids)`` pair of ``(T_i, K)``
        tensors (the K most likely tokens, descending). ``reference`` / ``weights`` choose the
        scoring model as in :meth:`logprobs`. Used by distillation (SDFT teacher logits).
        """
        if topk is not None and topk < 1:
            raise ValueError(f"distributions: topk must be >= 1 (or None), got {topk}")
        return self._submit(self._distributions, batch, reference, weights, topk)

    def snapshot(self, name: str) -> Future[None]:
        """Keep a frozen copy of the current trainable weights under ``name`` (the adapter with
        LoRA, every weight otherwise); score with it via ``weights=name``. Saved in checkpoints."""
        return self._submit(self._snapshot, str(name))

    def ema_update(self, name: str, rate: float) -> Future[None]:
        """``snapshot[name] = (1 - rate) * snapshot[name] + rate * current`` (an EMA teacher);
        a missing snapshot starts as a copy of the current weights."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"ema_update: rate must be in [0, 1], got {rate}")
        return self._submit(self._ema_update, str(name), float(rate))

    def drop_snapshot(self, name: str) -> Future[None]:
        """Forget a snapshot (no error if there is none)."""
        return self._submit(self._snapshots.pop, str(name), None)

    def snapshot_names(self) -> list[str]:
        """Names of the snapshots held (after all queued calls)."""
        return self._submit(lambda: sorted(self._snapshots)).result()

    def reference_logprobs(self, batch: Batch) -> Future[list[list[float]]]:
        """Same as ``logprobs(batch, reference=True)``."""
        return self.logprobs(batch, reference=True)

    def sampling_client(self) -> Future[LocalSamplingClient]:
        """A sampler of a frozen snapshot of the current weights (Tinker's
        ``save_weights_and_get_sampling_client``), for sampling *while* training.

        The snapshot is taken on the worker thread after every call submitted before it (so
        after a queued ``optim_step``) and its completions carry that ``step`` as
        ``policy_version``. Its :meth:`LocalSamplingClient.sample` runs on a second thread with
        a second copy of the model (made on first use; with LoRA only the adapter differs
        between snapshots), so it never waits for, or touches, the training weights. A backend
        that never calls this behaves exactly as before. Sampling without ``params.seed`` draws
        from the process-global torch RNG, which training does not use.
        """
        if self._sharded:
            raise ConfigError("asynchronous sampling (a sampling client on its own thread) cannot keep the ranks' "
                              "forwards in lockstep; use parallel: ddp or a synchronous stage", "backend.parallel")
        return self._submit(self._sampling_snapshot)

    def forward_backward(self, batch: Batch, loss: Loss) -> Future[dict[str, float]]:
        """Add the gradients of ``loss`` on ``batch`` to the accumulated ones (until
        :meth:`optim_step`); returns the loss's metrics plus ``loss``."""
        return self._submit(self._forward_backward, batch, loss)

    def optim_step(self, params: AdamParams) -> Future[dict[str, float]]:
        """One AdamW step on the accumulated (rank-averaged) gradients, then clear them."""
        return self._submit(self._optim_step, params)

    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """Write a checkpoint directory at ``path`` (after all queued calls); returns ``path``.

        Under torchrun every rank must call this (it gathers each rank's RNG state); rank 0
        alone writes. ``extra`` must be JSON-serialisable (e.g. the loop position).
        """
        payload = dict(extra or {})
        try:
            json.dumps(payload)
        except TypeError as err:
            raise TypeError(f"LocalBackend.save: extra must be JSON-serialisable ({err})") from err
        return self._submit(self._save, str(path), payload).result()

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save`; returns its ``extra``."""
        return self._submit(self._load, str(path)).result()

    def export_pretrained(self, path: str, adapter: bool = False) -> str:
        """Write the policy in Hugging Face format plus the tokenizer, for use outside
        tempering (``AutoModelForCausalLM.from_pretrained(path)``): a LoRA policy merged into
        its base weights, or with ``adapter=True`` the peft adapter alone. Rank 0 only."""
        if adapter and not self.lora:
            raise ValueError("export_pretrained(adapter=True): this backend trains every weight (no lora:), "
                             "so there is no adapter; export the full model")  # fmt: skip
        return self._submit(self._export, str(path), adapter).result()

    def close(self) -> None:
        """Finish queued calls and stop the worker threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        if self._sampler_executor is not None:
            self._sampler_executor.shutdown(wait=True)
            self._sampler_executor = None
        if self._vllm is not None:
            self._vllm.close()

    # ------------------------------------------------------------------ execution
    def _submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` on the worker thread (FIFO, so calls apply in submission order)."""
        return _run_on(self._executor, fn, *args)

    # ------------------------------------------------------------------ model building
    def _build_base(self, device: torch.device | None = None) -> tuple[Any, Any]:
        """Build the base model from its source with a private RNG seeded by ``seed`` (on
        ``device``, default the backend's).

        Deterministic on purpose: data-parallel ranks and the full-FT reference model are
        rebuilt this way and must come out identical.
        """
        with torch.random.fork_rng(devices=[]), quiet_loading():
            torch.manual_seed(self.seed)
            model, tokenizer = self._load_source()
        model = model.to(device=device or self.device, dtype=self.dtype)
        model.eval()
        return model, tokenizer

    def _load_source(self) -> tuple[Any, Any]:
        builder = self._model_builder
        if builder is None:
            builder = registered_builder(self.model_name)
        if builder is not None:
            kwargs = dict(self.model_kwargs)
            if "seed" not in kwargs and "seed" in inspect.signature(builder).parameters:
                kwargs["seed"] = self.seed
            return builder(**kwargs)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs = dict(self.model_kwargs)
        revision = kwargs.get("revision")
        folder = source_folder(self.model_name)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, revision=revision)
        return model, tokenizer

    def _neutral_generation_config(self) -> GenerationConfig:
        """Only the special ids: a checkpoint's sampling defaults (Qwen ships top_k=20,
        repetition_penalty=1.05, ...) would otherwise leak into every ``generate`` call and
        make sampler logprobs disagree with the model. Sampling is set by SamplingParams alone."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        return GenerationConfig(pad_token_id=self.pad_token_id, bos_token_id=bos, eos_token_id=sorted(self.eos_token_ids))

    def _reference_model(self) -> Any:
        """The frozen initial model for full fine-tuning, built on first use.

        Rebuilt from the source rather than deep-copied at start-up: it costs no memory until
        a recipe asks for it, and it is still the *initial* model when that happens after
        training (or after resuming from a checkpoint).
        """
        if self._reference is None:
            ref, _ = self._build_base()
            for p in ref.parameters():
                p.requires_grad_(False)
            if _fingerprint(ref) != self._fingerprint:
                raise RuntimeError(
                    f"LocalBackend: rebuilding '{self.model_name}' for the reference model gave different "
                    "weights than at start-up; the model builder must be deterministic given its seed"
                )
            if self._sharded:
                sharding.shard_model(ref, self.dtype)
            self._reference = ref
        return self._reference

    @contextlib.contextmanager
    def _scoring_model(self, reference: bool, weights: str | None = None) -> Iterator[Any]:
        """The module to score with: the policy, the policy with its adapter off, the copy, or
        the policy with a named snapshot's weights swapped in (and back out afterwards)."""
        if weights is not None:
            if reference:
                raise ValueError("logprobs: pass reference=True or weights=NAME, not both")
            with self._swapped(weights):
                yield self.model
        elif not reference:
            yield self.model
        elif self.lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self._reference_model()

    @contextlib.contextmanager
    def _swapped(self, name: str) -> Iterator[None]:
        if name not in self._snapshots:
            raise KeyError(f"LocalBackend: no weight snapshot named '{name}' (have: {sorted(self._snapshots)})")
        snap = self._snapshots[name]
        with torch.no_grad():
            saved = [p.detach().clone() for p in self._trainable]
            for n, p in self._trainable_named:
                p.copy_(snap[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self._trainable, saved):
                    p.copy_(value)

    def _snapshot(self, name: str) -> None:
        with torch.no_grad():
            self._snapshots[name] = {n: p.detach().clone() for n, p in self._trainable_named}

    def _ema_update(self, name: str, rate: float) -> None:
        if name not in self._snapshots:  # kept in float32 so small rates do not round away
            with torch.no_grad():
                self._snapshots[name] = {n: p.detach().float().clone() for n, p in self._trainable_named}
            return
        snap = self._snapshots[name]
        with torch.no_grad():
            for n, p in self._trainable_named:
                if snap[n].is_floating_point() and snap[n].dtype != torch.float32:
                    snap[n] = snap[n].float()  # a snapshot() turned EMA: average in float32
                snap[n].lerp_(p.detach().to(snap[n].dtype), rate)

    # ------------------------------------------------------------------ sampling snapshots
    def _sampling_snapshot(self) -> LocalSamplingClient:
        """On the worker thread: copy the trainable weights and make sure the sampling engine
        (a model copy and its thread) exists."""
        if self._sampler_model is None and self._vllm is None:  # a vLLM engine holds its own copy
            self._sampler_model = copy.deepcopy(self.model)
            for p in self._sampler_model.parameters():
                p.requires_grad_(False)
            self._sampler_model.eval()
        if self._threaded and self._sampler_executor is None:
            self._sampler_executor = ThreadPoolExecutor(1, thread_name_prefix="tempering-sampler")
        with torch.no_grad():
            weights = {n: p.detach().clone() for n, p in self._trainable_named}
        return LocalSamplingClient(self, weights, self.step)

    def _submit_sampler(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` on the sampling thread (FIFO), or inline when the backend is unthreaded."""
        return _run_on(self._sampler_executor, fn, *args)

    def _sample_snapshot(
        self, client: LocalSamplingClient, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """On the sampling thread: load ``client``'s weights into the sampling model unless they
        are loaded already, then sample with it (a vLLM engine is handed the weights instead)."""
        if self._vllm is not None:
            return self._sample(prompts, num_samples, params, version=client.policy_version, weights=client.weights)
        if self._sampler_loaded is not client:
            params_by_name = dict(self._sampler_model.named_parameters())
            with torch.no_grad():
                for name, tensor in client.weights.items():
                    params_by_name[name].copy_(tensor)
            self._sampler_loaded = client
        return self._sample(prompts, num_samples, params, model=self._sampler_model, version=client.policy_version)

    # ------------------------------------------------------------------ sampling
    def _sample(
        self,
        prompts: list[list[int]],
        num_samples: int,
        params: SamplingParams,
        model: Any = None,
        version: int | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> list[list[Completion]]:
        """Sample with ``model`` (default: the policy) and stamp ``version`` (default: ``step``);
        a vLLM engine samples with ``weights`` (default: the policy's trainable tensors)."""
        model = self.model if model is None else model
        version = self.step if version is None else version
        if num_samples < 1:
            raise ValueError(f"sample: num_samples must be >= 1, got {num_samples}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"sample: prompt {i} is empty; encode it with a BOS token or some text")
        if self._vllm is not None:
            return self._vllm.sample(prompts, num_samples, params, weights or dict(self._trainable_named), version)
        rows = [p for p in prompts for _ in range(num_samples)]
        completions: list[Completion] = []
        model.eval()
        with _seeded(params.seed, self.device), torch.no_grad():
            for start in range(0, len(rows), self.sample_batch_size):
                completions += self._generate(rows[start : start + self.sample_batch_size], params, model, version)
        return [completions[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def _generate(self, rows: list[list[int]], params: SamplingParams, model: Any, version: int) -> list[Completion]:
        """One left-padded ``generate`` call; logprobs recorded from the final sampling scores."""
        stop_strings, stop_ids = split_stop(params.stop)
        eos = sorted(self.eos_token_ids | set(stop_ids))
        if params.max_tokens <= 0:
            return [self._completion(r, [], [], "length", "", params, version) for r in rows]
        input_ids, attention_mask = _left_pad(rows, self.pad_token_id, self.device)
        width = input_ids.shape[1]
        recorder = _SampledLogprobs()
        processors = LogitsProcessorList([*_warpers(params), recorder])
        stopper = _StopStrings(self.tokenizer, stop_strings, width, len(rows)) if stop_strings else None
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=self._generation_config(params, eos),
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([stopper] if stopper else []),
        )
        new_tokens = sequences[:, width:]
        logprobs = recorder.result(new_tokens)
        out = []
        for i, row in enumerate(rows):
            toks, lps = new_tokens[i].tolist(), logprobs[i].tolist()
            end, by_string = _cut_point(toks, set(eos), stopper.done_at[i] if stopper else None)
            if end is not None:
                toks, lps = toks[:end], lps[:end]
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            if by_string:
                text = before_first(text, stop_strings)
            out.append(self._completion(row, toks, lps, "stop" if end is not None else "length", text, params, version))
        return out

    def _generation_config(self, params: SamplingParams, eos: list[int]) -> GenerationConfig:
        """Neutral sampling settings: temperature/top-k/top-p are applied by our own warpers
        (see :func:`_warpers`) so the logprob recorder sees exactly the final distribution."""
        sampling = params.temperature > 0
        extra = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampling else {}
        return GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=sampling,
            pad_token_id=self.pad_token_id,
            eos_token_id=eos,
            use_cache=True,
            **extra,
        )

    def _completion(
        self,
        prompt: list[int],
        toks: list[int],
        lps: list[float],
        reason: str,
        text: str,
        params: SamplingParams,
        version: int,
    ) -> Completion:
        return Completion(
            prompt_tokens=list(prompt),
            tokens=toks,
            logprobs=lps,
            stop_reason=reason,
            text=text,
            policy_version=version,
            temperature=params.temperature,
        )

    # ------------------------------------------------------------------ scoring and training
    def _logprobs(self, batch: Batch, reference: bool, weights: str | None = None) -> list[list[float]]:
        """Every target position's logprob (Tinker's ``forward``), log-softmaxed chunk by chunk."""
        tensors = batch.to_tensors(self.pad_token_id, device=self.device)
        with torch.no_grad(), self._scoring_model(reference, weights) as model:
            model.eval()
            logits = model_logits(model, tensors["input_ids"], tensors["attention_mask"])
            lp = selected_token_logprobs(logits, tensors["target_ids"])
        return [lp[i, : len(d.target_tokens)].tolist() for i, d in enumerate(batch.data)]

    def _distributions(self, batch: Batch, reference: bool, weights: str | None, topk: int | None) -> list[Any]:
        tensors = batch.to_tensors(self.pad_token_id, device=self.device)
        out: list[Any] = []
        with torch.no_grad(), self._scoring_model(reference, weights) as model:
            model.eval()
            logits = model_logits(model, tensors["input_ids"], tensors["attention_mask"])
            for i, d in enumerate(batch.data):
                dist = next_token_distributions(logits[i, : len(d.target_tokens)], topk)
                out.append(dist.cpu() if topk is None else (dist[0].cpu(), dist[1].cpu()))
        return out

    def _forward_backward(self, batch: Batch, loss: Loss) -> dict[str, float]:
        """The LM head runs only at the positions some row trains on (unless the loss sets
        ``needs_all_positions``); logprobs elsewhere are 0 (see :class:`~tempering.interfaces.Loss`)
        and a ``needs_logits`` loss gets the logits there with ``batch["logit_positions"]``."""
        tensors = batch.to_tensors(self.pad_token_id, device=self.device)
        positions = None if getattr(loss, "needs_all_positions", False) else trained_positions(tensors["weights"])
        self.model.train()
        logits = model_logits(self.model, tensors["input_ids"], tensors["attention_mask"], positions)
        lp = selected_token_logprobs(logits, at_positions(tensors["target_ids"], positions))
        lp = from_positions(lp, positions, tensors["target_ids"].shape[1])
        if getattr(loss, "needs_logits", False):
            tensors["logits"] = logits
            if positions is not None:
                tensors["logit_positions"] = positions
        out = loss(lp, tensors)
        value = getattr(out, "loss", None)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(f"forward_backward: {type(loss).__name__} must return a LossOutput with a scalar tensor .loss")
        value.backward()
        metrics = float_metrics(getattr(out, "metrics", {}) or {}, type(loss).__name__)
        metrics["loss"] = float(value.detach())
        return metrics

    def _optim_step(self, params: AdamParams) -> dict[str, float]:
        grads = self._averaged_grads()
        max_norm = params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf")
        norm = sharding.clip_grad_norm_(grads, max_norm)  # the global norm, sharded or not
        finite = bool(torch.isfinite(torch.tensor(norm)))
        optimizer = self._get_optimizer()
        for group in optimizer.param_groups:
            group.update(
                lr=params.learning_rate,
                betas=(params.beta1, params.beta2),
                eps=params.eps,
                weight_decay=params.weight_decay,
            )
        if finite:  # a NaN/inf gradient would poison the weights and Adam's moments for good
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {
            "grad_norm": norm,
            "lr": float(params.learning_rate),
            "grad_clipped": float(finite and norm > max_norm),
            "skipped_nonfinite": float(not finite),
        }

    def _averaged_grads(self) -> list[torch.Tensor]:
        """The parameters that have gradients, with those averaged across ranks.

        Under data parallelism every rank reduces every trainable tensor (a missing gradient
        counts as zeros) so that the collective calls line up and all ranks step identically.
        """
        if self.world_size > 1 and not self._sharded:  # FSDP's backward already averaged them
            for p in self._trainable:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            distributed.all_reduce_mean_([p.grad for p in self._trainable])
        return [p for p in self._trainable if p.grad is not None]

    def _get_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over the trainable tensors, created on first use; hyper-parameters are set on
        its param groups at every step, so changing AdamParams never loses its moments."""
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self._trainable, lr=1e-4)
        return self._optimizer

    # ------------------------------------------------------------------ checkpoints
    def _training_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
        """Weights and optimizer state in the single-process format. Weights are only what
        training changes: the adapter with LoRA, the whole state dict otherwise. Under FSDP every
        rank must call this (it gathers the shards) and rank 0 alone gets them."""
        if self._sharded:
            names = [n for n, _ in self._trainable_named]
            return sharding.gather_state(self.model, self._optimizer, names, bool(self.lora))
        return self._weights_state(), None if self._optimizer is None else self._optimizer.state_dict()

    def _weights_state(self) -> dict[str, torch.Tensor]:
        if self.lora:
            return {n: p.detach().cpu() for n, p in self.model.named_parameters() if p.requires_grad}
        return {n: t.detach().cpu() for n, t in self.model.state_dict().items()}

    def _save(self, path: str, extra: dict[str, Any]) -> str:
        rng = distributed.gather_to_main(_rng_state())
        if self._sharded or distributed.is_main():  # under FSDP every rank takes part in gathering
            weights, optimizer = self._training_state()
            snapshots = {
                k: {n: sharding.full_tensor(t.detach()).cpu() for n, t in v.items()} for k, v in self._snapshots.items()
            }
        if distributed.is_main():
            state = {"weights": weights, "optimizer": optimizer, "rng": rng, "snapshots": snapshots}
            meta = {
                "format": CHECKPOINT_FORMAT,
                "step": self.step,
                "extra": extra,
                "model": self.model_name,
                "lora": self.lora,
                "world_size": self.world_size,
            }
            _write_dir_atomically(path, lambda tmp: _write_checkpoint(tmp, state, meta))
        distributed.barrier()  # nobody reads the checkpoint before it is complete
        return path

    def _load(self, path: str) -> dict[str, Any]:
        meta_path = os.path.join(path, META_FILE)
        if not os.path.isfile(meta_path):
            raise FileNotFoundError(f"LocalBackend.load: no checkpoint at '{path}' (missing {META_FILE})")
        with open(meta_path) as f:
            meta = json.load(f)
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"LocalBackend.load: '{path}' has format {meta.get('format')}, expected {CHECKPOINT_FORMAT}")
        if bool(meta.get("lora")) != bool(self.lora):
            kind = "a LoRA adapter" if meta.get("lora") else "full weights"
            raise ValueError(f"LocalBackend.load: '{path}' holds {kind}; configure lora to match ({meta.get('lora')})")
        state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=True)
        self._load_weights(state["weights"])
        if self._vllm is not None:  # same policy version, other weights: the engine must reload
            self._vllm.invalidate()
        if state["optimizer"] is None:
            self._optimizer = None
        elif self._sharded:
            names = [n for n, _ in self._trainable_named]
            sharding.load_optimizer(self.model, self._get_optimizer(), state["optimizer"], names)
        else:
            self._get_optimizer().load_state_dict(state["optimizer"])
        params = dict(self._trainable_named)  # a snapshot is laid out (sharded or not) like its parameter
        saved = state.get("snapshots") or {}
        self._snapshots = {k: {n: sharding.shard_like(t, params[n]) for n, t in v.items()} for k, v in saved.items()}
        self.step = int(meta["step"])
        rngs = state["rng"]
        _set_rng_state(rngs[self.rank] if self.rank < len(rngs) else rngs[0])
        return dict(meta.get("extra") or {})

    def _load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        missing = [n for n, _ in self._trainable_named if n not in weights] if self.lora else []
        if missing:
            raise ValueError(f"LocalBackend.load: the checkpoint lacks adapter tensors {missing[:3]}... (lora config differs?)")
        if self._sharded:
            sharding.load_weights(self.model, weights, bool(self.lora))
            return
        if not self.lora:
            self.model.load_state_dict(weights)
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)

    def _export(self, path: str, adapter: bool) -> str:
        model = self._whole_policy() if self._sharded else self.model
        if distributed.is_main():
            from tempering.export import write_pretrained

            write_pretrained(model, self.tokenizer, path, merge=bool(self.lora) and not adapter, keep=not self._sharded)
        distributed.barrier()
        return path

    def _whole_policy(self) -> Any:
        """Under FSDP: an unsharded copy of the policy on rank 0's CPU (``None`` on the other
        ranks), rebuilt from the source with the gathered trainable weights. Every rank calls it."""
        weights, _ = self._training_state()
        if not distributed.is_main():
            return None
        model, _ = self._build_base(torch.device("cpu"))
        model.generation_config = self._neutral_generation_config()
        if self.lora:
            model = _apply_lora(model, self.lora, self.seed)
        model.load_state_dict(weights, strict=not self.lora)
        return model


# ---------------------------------------------------------------------- sampling clients
class LocalSamplingClient:
    """A sampler of one frozen weight snapshot (see :meth:`LocalBackend.sampling_client`).

    ``sample`` has the backend's signature and conventions; completions carry
    ``policy_version``, the optimizer step the snapshot was taken at. Holding a client keeps
    its snapshot (a copy of the trainable weights) alive; drop old clients to free them.
    """

    def __init__(self, backend: LocalBackend, weights: dict[str, torch.Tensor], policy_version: int) -> None:
        self._backend = backend
        self.weights = weights
        self.policy_version = int(policy_version)
        self.tokenizer = backend.tokenizer

    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        return self._backend._submit_sampler(
            self._backend._sample_snapshot, self, [list(p) for p in prompts], num_samples, params
        )

    def __repr__(self) -> str:
        return f"LocalSamplingClient(policy_version={self.policy_version})"


# ---------------------------------------------------------------------- sampling helpers
class _SampledLogprobs(LogitsProcessor):
    """Records the log-probability of each sampled token under the final scores.

    Runs last in the processor list (after our temperature/top-k/top-p warpers, which HF's
    own are switched off for), so what it sees is the distribution the token is drawn from.
    The token drawn at step t is only known at step t+1 (it is then ``input_ids[:, -1]``), so
    one step's log-softmax is kept: memory stays O(batch x vocab), unlike ``output_scores``.
    """

    def __init__(self) -> None:
        self.columns: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self.columns.append(self._pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def result(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``(B, n)`` logprobs of ``new_tokens`` (``generate`` may have undone extra steps)."""
        n = new_tokens.shape[1]
        cols = self.columns[:n]
        if len(cols) < n and self._pending is not None:
            cols.append(self._pending.gather(-1, new_tokens[:, len(cols) : len(cols) + 1]).squeeze(-1))
        if not cols:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(cols, dim=1).cpu()


class _StopStrings(StoppingCriteria):
    """Stops a row when its *completion* (never the prompt) contains a stop string.

    HF's ``stop_strings`` also match across the prompt boundary; this one decodes only a
    trailing window of generated tokens each step and records when each row stopped, which is
    where the completion is cut afterwards.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_width: int, batch_size: int) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.prompt_width = prompt_width
        self.window = 4 * max(len(s) for s in self.stops) + 4  # a character may take up to 4 byte-tokens
        self.done_at: list[int | None] = [None] * batch_size

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_width :]
        n = generated.shape[1]
        open_rows = [i for i, d in enumerate(self.done_at) if d is None]
        if open_rows and n:
            tails = generated[open_rows, -self.window :].tolist()
            texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
            for i, text in zip(open_rows, texts):
                if any(s in text for s in self.stops):
                    self.done_at[i] = n
        done = [d is not None for d in self.done_at]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def _warpers(params: SamplingParams) -> list[LogitsProcessor]:
    """Temperature, then top-k, then top-p (HF's and vLLM's order); none for greedy."""
    if params.temperature <= 0:
        return []
    out: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k and params.top_k > 0:
        out.append(TopKLogitsWarper(top_k=int(params.top_k)))
    if params.top_p is not None and params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(params.top_p)))
    return out


def _cut_point(tokens: list[int], eos: set[int], string_end: int | None) -> tuple[int | None, bool]:
    """Length to keep (eos / stop token included) and whether a stop *string* ended it."""
    eos_end = next((j + 1 for j, t in enumerate(tokens) if t in eos), None)
    if string_end is not None and (eos_end is None or string_end < eos_end):
        return string_end, True
    return eos_end, False


def _left_pad(rows: list[list[int]], pad_id: int, device: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding so every row's next token is in the last column, as ``generate`` needs."""
    width = max(len(r) for r in rows)
    ids = [[pad_id] * (width - len(r)) + r for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Sample from a private RNG seeded with ``seed`` (leaving the global stream alone), or
    from the global stream (which checkpoints save) when ``seed`` is None."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        yield


# ---------------------------------------------------------------------- model helpers
def _special_ids(model: Any, tokenizer: Any) -> tuple[int, set[int]]:
    """Pad id (eos when the tokenizer has none) and every id that ends a completion."""
    eos: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif source is not None:
            eos.update(int(t) for t in source)
    if not eos:
        raise ValueError("LocalBackend: the tokenizer has no eos token; completions could never stop")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return int(pad), eos


def _apply_lora(model: Any, cfg: Mapping[str, Any], seed: int) -> Any:
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=int(cfg["rank"]),
        lora_alpha=float(cfg["alpha"]),
        lora_dropout=float(cfg["dropout"]),
        target_modules=cfg["target_modules"],
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21 calls a transformers-5 deprecated alias; the warning is not actionable here.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def _fingerprint(model: Any) -> list[float]:
    """A cheap checksum of up to 8 parameter tensors spread over the model."""
    params = list(model.parameters())
    picked = params[:: max(1, len(params) // 8)]
    with torch.no_grad():
        return [float(p.detach().reshape(-1)[:65536].double().sum()) for p in picked]


# ---------------------------------------------------------------------- config helpers
def _check_lora(lora: Any, path: str) -> dict[str, Any] | None:
    """The ``lora:`` block with defaults filled in (``None``: full fine-tuning)."""
    from tempering.registry import validate_params

    if lora is None:
        return None
    if not isinstance(lora, Mapping):
        raise ConfigError(f"expected a mapping such as {{rank: 8}} (or null for full fine-tuning), got {lora!r}", path)
    cfg = dataclasses.asdict(LoraParams(**validate_params(LoraParams, lora, path)))
    if cfg["rank"] < 1:
        raise ConfigError(f"must be >= 1, got {cfg['rank']}", f"{path}.rank")
    tm = cfg["target_modules"]
    cfg["target_modules"] = tm if isinstance(tm, str) else [str(m) for m in tm]
    return cfg


def _resolve_dtype(name: str, path: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}'; choose one of {', '.join(sorted(DTYPES))}", path)
    return DTYPES[name]


def _resolve_device(name: str, path: str) -> torch.device:
    """``auto`` picks CUDA when present; under torchrun a bare ``cuda`` is the local GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.world_size() > 1:
        name = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"invalid device '{name}' ({err}); use cpu, cuda, cuda:N or auto", path) from err


# ---------------------------------------------------------------------- RNG and files
def _seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)


def _rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, in a form ``torch.load(weights_only=True)`` accepts."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    with contextlib.suppress(ImportError):
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))


def _write_checkpoint(directory: str, state: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    torch.save(dict(state), os.path.join(directory, STATE_FILE))
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def _write_dir_atomically(path: str, write: Callable[[str], None]) -> None:
    """Fill a temporary sibling directory, then swap it in: a crash mid-save never leaves a
    half-written checkpoint where a resume would look for one."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
