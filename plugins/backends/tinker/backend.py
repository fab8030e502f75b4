"""The Tinker backend: LocalBackend's primitives on Tinker's service, through the official SDK.

One object owns a LoRA ``TrainingClient`` (created on first use, or restored from a checkpoint),
the ``SamplingClient`` of its current weights, a base-model ``SamplingClient`` for
``reference=True`` and one ``SamplingClient`` per named weight snapshot. Every call returns a
:class:`concurrent.futures.Future`, like :class:`~tempering.plugins.backends.local.LocalBackend`.

Choices (see docs/tinker.md for the reasoning):

* **Ordering.** Training calls (``forward_backward``, ``optim_step``, ``logprobs`` via the
  trainer, ``snapshot``, ``save``) are *submitted* to the SDK in the caller's thread, at once and
  in call order, and the SDK runs them in submission order on the service. So
  ``forward_backward`` then ``optim_step`` go out back to back; their results are awaited
  together when the caller reads the futures.
* **Sampling** uses the sampling client of the weights after the latest optimizer step. It is
  refreshed (``save_weights_and_get_sampling_client``) when ``sample`` is next called after
  ``sampler_refresh_every`` steps, so a stage that never samples (SFT without evaluation) pays
  nothing; ``Completion.policy_version`` is the step of the weights actually sampled from.
* **Logprobs.** ``logprobs(batch)`` runs a forward pass of the trainer (``forward`` with
  ``cross_entropy``: the same numerics as training, so an on-policy ratio is exactly 1);
  ``policy_logprobs: sampler`` scores with the sampling client instead. ``reference=True``
  scores with a sampling client of the *base model* (a LoRA adapter starts at zero, so the base
  model is the initial policy); ``weights=NAME`` with the sampling client of a snapshot.
* **Losses** map onto Tinker's built-ins where that is exact, else ``forward_backward_custom``
  (:mod:`tempering.plugins.backends.tinker.mapping`).
* **Retries.** Sampling and sampling-client scoring are idempotent and retried with
  exponential backoff on rate limits, timeouts, connection errors and 5xx. Training-client calls
  are never retried here (the SDK already retries their submission; after that the service may
  have applied them): a failure raises :class:`TinkerTrainingError`, and the fix is to resume
  from the last checkpoint.
* **Checkpoints.** ``save(path, extra)`` calls ``save_state`` and writes the returned
  ``tinker://`` path, the step, the snapshot paths and ``extra`` to ``path/tinker_checkpoint.json``
  (plus an index keyed by the tinker path, so ``load("tinker://...")`` finds ``extra`` too).
  ``load`` creates a training client from that state *with* optimizer state
  (``create_training_client_from_state_with_optimizer``: the SDK's replacement for the
  deprecated ``TrainingClient.load_state``).

This module imports torch but not the Tinker SDK at import time; the SDK is imported when a
backend is built, with a clear message if the ``tinker`` extra is missing.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tempering.errors import ConfigError, TemperingError
from tempering.plugins.backends.tinker.errors import (
    INSTALL_HINT,
    KEY_HINT,
    TinkerAuthError,
    TinkerBackendError,
    TinkerNotInstalledError,
    TinkerServiceError,
    TinkerTrainingError,
    one_line,
)
from tempering.plugins.backends.tinker.mapping import LossPlan, plan_loss, to_tinker_data
from tempering.types import AdamParams, Batch, Completion, SamplingParams

T = TypeVar("T")

CHECKPOINT_FILE = "tinker_checkpoint.json"
CHECKPOINT_FORMAT = 1
POLICY_LOGPROBS = ("trainer", "sampler")
#: Keys of the local backend that mean nothing on Tinker. Accepted (with one warning) so that a
#: recipe switches backends by ``backend.name`` alone; ``model`` and ``lora.rank`` do carry over.
LOCAL_ONLY_KEYS = ("model_kwargs", "device", "dtype", "sample_batch_size", "num_threads", "threaded")


def _default_service_client(base_url: str | None = None, api_key: str | None = None) -> Any:
    tinker = _sdk()
    return tinker.ServiceClient(base_url=base_url, api_key=api_key)


#: Builds the ``tinker.ServiceClient`` (called with ``base_url=`` and ``api_key=``). Tests and
#: embedders replace it (e.g. ``monkeypatch.setattr(backend_module, "service_client_factory",
#: fake)``) to run a recipe against an in-process fake of the service; a ``service_client``
#: passed to :class:`TinkerBackend` wins over it.
service_client_factory: Callable[..., Any] = _default_service_client


def _sdk() -> Any:
    """The ``tinker`` module, or a one-line error naming the extra to install."""
    try:
        import tinker
    except ImportError as err:
        raise TinkerNotInstalledError(
            f"the Tinker backend needs the Tinker SDK, which is not installed ({err}): {INSTALL_HINT}"
        ) from err
    return tinker


@dataclass
class _Snapshot:
    """A named copy of the weights: sampler weights on the service, scored through a sampling
    client created on first use."""

    name: str
    step: int
    save: Any = None  # SDK future of SaveWeightsForSamplerResponse (None when restored)
    path: str | None = None
    client: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class TinkerBackend:
    """Train a LoRA adapter of ``base_model`` on Tinker; same primitives as the local backend.

    Args:
        base_model: a Tinker model name, e.g. ``Qwen/Qwen3-4B-Instruct-2507`` or
            ``meta-llama/Llama-3.2-1B`` (``tinker model list`` shows yours).
        model: the local backend's key; used as ``base_model`` when that is not set, so a
            recipe whose local model is a hub name runs on Tinker with ``backend.name=tinker``.
        rank: LoRA rank (default: ``lora.rank`` if given, else 32).
        base_url / api_key: the service and key; default ``TINKER_BASE_URL`` / ``TINKER_API_KEY``
            (or the SDK's stored credentials, ``tinker auth login``).
        seed: LoRA initialisation seed.
        sampler_refresh_every: refresh the sampling client (``save_weights_and_get_sampling_client``)
            once this many optimizer steps have passed since the last refresh (1 = sample every
            step from the newest weights).
        policy_logprobs: ``trainer`` (forward pass of the trainer, default) or ``sampler``
            (the current sampling client; retried, but sampler numerics and possibly stale).
        max_retries / retry_backoff / retry_max_backoff: retries of idempotent calls (sampling,
            sampling-client scoring): up to ``max_retries`` more attempts, waiting
            ``retry_backoff * 2**attempt`` seconds (jittered, capped at ``retry_max_backoff``).
        train_mlp / train_attn / train_unembed: which LoRA targets to train.
        tokenizer: a Hugging Face name or path to load the tokenizer from instead of asking the
            training client (which downloads the base model's tokenizer).
        init_state: a ``tinker://`` state path to start from (weights and optimizer state).
        checkpoint_ttl_seconds / snapshot_ttl_seconds: expiry of saved states / snapshot weights.
        checkpoint_index_dir: where ``save`` indexes checkpoints by tinker path (default
            ``~/.cache/tempering/tinker``).
        concurrency: worker threads that wait on the service (sampling many prompts at once).
        lora: the local backend's LoRA block; only ``rank`` is used.
        model_kwargs, device, dtype, sample_batch_size, num_threads, threaded: local-backend keys,
            accepted and ignored (with a warning) so one recipe runs on both backends.
        service_client: a runtime ``tinker.ServiceClient`` (or a fake of it); not a config key.
    """

    #: What this backend cannot do, for stages that want to fail before training: no weight
    #: averaging (``ema_update``), no full next-token distributions, no logits in losses.
    capabilities = {"ema_update": False, "full_distributions": False, "logits": False}

    def __init__(
        self,
        base_model: str | None = None,
        model: str | None = None,
        rank: int | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        seed: int | None = 0,
        sampler_refresh_every: int = 1,
        policy_logprobs: str = "trainer",
        max_retries: int = 5,
        retry_backoff: float = 1.0,
        retry_max_backoff: float = 30.0,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        tokenizer: str | None = None,
        init_state: str | None = None,
        checkpoint_ttl_seconds: int | None = None,
        snapshot_ttl_seconds: int | None = None,
        checkpoint_index_dir: str | None = None,
        concurrency: int = 16,
        lora: Mapping[str, Any] | None = None,
        model_kwargs: Mapping[str, Any] | None = None,
        device: str | None = None,
        dtype: str | None = None,
        sample_batch_size: int | None = None,
        num_threads: int | None = None,
        threaded: bool | None = None,
        service_client: Any = None,
    ) -> None:
        self._tinker = _sdk()
        ignored = [k for k, v in {"model_kwargs": model_kwargs, "device": device, "dtype": dtype,
                                  "sample_batch_size": sample_batch_size, "num_threads": num_threads,
                                  "threaded": threaded}.items() if v is not None]  # fmt: skip
        lora = dict(lora or {})
        ignored += [f"lora.{k}" for k in sorted(lora) if k != "rank"]
        if ignored:
            warnings.warn(f"backend 'tinker' ignores local-backend keys: {', '.join(ignored)}", UserWarning, stacklevel=2)
        if base_model is None and model is None:
            raise ConfigError(
                "set the Tinker model, e.g. base_model=Qwen/Qwen3-4B-Instruct-2507 "
                "(`tinker model list` lists the models you can use)",
                path="backend.base_model",
            )
        if base_model is not None and model is not None and model != base_model:
            warnings.warn(f"backend 'tinker' uses base_model={base_model!r}, not model={model!r}", UserWarning, stacklevel=2)
        self.base_model = str(base_model if base_model is not None else model)
        self.rank = int(rank if rank is not None else lora.get("rank", 32))
        if self.rank < 1:
            raise ConfigError(f"must be >= 1, got {self.rank}", path="backend.rank")
        if sampler_refresh_every < 1:
            raise ConfigError(f"must be >= 1, got {sampler_refresh_every}", path="backend.sampler_refresh_every")
        if policy_logprobs not in POLICY_LOGPROBS:
            raise ConfigError(f"use one of {POLICY_LOGPROBS}, got {policy_logprobs!r}", path="backend.policy_logprobs")
        if max_retries < 0 or retry_backoff < 0 or concurrency < 1:
            raise ConfigError("max_retries and retry_backoff must be >= 0, concurrency >= 1", path="backend")
        self.seed = seed
        self.sampler_refresh_every = int(sampler_refresh_every)
        self.policy_logprobs = policy_logprobs
        self.max_retries = int(max_retries)
        self.retry_backoff = float(retry_backoff)
        self.retry_max_backoff = float(retry_max_backoff)
        self.lora_targets = {"train_mlp": train_mlp, "train_attn": train_attn, "train_unembed": train_unembed}
        self.tokenizer_name = tokenizer
        self.init_state = init_state
        self.checkpoint_ttl_seconds = checkpoint_ttl_seconds
        self.snapshot_ttl_seconds = snapshot_ttl_seconds
        self.checkpoint_index_dir = checkpoint_index_dir or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tempering", "tinker"
        )
        if isinstance(service_client, (str, Mapping)):
            raise ConfigError("a runtime object (a tinker.ServiceClient), not a config key", path="backend.service_client")
        if service_client is None:
            _check_api_key(api_key)
            service_client = service_client_factory(base_url=base_url, api_key=api_key)
            self._owns_service = True
        else:
            self._owns_service = False
        self.service = service_client
        self.step = 0
        self.retry_count = 0
        self.last_plan: LossPlan | None = None
        self._lock = threading.RLock()  # orders submissions to the training client
        self._training: Any = None
        self._tokenizer: Any = None
        self._eos_ids: list[int] | None = None
        self._sampler: Any = None  # SDK future of the current SamplingClient
        self._sampler_version = 0
        self._base_sampler: Any = None
        self._snapshots: dict[str, _Snapshot] = {}
        self._snapshot_counter = 0
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="tempering-tinker")

    # ------------------------------------------------------------------ clients
    @property
    def training_client(self) -> Any:
        """The LoRA training client, created on first use (or by :meth:`load`)."""
        with self._lock:
            if self._training is None:
                if self.init_state:
                    fut = self.service.create_training_client_from_state_with_optimizer(self.init_state)
                    self._training = self._wait(fut, f"create the training client from {self.init_state}")
                else:
                    fut = self.service.create_lora_training_client(
                        base_model=self.base_model, rank=self.rank, seed=self.seed, **self.lora_targets
                    )
                    try:
                        self._training = self._wait(fut, f"create a LoRA training client for {self.base_model!r}")
                    except TinkerServiceError as err:
                        if "/" in self.base_model:
                            raise
                        raise TinkerServiceError(
                            f"{err}; {self.base_model!r} is not a Tinker model name: set backend.base_model, e.g. "
                            "Qwen/Qwen3-4B-Instruct-2507 (`tinker model list` lists yours)"
                        ) from err
            return self._training

    @property
    def tokenizer(self) -> Any:
        """The base model's tokenizer (from the training client, or ``tokenizer`` if set)."""
        if self._tokenizer is None:
            if self.tokenizer_name:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_name)
            else:
                client = self.training_client
                try:
                    self._tokenizer = client.get_tokenizer()
                except Exception as err:  # noqa: BLE001 - e.g. no access to the Hugging Face hub
                    raise TinkerBackendError(
                        f"could not load the tokenizer of {self.base_model!r} ({one_line(err)}); set backend.tokenizer "
                        "to a local path or hub name of the same tokenizer"
                    ) from err
        return self._tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        if self._eos_ids is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            self._eos_ids = [int(eos)] if isinstance(eos, int) else [int(t) for t in (eos or [])]
        return self._eos_ids

    def _live_sampler(self) -> tuple[Any, int]:
        """The sampling client of the newest weights (refreshed when stale) and their step."""
        with self._lock:
            if self._sampler is None or self.step - self._sampler_version >= self.sampler_refresh_every:
                self._sampler = self.training_client.save_weights_and_get_sampling_client()
                self._sampler_version = self.step
            return self._sampler, self._sampler_version

    def _reference_sampler(self) -> Any:
        with self._lock:
            if self._base_sampler is None:
                self._base_sampler = self.service.create_sampling_client(base_model=self.base_model)
            return self._base_sampler

    def _snapshot_client(self, name: str) -> Callable[[], Any]:
        with self._lock:
            if name not in self._snapshots:
                raise KeyError(f"TinkerBackend: no weight snapshot named '{name}' (have: {sorted(self._snapshots)})")
            snap = self._snapshots[name]

        def get() -> Any:
            with snap.lock:
                if snap.client is None:
                    path = self._snapshot_path(snap)
                    fut = self.service.create_sampling_client(model_path=path)
                    snap.client = self._wait(fut, f"create a sampling client for snapshot '{name}'")
                return snap.client

        return get

    def _snapshot_path(self, snap: _Snapshot) -> str:
        if snap.path is None:
            snap.path = str(self._wait(snap.save, f"save snapshot '{snap.name}'", training=True).path)
        return snap.path

    # ------------------------------------------------------------------ sampling
    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        """``num_samples`` completions per prompt from the newest weights (one SDK request per
        prompt, all in flight at once; each retried on rate limits / timeouts / 5xx)."""
        sampler, version = self._live_sampler()
        return self._sample_with(sampler, version, prompts, num_samples, params)

    def sampling_client(self) -> Future[TinkerSamplingClient]:
        """A sampler of the current weights (``save_weights_and_get_sampling_client``, queued
        after the training calls already submitted, e.g. an ``optim_step``), for sampling while
        training (asynchronous RL). Its completions carry the step it was taken at as
        ``policy_version``; it also becomes the sampler :meth:`sample` uses."""
        with self._lock:
            sdk_future = self.training_client.save_weights_and_get_sampling_client()
            version = self.step
            self._sampler, self._sampler_version = sdk_future, version

        def ready() -> TinkerSamplingClient:
            self._wait(sdk_future, "save weights for a sampling client", training=True)
            return TinkerSamplingClient(self, sdk_future, version)

        return self._spawn(ready)

    def _sample_with(self, sampler: Any, version: int, prompts: list[list[int]], num_samples: int,
                     params: SamplingParams) -> Future[list[list[Completion]]]:  # fmt: skip
        prompts = [list(p) for p in prompts]
        if num_samples < 1:
            raise ValueError(f"sample: num_samples must be >= 1, got {num_samples}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"sample: prompt {i} is empty; encode it with a BOS token or some text")
        if params.max_tokens <= 0:
            done: Future[list[list[Completion]]] = Future()
            done.set_result([[Completion(p, [], [], "length", "", version, params.temperature) for _ in range(num_samples)]
                             for p in prompts])  # fmt: skip
            return done
        tinker_params = self.sampling_params(params)
        return self._spawn(self._sample, sampler, version, prompts, num_samples, params, tinker_params)

    def sampling_params(self, params: SamplingParams) -> Any:
        """Ours -> ``tinker.types.SamplingParams``. An empty ``stop`` becomes ``None`` (the
        service's implicit EOS stop; ``[]`` would disable EOS); token-id stops get the EOS ids
        added, so EOS always stops a completion, as on the local backend. ``top_k=0`` -> -1."""
        items = [params.stop] if isinstance(params.stop, (str, int)) else list(params.stop or [])
        strings = [s for s in items if isinstance(s, str)]
        ids = [int(s) for s in items if not isinstance(s, str)]
        if strings and ids:
            raise ValueError("SamplingParams.stop: Tinker takes stop strings or stop token ids, not both")
        if any(s == "" for s in strings):
            raise ValueError("SamplingParams.stop: empty stop string")
        stop: Any = None
        if strings:
            stop = strings
        elif ids:
            stop = ids + [e for e in self.eos_token_ids if e not in ids]
        return self._tinker.types.SamplingParams(
            max_tokens=int(params.max_tokens),
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            top_k=int(params.top_k) if params.top_k and params.top_k > 0 else -1,
            stop=stop,
            seed=params.seed,
        )

    def _sample(self, sampler: Any, version: int, prompts: list[list[int]], n: int,
                params: SamplingParams, tinker_params: Any) -> list[list[Completion]]:  # fmt: skip
        client = self._wait(sampler, "refresh the sampling client", training=True)
        types = self._tinker.types

        def submit(p: list[int]) -> Any:
            return client.sample(prompt=types.ModelInput.from_ints(p), num_samples=n, sampling_params=tinker_params)

        futures = [self._try_submit(submit, p) for p in prompts]
        out = []
        for p, fut in zip(prompts, futures):
            response = self._result_with_retry("sample", fut, lambda p=p: submit(p))
            seqs = list(response.sequences)
            if len(seqs) != n:
                raise TinkerServiceError(f"sample: asked for {n} samples of a prompt, Tinker returned {len(seqs)}")
            out.append([self._completion(client, p, s, params, version) for s in seqs])
        return out

    def _completion(self, client: Any, prompt: list[int], seq: Any, params: SamplingParams, version: int) -> Completion:
        tokens = [int(t) for t in seq.tokens]
        lps = seq.logprobs
        if lps is None:  # not returned: score the completion with the same sampler
            lps = self._score_rows(lambda: client, [prompt + tokens], [len(tokens)], "sample logprobs")[0] if tokens else []
        lps = [float(x) for x in lps]
        if len(lps) != len(tokens):
            raise TinkerServiceError(f"sample: Tinker returned {len(lps)} logprobs for {len(tokens)} tokens")
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        stops = [s for s in (params.stop or []) if isinstance(s, str)] if not isinstance(params.stop, str) else [params.stop]
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            text = text[: min(hits)]
        reason = "stop" if str(seq.stop_reason) == "stop" else "length"
        return Completion(list(prompt), tokens, lps, reason, text, version, params.temperature)

    # ------------------------------------------------------------------ scoring
    def logprobs(self, batch: Batch, reference: bool = False, weights: str | None = None) -> Future[list[list[float]]]:
        """Per-target-token logprobs of each row (no gradients): the trainer's forward pass
        (default), the base model (``reference=True``) or a snapshot (``weights=NAME``)."""
        if reference and weights is not None:
            raise ValueError("logprobs: pass reference=True or weights=NAME, not both")
        if weights is not None:
            return self._spawn(self._score_batch, self._snapshot_client(str(weights)), batch, f"logprobs(weights={weights!r})")
        if reference:
            ref = self._reference_sampler()
            return self._spawn(self._score_batch, lambda: self._wait(ref, "create the base-model sampling client"), batch, "logprobs(reference=True)")
        if self.policy_logprobs == "sampler":
            sampler, _ = self._live_sampler()
            return self._spawn(self._score_batch, lambda: self._wait(sampler, "refresh the sampling client", training=True), batch, "logprobs")
        types = self._tinker.types
        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(list(d.input_tokens)),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(_np(d.target_tokens, "int64")),
                    "weights": types.TensorData.from_numpy(_np(d.weights, "float32")),
                },
            )
            for d in batch.data
        ]
        with self._lock:
            fut = self.training_client.forward(data, "cross_entropy")
        return self._spawn(self._forward_logprobs, fut, batch)

    def reference_logprobs(self, batch: Batch) -> Future[list[list[float]]]:
        """Same as ``logprobs(batch, reference=True)``."""
        return self.logprobs(batch, reference=True)

    def _forward_logprobs(self, fut: Any, batch: Batch) -> list[list[float]]:
        out = self._wait(fut, "forward (logprobs)", training=True)
        rows = [_tensor_list(o["logprobs"]) for o in out.loss_fn_outputs]
        for d, row in zip(batch.data, rows):
            if len(row) != len(d.target_tokens):
                raise TinkerServiceError(f"logprobs: Tinker returned {len(row)} logprobs for {len(d.target_tokens)} targets")
        return rows

    def _score_batch(self, get_client: Callable[[], Any], batch: Batch, what: str) -> list[list[float]]:
        fulls, lengths = [], []
        for i, d in enumerate(batch.data):
            if list(d.input_tokens[1:]) != list(d.target_tokens[:-1]):
                raise ValueError(f"{what}: row {i} is not a shifted sequence (input_tokens[1:] != target_tokens[:-1])")
            fulls.append(list(d.input_tokens) + [int(d.target_tokens[-1])] if d.target_tokens else list(d.input_tokens))
            lengths.append(len(d.target_tokens))
        return self._score_rows(get_client, fulls, lengths, what)

    def _score_rows(self, get_client: Callable[[], Any], fulls: list[list[int]], lengths: list[int], what: str) -> list[list[float]]:
        """``compute_logprobs`` of each full sequence; the last ``lengths[i]`` values of row i."""
        client = get_client()
        types = self._tinker.types

        def submit(tokens: list[int]) -> Any:
            return client.compute_logprobs(types.ModelInput.from_ints(tokens))

        futures = [self._try_submit(submit, f) for f in fulls]
        out = []
        for full, n, fut in zip(fulls, lengths, futures):
            values = list(self._result_with_retry(what, fut, lambda f=full: submit(f)))
            if len(values) != len(full):
                raise TinkerServiceError(f"{what}: Tinker returned {len(values)} logprobs for a {len(full)}-token sequence")
            tail = values[len(values) - n :] if n else []
            if any(v is None for v in tail):
                raise TinkerServiceError(f"{what}: Tinker returned no logprob at some target positions")
            out.append([float(v) for v in tail])
        return out

    def distributions(
        self, batch: Batch, reference: bool = False, weights: str | None = None, topk: int | None = None
    ) -> Future[list[Any]]:
        """Top-``topk`` next-token logprobs at every target position: one ``(values, ids)`` pair
        of ``(T_i, K)`` tensors per row, descending (positions with fewer than K entries are
        padded with ``-inf`` / id 0). Tinker returns no full distributions, so ``topk`` is
        required. Scored by a sampling client (base model, snapshot, or the newest weights)."""
        if topk is None:
            raise NotImplementedError(
                "TinkerBackend.distributions: Tinker returns top-k prompt logprobs, not full next-token "
                "distributions; pass topk=K (e.g. SDFT topk_logits with topk_support: teacher), or use the local backend"
            )
        if topk < 1:
            raise ValueError(f"distributions: topk must be >= 1 (or None), got {topk}")
        if reference and weights is not None:
            raise ValueError("distributions: pass reference=True or weights=NAME, not both")
        if weights is not None:
            get = self._snapshot_client(str(weights))
        elif reference:
            ref = self._reference_sampler()
            get = lambda: self._wait(ref, "create the base-model sampling client")  # noqa: E731
        else:
            sampler, _ = self._live_sampler()
            get = lambda: self._wait(sampler, "refresh the sampling client", training=True)  # noqa: E731
        return self._spawn(self._topk_batch, get, batch, int(topk))

    def _topk_batch(self, get_client: Callable[[], Any], batch: Batch, k: int) -> list[Any]:
        client = get_client()
        types = self._tinker.types
        params = types.SamplingParams(max_tokens=1)

        def submit(tokens: list[int]) -> Any:
            return client.sample(prompt=types.ModelInput.from_ints(tokens), num_samples=1, sampling_params=params,
                                 include_prompt_logprobs=True, topk_prompt_logprobs=k)  # fmt: skip

        fulls = [list(d.input_tokens) + [int(d.target_tokens[-1])] for d in batch.data]
        futures = [self._try_submit(submit, f) for f in fulls]
        out = []
        for d, full, fut in zip(batch.data, fulls, futures):
            response = self._result_with_retry("distributions", fut, lambda f=full: submit(f))
            rows = list(response.topk_prompt_logprobs or [])
            if len(rows) != len(full):
                raise TinkerServiceError(f"distributions: Tinker returned top-k logprobs for {len(rows)} of {len(full)} positions")
            values = torch.full((len(d.target_tokens), k), float("-inf"))
            ids = torch.zeros((len(d.target_tokens), k), dtype=torch.long)
            for t, entries in enumerate(rows[1:]):  # position t + 1 predicts target t
                ranked = sorted(entries or [], key=lambda e: -e[1])[:k]
                for j, (tok, lp) in enumerate(ranked):
                    values[t, j], ids[t, j] = float(lp), int(tok)
            out.append((values, ids))
        return out

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, name: str) -> Future[None]:
        """Save the current weights for sampling under ``name`` (``save_weights_for_sampler``,
        queued after the training calls already submitted); score with ``weights=name``.
        Snapshots are recorded in checkpoints."""
        name = str(name)
        with self._lock:
            self._snapshot_counter += 1
            label = _safe_name(f"tempering-{name}-s{self.step}-{self._snapshot_counter}")
            fut = self.training_client.save_weights_for_sampler(label, ttl_seconds=self.snapshot_ttl_seconds)
            snap = _Snapshot(name, self.step, save=fut)
            self._snapshots[name] = snap
        return self._spawn(lambda: (self._snapshot_path(snap), None)[1])

    def ema_update(self, name: str, rate: float) -> Future[None]:
        """Not possible on Tinker: it cannot average weights on the service."""
        raise NotImplementedError(
            "TinkerBackend.ema_update: Tinker cannot average weights on the service, so EMA teachers are not available; "
            "use a frozen teacher (SDFT teacher: stage_start or base) or the live policy (teacher: live) on Tinker"
        )

    def drop_snapshot(self, name: str) -> Future[None]:
        """Forget a snapshot (its sampler weights stay on the service until their TTL)."""
        with self._lock:
            self._snapshots.pop(str(name), None)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def snapshot_names(self) -> list[str]:
        with self._lock:
            return sorted(self._snapshots)

    # ------------------------------------------------------------------ training
    def forward_backward(self, batch: Batch, loss: Any) -> Future[dict[str, float]]:
        """Accumulate the gradients of ``loss`` on ``batch`` on the service: a Tinker built-in
        when it is exact for ``loss``, else ``forward_backward_custom``. Returns the loss's own
        metrics (computed from the logprobs Tinker returns) plus ``loss``; never retried."""
        plan = plan_loss(loss, batch)
        data = to_tinker_data(batch, plan, self._tinker.types)
        tensors = batch.to_tensors()
        captured: dict[str, Any] = {}
        with self._lock:
            client = self.training_client
            if plan.custom:
                fut = client.forward_backward_custom(data, _custom_loss_fn(loss, tensors, captured))
            else:
                fut = client.forward_backward(data, plan.loss_fn, plan.loss_fn_config)
            self.last_plan = plan
        return self._spawn(self._finish_forward_backward, fut, plan, loss, tensors, captured)

    def _finish_forward_backward(self, fut: Any, plan: LossPlan, loss: Any, tensors: dict[str, Any],
                                 captured: dict[str, Any]) -> dict[str, float]:  # fmt: skip
        out = self._wait(fut, "forward_backward", training=True)
        server = dict(getattr(out, "metrics", None) or {})
        metrics: dict[str, float] = {}
        if plan.custom and "out" in captured:
            result = captured["out"]
        elif not getattr(loss, "needs_logits", False) and not plan.two_dimensional:
            rows = [torch.tensor(_tensor_list(o["logprobs"]), dtype=torch.float32) for o in out.loss_fn_outputs]
            width = tensors["weights"].shape[1]
            lp = torch.stack([torch.nn.functional.pad(r, (0, width - r.shape[0])) for r in rows])
            with torch.no_grad():
                result = loss(lp, tensors)
        else:
            result = None
        if result is not None:
            metrics.update(_float_metrics(getattr(result, "metrics", {}) or {}, type(loss).__name__))
            metrics["loss"] = float(result.loss.detach())
        elif "loss:sum" in server:
            metrics["loss"] = float(server["loss:sum"])
        if "loss:sum" in server:
            metrics["tinker/loss_sum"] = float(server["loss:sum"])
        metrics["tinker/custom_loss"] = float(plan.custom)
        return metrics

    def optim_step(self, params: AdamParams) -> Future[dict[str, float]]:
        """One Adam step on the service (submitted right away, after any queued
        forward_backward); the next ``sample`` refreshes the sampling client."""
        adam = self._tinker.types.AdamParams(
            learning_rate=float(params.learning_rate),
            beta1=float(params.beta1),
            beta2=float(params.beta2),
            eps=float(params.eps),
            weight_decay=float(params.weight_decay),
            grad_clip_norm=float(params.grad_clip_norm),
        )
        with self._lock:
            fut = self.training_client.optim_step(adam)
            self.step += 1
        return self._spawn(self._finish_optim, fut, float(params.learning_rate))

    def _finish_optim(self, fut: Any, lr: float) -> dict[str, float]:
        response = self._wait(fut, "optim_step", training=True)
        metrics = {"lr": lr}
        for key, value in (getattr(response, "metrics", None) or {}).items():
            metrics[f"tinker/{key}"] = float(value)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """``save_state`` (weights + optimizer, after all queued calls), then write the tinker
        path, step, snapshots and ``extra`` to ``path/tinker_checkpoint.json``; returns ``path``."""
        payload = dict(extra or {})
        try:
            json.dumps(payload)
        except TypeError as err:
            raise TypeError(f"TinkerBackend.save: extra must be JSON-serialisable ({err})") from err
        path = str(path)
        with self._lock:
            name = _safe_name(f"tempering-{os.path.basename(os.path.normpath(path)) or 'checkpoint'}-s{self.step}")
            fut = self.training_client.save_state(name, ttl_seconds=self.checkpoint_ttl_seconds)
            step, snaps = self.step, list(self._snapshots.values())
        state_path = str(self._wait(fut, "save_state", training=True).path)
        record = {
            "format": CHECKPOINT_FORMAT,
            "backend": "tinker",
            "tinker_path": state_path,
            "step": step,
            "base_model": self.base_model,
            "rank": self.rank,
            "snapshots": {s.name: {"path": self._snapshot_path(s), "step": s.step} for s in snaps},
            "extra": payload,
            "saved_at": time.time(),
        }
        _write_json(os.path.join(path, CHECKPOINT_FILE), record)
        _write_json(self._index_file(state_path), {**record, "checkpoint_dir": os.path.abspath(path)})
        return path

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save` (a local checkpoint folder, or its
        ``tinker://`` state path); returns its ``extra``."""
        path = str(path)
        if path.startswith("tinker://"):
            index = self._index_file(path)
            if os.path.exists(index):
                record = _read_json(index)
            else:
                warnings.warn(f"no local record of {path} in {self.checkpoint_index_dir}: restoring weights and optimizer "
                              "only (step 0, no snapshots, no extra)", UserWarning, stacklevel=2)  # fmt: skip
                record = {"format": CHECKPOINT_FORMAT, "tinker_path": path, "step": 0, "snapshots": {}, "extra": {}}
        else:
            file = os.path.join(path, CHECKPOINT_FILE)
            if not os.path.isfile(file):
                other = " (it holds a local-backend checkpoint)" if os.path.isfile(os.path.join(path, "meta.json")) else ""
                raise FileNotFoundError(f"TinkerBackend.load: no Tinker checkpoint at '{path}' (missing {CHECKPOINT_FILE}){other}")
            record = _read_json(file)
        if record.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"TinkerBackend.load: '{path}' has format {record.get('format')}, expected {CHECKPOINT_FORMAT}")
        if record.get("base_model") not in (None, self.base_model):
            raise ValueError(
                f"TinkerBackend.load: '{path}' was trained from {record['base_model']!r}; set backend.base_model to it "
                f"(configured: {self.base_model!r})"
            )
        with self._lock:
            fut = self.service.create_training_client_from_state_with_optimizer(record["tinker_path"])
            self._training = self._wait(fut, f"restore the training client from {record['tinker_path']}", training=True)
            self.step = int(record.get("step") or 0)
            self._sampler = None  # sampled from the restored weights on the next sample()
            self._sampler_version = self.step
            self._snapshots = {
                name: _Snapshot(name, int(s.get("step", 0)), path=str(s["path"]))
                for name, s in (record.get("snapshots") or {}).items()
            }
        return dict(record.get("extra") or {})

    def _index_file(self, tinker_path: str) -> str:
        key = hashlib.sha256(tinker_path.encode("utf-8")).hexdigest()[:32]
        return os.path.join(self.checkpoint_index_dir, f"{key}.json")

    def close(self) -> None:
        """Wait for queued work, stop the worker threads and (if this backend created the
        service client) finish the Tinker session."""
        self._pool.shutdown(wait=True)
        if self._owns_service and hasattr(self.service, "close"):
            try:
                closing = self.service.close("success")
                if hasattr(closing, "result"):
                    closing.result(timeout=30)
            except Exception as err:  # noqa: BLE001 - closing must not mask the run's outcome
                warnings.warn(f"TinkerBackend.close: {one_line(err)}", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------ execution and errors
    def _spawn(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Run ``fn`` (which waits on SDK futures) on a worker thread; errors become ours."""
        def run() -> T:
            try:
                return fn(*args)
            except TemperingError:
                raise
            except (NotImplementedError, ValueError, KeyError, TypeError):
                raise
            except Exception as err:  # noqa: BLE001
                raise self._translate(err, getattr(fn, "__name__", "call")) from err

        return self._pool.submit(run)

    def _wait(self, fut: Any, what: str, training: bool = False) -> Any:
        """``fut.result()`` with the service's errors translated (no retry)."""
        try:
            return fut.result()
        except TemperingError:
            raise
        except Exception as err:  # noqa: BLE001
            raise self._translate(err, what, training=training) from err

    def _try_submit(self, submit: Callable[[T], Any], arg: T) -> Any:
        """Submit now; a synchronous failure is kept (as a failed future) for the retry loop."""
        try:
            return submit(arg)
        except Exception as err:  # noqa: BLE001
            failed: Future[Any] = Future()
            failed.set_exception(err)
            return failed

    def _result_with_retry(self, what: str, fut: Any, resubmit: Callable[[], Any]) -> Any:
        """The result of an *idempotent* request, resubmitting it after a retryable failure."""
        attempt = 0
        while True:
            try:
                return fut.result()
            except Exception as err:  # noqa: BLE001
                if not self._retryable(err) or attempt >= self.max_retries:
                    raise self._translate(err, what, attempts=attempt + 1) from err
                delay = min(self.retry_backoff * 2**attempt, self.retry_max_backoff) * random.uniform(0.75, 1.25)
                with self._lock:
                    self.retry_count += 1
                time.sleep(delay)
                attempt += 1
                try:
                    fut = resubmit()
                except Exception as again:  # noqa: BLE001
                    fut = Future()
                    fut.set_exception(again)

    def _retryable(self, err: BaseException) -> bool:
        t = self._tinker
        if isinstance(err, (t.RateLimitError, t.InternalServerError, t.APIConnectionError, TimeoutError, ConnectionError)):
            return True
        if isinstance(err, t.APIStatusError):
            return err.status_code in (408, 409, 429) or err.status_code >= 500
        return False

    def _translate(self, err: BaseException, what: str, training: bool = False, attempts: int | None = None) -> TemperingError:
        """A one-line error that says what happened and what to do."""
        if isinstance(err, TemperingError):
            return err
        t = self._tinker
        detail = one_line(getattr(err, "message", None) or err)[:300]
        text = str(err)
        if isinstance(err, t.AuthenticationError) or "api_key must start with" in text or "api_key client option must be set" in text:
            return TinkerAuthError(f"Tinker rejected the API key while trying to {what} ({detail}): {KEY_HINT}")
        if isinstance(err, t.PermissionDeniedError):
            return TinkerAuthError(f"Tinker denied access while trying to {what} (403: {detail}); check the key's project and {KEY_HINT}")
        if isinstance(err, t.BillingError):
            return TinkerServiceError(f"Tinker refused to {what}: billing is not set up for this account (402: {detail})")
        if training:
            return TinkerTrainingError(
                f"Tinker failed to {what} ({type(err).__name__}: {detail}). Training calls are not retried: the service "
                "may already have applied it. Re-run the same command (same output_dir) to resume from the last checkpoint"
            )
        if self._retryable(err):
            kind = "rate limit (429)" if isinstance(err, t.RateLimitError) else type(err).__name__
            if attempts is None:
                return TinkerServiceError(f"Tinker could not {what}: {kind} persisted after the SDK's own retries ({detail}); try again later")
            return TinkerServiceError(
                f"Tinker could not {what}: {kind} persisted over {attempts} attempt(s) ({detail}); raise backend.max_retries "
                "or backend.retry_backoff, or try later"
            )
        if isinstance(err, (t.BadRequestError, t.UnprocessableEntityError, t.NotFoundError)):
            return TinkerServiceError(f"Tinker rejected the request to {what} ({type(err).__name__}: {detail})")
        return TinkerServiceError(f"Tinker failed to {what} ({type(err).__name__}: {detail})")


class TinkerSamplingClient:
    """A sampler of one weight snapshot (see :meth:`TinkerBackend.sampling_client`); ``sample``
    has the backend's signature and conventions, ``policy_version`` is the snapshot's step."""

    def __init__(self, backend: TinkerBackend, sdk_future: Any, policy_version: int) -> None:
        self._backend = backend
        self._sdk_future = sdk_future
        self.policy_version = int(policy_version)

    @property
    def tokenizer(self) -> Any:
        return self._backend.tokenizer

    def sample(self, prompts: list[list[int]], num_samples: int, params: SamplingParams) -> Future[list[list[Completion]]]:
        return self._backend._sample_with(self._sdk_future, self.policy_version, prompts, num_samples, params)

    def __repr__(self) -> str:
        return f"TinkerSamplingClient(policy_version={self.policy_version})"


# ---------------------------------------------------------------------- helpers
def _check_api_key(api_key: str | None) -> None:
    """Fail fast (before any request) on a key that cannot work."""
    key = api_key or os.environ.get("TINKER_API_KEY")
    source = "backend.api_key" if api_key else "TINKER_API_KEY"
    if key and not key.startswith(("tml-", "eyJ")) and not os.environ.get("TINKER_CREDENTIAL_CMD"):
        raise TinkerAuthError(f"{source} must start with 'tml-' (the value set does not): {KEY_HINT}")


def _custom_loss_fn(loss: Any, tensors: dict[str, Any], captured: dict[str, Any]) -> Callable[..., Any]:
    """The ``forward_backward_custom`` callable: our loss on the logprobs Tinker returns.

    The SDK passes one logprob tensor per row (requires grad) and back-propagates the returned
    scalar to them; it then sends ``-d loss / d logprobs`` as cross-entropy weights, which gives
    the service exactly our gradient."""

    def tempering_custom_loss(data: Sequence[Any], logprobs_list: Sequence[Any]) -> tuple[Any, dict[str, float]]:
        width = tensors["weights"].shape[1]
        rows = [torch.nn.functional.pad(lp.to(torch.float32).reshape(-1), (0, width - lp.numel())) for lp in logprobs_list]
        out = loss(torch.stack(rows), tensors)
        value = getattr(out, "loss", None)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(f"forward_backward: {type(loss).__name__} must return a LossOutput with a scalar tensor .loss")
        captured["out"] = out
        return value, {}

    return tempering_custom_loss


def _tensor_list(value: Any) -> list[float]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [float(x) for x in value]


def _np(values: Sequence[Any], dtype: str) -> Any:
    import numpy as np

    return np.asarray(list(values), dtype=dtype)


def _float_metrics(metrics: Mapping[str, Any], who: str) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"forward_backward: metric '{key}' from {who} is not a number ({value!r})") from err
    return out


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:120] or "checkpoint"


def _write_json(path: str, data: Mapping[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


__all__ = ["TinkerBackend", "TinkerSamplingClient", "service_client_factory"]
