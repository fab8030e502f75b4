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

``LocalBackend`` is a facade: it checks its settings (:mod:`.config`), builds the policy
(:mod:`.building`) and hands each call to the module that does it -- sampling
(:mod:`.generation`, or :mod:`.vllm_engine`), the weights it scores with (:mod:`.weights`:
snapshots, EMA, reference), scoring and training (:mod:`.training`), checkpoints and export
(:mod:`.checkpoint`) -- on its worker thread.

This module imports torch and transformers at the top: the registry refers to it by a lazy
``"module:attr"`` string, so it is only imported when a local backend is actually built.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ClassVar, TypeVar

import torch

import tempering.plugins.backends.local.checkpoint as checkpoint
import tempering.plugins.backends.local.config as config
import tempering.plugins.backends.local.distributed as distributed
import tempering.plugins.backends.local.memory as memory
import tempering.plugins.backends.local.sharding as sharding
from tempering.errors import ConfigError
from tempering.interfaces import Loss
from tempering.plugins.backends.common import checked_extra, run_on
from tempering.plugins.backends.local.building import (
    ModelSource,
    apply_lora,
    enable_gradient_checkpointing,
    fingerprint,
    neutral_generation_config,
    special_ids,
)
from tempering.plugins.backends.local.config import DEFAULT_MODEL, LoraParams
from tempering.plugins.backends.local.generation import (
    Generator,
    LocalSamplingClient,
    SamplerCopy,
    check_request,
)
from tempering.plugins.backends.local.training import Trainer
from tempering.plugins.backends.local.vllm_engine import VllmEngine, check_engine, resolve_engine
from tempering.plugins.backends.local.weights import PolicyWeights
from tempering.schema import Problem, check_config_at
from tempering.training.progress import phase
from tempering.types import AdamParams, Batch, Completion, SamplingParams

__all__ = ["LocalBackend", "LocalSamplingClient", "LoraParams", "DEFAULT_MODEL"]

T = TypeVar("T")


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
        engine: what ``sample`` and sampling clients generate with: ``generate`` (transformers),
            ``vllm`` (an optional extra, colocated in this process, under torchrun too;
            :mod:`~tempering.plugins.backends.local.vllm_engine`) or ``auto`` (vLLM where it is
            installed and the device is a GPU, else ``generate``; :attr:`engine_choice` says which
            and why).
        vllm: the vLLM engine's settings (:class:`~tempering.plugins.backends.local.vllm_engine.VllmParams`).
        gradient_checkpointing: keep only each decoder layer's input through the forward and
            recompute the rest in backward (transformers' own, non-reentrant). A training
            forward's activations are most of a long-episode step's memory: SmolLM2, 16 rows x
            400 tokens, peak 9.8 GB -> 2.6 GB, for about one more forward of time. Off by default.
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
        engine: str = "auto",
        vllm: Mapping[str, Any] | None = None,
        gradient_checkpointing: bool = False,
        model_builder: Callable[..., tuple[Any, Any]] | None = None,
    ) -> None:
        settings = {
            "model": model,
            "model_kwargs": model_kwargs,
            "lora": lora,
            "seed": seed,
            "device": device,
            "dtype": dtype,
            "parallel": parallel,
            "sample_batch_size": sample_batch_size,
            "num_threads": num_threads,
            "threaded": threaded,
            "engine": engine,
            "vllm": vllm,
            "gradient_checkpointing": gradient_checkpointing,
            "model_builder": model_builder,
        }
        check_config_at(type(self), settings, "backend")  # what the registry checks, for a direct build
        memory.fix_mmap_threshold()  # freed activations go back to the system (see memory.py)
        if num_threads > 0:
            torch.set_num_threads(num_threads)
        self.model_name = model
        self.model_kwargs = dict(model_kwargs or {})
        self.lora = config.check_lora(lora, "backend.lora")
        self.seed = int(seed)
        self.rank = distributed.rank()
        self.world_size = distributed.world_size()
        self.device = config.resolve_device(device, "backend.device")
        self.dtype = config.resolve_dtype(dtype, "backend.dtype")
        self.sample_batch_size = sample_batch_size
        self.step = 0

        self._source = ModelSource(
            self.model_name, self.model_kwargs, self.seed, self.dtype, self.device, model_builder
        )
        loaded = self._source.build()
        base, self.tokenizer = loaded.model, loaded.tokenizer
        #: the renderer the model declares (tempering.interfaces.DeclaresRenderer): `renderer: auto`
        self.model_renderer: str | None = loaded.renderer
        self.pad_token_id, self.eos_token_ids = special_ids(base, self.tokenizer)
        base.generation_config = neutral_generation_config(self.tokenizer, self.pad_token_id, self.eos_token_ids)
        self.model = apply_lora(base, self.lora, self.seed) if self.lora else base
        if gradient_checkpointing:
            enable_gradient_checkpointing(self.model, "backend.gradient_checkpointing")
        # one starting point even for unseeded builders
        distributed.broadcast_([p for p in self.model.parameters() if p.requires_grad])
        initial = None if self.lora else fingerprint(self.model)
        self._sharded = parallel == "fsdp" and self.world_size > 1
        if self._sharded:  # FSDP2: parameters become DTensors, so the weights list them after this
            sharding.shard_model(self.model, self.dtype)
        self._weights = PolicyWeights(
            self.model,
            bool(self.lora),
            self._sharded,
            self.dtype,
            lambda: self._source.build().model,
            initial,
            self.model_name,
        )
        self._trainer = Trainer(self._weights, self.pad_token_id, self.device, self.world_size)
        checkpoint.seed_everything(self.seed + self.rank)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="tempering-local") if threaded else None
        self._generator = Generator(
            self.tokenizer, self.pad_token_id, self.eos_token_ids, self.device, sample_batch_size
        )
        # The sampling engine of sampling_client(): a model copy and a thread, made on first use.
        self._sampling = SamplerCopy(threaded)
        self.engine_choice = resolve_engine(engine, device)
        if engine == "auto" and self.rank == 0:  # said at the run's start: which engine samples, and why
            phase(f"sampling with {self.engine_choice.engine} ({self.engine_choice.reason})")
        vllm_params = check_engine(engine, vllm, "backend", device)
        self._vllm = VllmEngine(self, vllm_params) if vllm_params is not None else None

    @staticmethod
    def resolved_values(settings: Mapping[str, Any]) -> dict[str, Any]:
        """What ``engine: auto`` picks for these settings (``tempering show --resolved``)."""
        if settings.get("engine", "auto") != "auto":
            return {}
        return {"engine": resolve_engine("auto", str(settings.get("device", "cpu"))).engine}

    @staticmethod
    def check_config(settings: Mapping[str, Any]) -> Iterator[Problem | None]:
        """Check what can be checked before a model is built or downloaded (``settings``: every
        key, the user's over the defaults).

        The registry runs this before building (``Registry.check`` / ``build``) and so does
        ``__init__``: ``lora``, ``dtype``, ``device``, ``parallel``, ``sample_batch_size``, the
        engine, and the model source (:func:`~tempering.plugins.backends.local.model_source.check_model`:
        a registered builder and its ``model_kwargs``, a saved-model folder, or a hub id), each
        problem a key relative to the backend (``lora.rank``). See :func:`.config.check_config`."""
        return config.check_config(settings)

    # ------------------------------------------------------------------ state the tests read
    @property
    def _trainable_named(self) -> list[tuple[str, torch.Tensor]]:
        return self._weights.named

    @property
    def _trainable(self) -> list[torch.Tensor]:
        return self._weights.tensors

    @property
    def _snapshots(self) -> dict[str, dict[str, torch.Tensor]]:
        return self._weights.snapshots

    @property
    def _optimizer(self) -> torch.optim.Optimizer | None:
        return self._trainer.optimizer

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

    def logprobs(self, batch: Batch, reference: bool = False, weights: str | None = None) -> Future[list[list[float]]]:
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
        key = str(name)

        def drop() -> None:
            self._snapshots.pop(key, None)

        return self._submit(drop)

    def snapshot_names(self) -> list[str]:
        """Names of the snapshots held (after all queued calls)."""
        return self._submit(lambda: sorted(self._snapshots)).result()

    def reference_logprobs(self, batch: Batch) -> Future[list[list[float]]]:
        """Same as ``logprobs(batch, reference=True)``."""
        return self.logprobs(batch, reference=True)

    def sampling_client(self, snapshot: str | None = None) -> Future[LocalSamplingClient]:
        """A sampler of a frozen snapshot of the current weights (Tinker's
        ``save_weights_and_get_sampling_client``), for sampling *while* training.

        The snapshot is taken on the worker thread after every call submitted before it (so
        after a queued ``optim_step``) and its completions carry that ``step`` as
        ``policy_version``. Its :meth:`LocalSamplingClient.sample` runs on a second thread with
        a second copy of the model (made on first use; with LoRA only the adapter differs
        between snapshots), so it never waits for, or touches, the training weights. A backend
        that never calls this behaves exactly as before. Sampling without ``params.seed`` draws
        from the process-global torch RNG, which training does not use.

        ``snapshot=NAME`` also keeps the client's weights as the snapshot ``NAME`` (score with
        ``weights=NAME``), sharing the client's tensors rather than copying them again.
        """
        if self._sharded:
            raise ConfigError(
                "asynchronous sampling (a sampling client on its own thread) cannot keep the ranks' "
                "forwards in lockstep; use parallel: ddp or a synchronous stage",
                "backend.parallel",
            )
        return self._submit(self._sampling_snapshot, snapshot)

    def forward_backward(self, batch: Batch, loss: Loss) -> Future[dict[str, float]]:
        """Add the gradients of ``loss`` on ``batch`` to the accumulated ones (until
        :meth:`optim_step`); returns the loss's metrics plus ``loss``."""
        return self._submit(self._forward_backward, batch, loss)

    def optim_step(self, params: AdamParams) -> Future[dict[str, float]]:
        """One AdamW step on the accumulated (rank-averaged) gradients, then clear them."""
        return self._submit(self._optim_step, params)

    def save(
        self, path: str, extra: Mapping[str, Any] | None = None, *, optimizer: bool = True, snapshots: bool = True
    ) -> str:
        """Write a checkpoint directory at ``path`` (after all queued calls); returns ``path``.

        Under torchrun every rank must call this (it gathers each rank's RNG state); rank 0
        alone writes. ``extra`` must be JSON-serialisable (e.g. the loop position).
        ``optimizer=False`` / ``snapshots=False`` leave the optimizer state / the snapshots out
        (weights to sample from; loading such a checkpoint starts a fresh optimizer).
        """
        payload = checked_extra(extra, "LocalBackend.save")
        return self._submit(self._save, str(path), payload, optimizer, snapshots).result()

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save`; returns its ``extra``."""
        return self._submit(self._load, str(path)).result()

    def export_pretrained(self, path: str, adapter: bool = False) -> str:
        """Write the policy in Hugging Face format plus the tokenizer, for use outside
        tempering (``AutoModelForCausalLM.from_pretrained(path)``): a LoRA policy merged into
        its base weights, or with ``adapter=True`` the peft adapter alone. Rank 0 only."""
        if adapter and not self.lora:
            raise ValueError(
                "export_pretrained(adapter=True): this backend trains every weight (no lora:), "
                "so there is no adapter; export the full model"
            )
        return self._submit(self._export, str(path), adapter).result()

    def close(self) -> None:
        """Finish queued calls and stop the worker threads."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._sampling.close()
        if self._vllm is not None:
            self._vllm.close()

    # ------------------------------------------------------------------ execution
    def _submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn`` on the worker thread (FIFO, so calls apply in submission order)."""
        return run_on(self._executor, fn, *args)

    # ------------------------------------------------------------------ on the worker thread
    # Each of these runs one call in submission order; the work is the named module's.
    def _snapshot(self, name: str) -> None:
        self._weights.snapshot(name)

    def _ema_update(self, name: str, rate: float) -> None:
        self._weights.ema_update(name, rate)

    def _logprobs(self, batch: Batch, reference: bool, weights: str | None = None) -> list[list[float]]:
        return self._trainer.logprobs(batch, reference, weights)

    def _distributions(self, batch: Batch, reference: bool, weights: str | None, topk: int | None) -> list[Any]:
        return self._trainer.distributions(batch, reference, weights, topk)

    def _forward_backward(self, batch: Batch, loss: Loss) -> dict[str, float]:
        if self._vllm is not None:  # sleep mode: the engine's memory goes to training until the next sample
            self._vllm.release()
        return self._trainer.forward_backward(batch, loss)

    def _optim_step(self, params: AdamParams) -> dict[str, float]:
        metrics = self._trainer.optim_step(params)
        self.step += 1
        return metrics

    def _save(self, path: str, extra: dict[str, Any], optimizer: bool = True, snapshots: bool = True) -> str:
        return checkpoint.save(
            path,
            self._weights,
            self._trainer,
            step=self.step,
            extra=extra,
            model=self.model_name,
            lora=self.lora,
            world_size=self.world_size,
            optimizer_state=optimizer,
            snapshots_state=snapshots,
        )

    def _load(self, path: str) -> dict[str, Any]:
        meta = checkpoint.load(path, self._weights, self._trainer)
        if self._vllm is not None:  # same policy version, other weights: the engine must reload
            self._vllm.invalidate()
        self.step = int(meta["step"])
        return dict(meta.get("extra") or {})

    def _export(self, path: str, adapter: bool) -> str:
        return checkpoint.export(path, adapter, self._weights, self._trainer, self.tokenizer, self._policy_copy)

    def _policy_copy(self) -> Any:
        """A fresh unsharded policy on the CPU (weights to be loaded into it): what an export
        under FSDP writes."""
        model, _ = self._source.build(torch.device("cpu"))
        model.generation_config = neutral_generation_config(self.tokenizer, self.pad_token_id, self.eos_token_ids)
        if self.lora:
            model = apply_lora(model, self.lora, self.seed)
        return model

    # ------------------------------------------------------------------ sampling
    def _sample(
        self,
        prompts: list[list[int]],
        num_samples: int,
        params: SamplingParams,
        model: torch.nn.Module | None = None,
        version: int | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> list[list[Completion]]:
        """Sample with ``model`` (default: the policy) and stamp ``version`` (default: ``step``);
        a vLLM engine samples with ``weights`` (default: the policy's trainable tensors)."""
        model = self.model if model is None else model
        version = self.step if version is None else version
        check_request(prompts, num_samples)
        if self._vllm is not None:
            return self._vllm.sample(prompts, num_samples, params, weights or dict(self._trainable_named), version)
        return self._generator.sample(model, prompts, num_samples, params, version)

    def _sampling_snapshot(self, snapshot: str | None = None) -> LocalSamplingClient:
        """On the worker thread: copy the trainable weights (kept as snapshot ``snapshot`` too,
        the same tensors: neither is ever written in place) and make sure the sampling engine
        (a model copy and its thread) exists."""
        self._sampling.prepare(self.model, copy_model=self._vllm is None)  # a vLLM engine holds its own copy
        weights = self._weights.copy()
        if snapshot is not None:
            self._weights.snapshots[snapshot] = weights
        return LocalSamplingClient(self, weights, self.step)

    def _submit_sampler(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn`` on the sampling thread (FIFO), or inline when the backend is unthreaded."""
        return self._sampling.submit(fn, *args)

    def _sample_snapshot(
        self, client: LocalSamplingClient, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> list[list[Completion]]:
        """On the sampling thread: sample with ``client``'s weights in the sampling model (a vLLM
        engine is handed the weights instead)."""
        if self._vllm is not None:
            return self._sample(prompts, num_samples, params, version=client.policy_version, weights=client.weights)
        model = self._sampling.holding(client)
        return self._sample(prompts, num_samples, params, model=model, version=client.policy_version)
