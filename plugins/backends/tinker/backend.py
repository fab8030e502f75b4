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
  exponential backoff on errors the SDK gives up on (server-side failures, expired futures,
  connection errors, 5xx). A training call is never simply sent again (the service may have
  applied it, or the calls queued behind it): a failed or poisoned training client is replaced
  by one built from the last saved state, and the calls since then are repeated in order
  (:mod:`~tempering.plugins.backends.tinker.recovery`).
* **Waits are bounded** (:mod:`~tempering.plugins.backends.tinker.waits`): setup (the session,
  the training client) within ``setup_timeout_seconds``, every result within
  ``request_timeout_seconds``, with a warning naming what is awaited after
  ``wait_warning_seconds``; an unreachable service is reported at once.
* **Errors** are one line naming the fix (key, base URL, model name), setup errors included.
* **Stops** are always explicit: the caller's stop ids (a renderer's) or strings, else the
  tokenizer's EOS ids -- never the service's implicit stop, which for a base model can differ
  from what the tokenizer ``get_tokenizer`` returns says (Llama 3: the instruct tokenizer).
* **Custom losses** run once locally on zero logprobs before anything is sent, so a loss that
  cannot run (a missing ``ref_logprobs``, a non-scalar result) fails at once, one line, and
  never reaches -- and poisons -- the SDK's training client.
* **Checkpoints.** ``save(path, extra)`` calls ``save_state`` (a name unique in the run) and writes the returned
  ``tinker://`` path, the step, the snapshot paths and ``extra`` to ``path/tinker_checkpoint.json``
  (plus an index keyed by the tinker path, so ``load("tinker://...")`` finds ``extra`` too).
  ``load`` creates a training client from that state *with* optimizer state
  (``create_training_client_from_state_with_optimizer``: the SDK's replacement for the
  deprecated ``TrainingClient.load_state``).
* **Weights out.** ``download_weights(dest)`` is the SDK's documented way to get weights off the
  service (what ``tinker checkpoint download`` does; sampler weights cannot be downloaded):
  ``save_weights_external`` (the LoRA adapter, peft format) under a short TTL, the per-file signed
  URLs from ``RestClient.get_external_weights_urls``, each file fetched, the temporary export
  deleted. ``tempering export`` merges the adapter into the base model locally.

This module imports torch but not the Tinker SDK at import time; the SDK is imported when a
backend is built, with a clear message if the ``tinker`` extra is missing.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import json
import os
import random
import re
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from tempering.errors import ConfigError, TemperingError
from tempering.plugins.backends.common import checked_extra, float_metrics
from tempering.plugins.backends.tinker.errors import (
    INSTALL_HINT,
    KEY_HINT,
    URL_HINT,
    TinkerAuthError,
    TinkerBackendError,
    TinkerLossError,
    TinkerNotInstalledError,
    TinkerServiceError,
    TinkerTrainingError,
    one_line,
    retryable,
    translate,
)
from tempering.plugins.backends.tinker.mapping import (
    LossPlan,
    plan_loss,
    to_tinker_data,
)
from tempering.plugins.backends.tinker.recovery import Call, TrainingCalls
from tempering.plugins.backends.tinker.waits import Overdue, diagnose, in_thread, probe, wait_for
from tempering.types import AdamParams, Batch, Completion, SamplingParams

T = TypeVar("T")

CHECKPOINT_FILE = "tinker_checkpoint.json"
CHECKPOINT_FORMAT = 1
POLICY_LOGPROBS = ("trainer", "sampler")
SAMPLING_CLIENT_KINDS = ("snapshot", "inflight")
#: The SDK documents checkpoint TTLs "between 1 hour (3600) and 10 years".
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 3600, 10 * 365 * 24 * 3600
#: Seconds ``close`` waits for the session to finish (after a sixth of it, only if the service
#: still answers its health check).
CLOSE_TIMEOUT = 30.0

#: End-of-text tokens a base model stops on that the tokenizer ``get_tokenizer`` returns may not
#: name as EOS: for ``meta-llama/Llama-3*`` the SDK loads the *instruct* tokenizer (EOS
#: ``<|eot_id|>``), while the base model ends text with ``<|end_of_text|>``.
END_TOKENS = {"meta-llama/Llama-3": ("<|end_of_text|>", "<|eot_id|>")}
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
    save: Call | None = None  # the save_weights_for_sampler call (None when restored)
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
        seed: LoRA initialisation seed (also what lets a failed client be rebuilt before the
            first checkpoint: a fresh adapter with the same seed starts from the same weights).
        sampler_refresh_every: refresh the sampling client (``save_weights_and_get_sampling_client``)
            once this many optimizer steps have passed since the last refresh (1 = sample every
            step from the newest weights).
        sampling_client_kind: what :meth:`sampling_client` (asynchronous RL) asks for:
            ``snapshot`` (fixed weights; ``policy_version`` exact) or ``inflight`` (weights shared
            with the trainer, updated in place by later publishes: no copy per step, and samples
            come from the published weights *or newer* -- ``policy_version`` is then a lower
            bound, so staleness is at most what is logged; not with ``fixed_staleness``).
        policy_logprobs: ``trainer`` (forward pass of the trainer, default) or ``sampler``
            (the current sampling client; retried, but sampler numerics and possibly stale).
        max_retries / retry_backoff / retry_max_backoff: retries of idempotent calls (sampling,
            sampling-client scoring): up to ``max_retries`` more attempts, waiting
            ``retry_backoff * 2**attempt`` seconds (jittered, capped at ``retry_max_backoff``).
        max_recoveries: new training clients one failed training call may cost (rebuilt from
            the last saved state, the calls since repeated) before its error is raised; 0 = off.
        setup_timeout_seconds: the most a setup step may take (the session, a training or
            sampling client); the SDK itself retries setup for up to 5 minutes.
        request_timeout_seconds: the most any one result may take (a training call, a sample).
        wait_warning_seconds: warn, naming what is awaited, when a wait lasts this long (then at
            twice, four times, ... that).
        train_mlp / train_attn / train_unembed: which LoRA targets to train.
        tokenizer: a Hugging Face name or path to load the tokenizer from instead of asking the
            training client (which downloads the base model's tokenizer).
        init_state: a ``tinker://`` state path to start from (weights and optimizer state).
        checkpoint_ttl_seconds / snapshot_ttl_seconds: expiry of saved states / snapshot weights
            (None: never; else at least 3600, the service's minimum).
        checkpoint_index_dir: where ``save`` indexes checkpoints by tinker path (default
            ``~/.cache/tempering/tinker``).
        concurrency: worker threads that wait on the service (sampling many prompts at once).
        lora: the local backend's LoRA block; only ``rank`` is used.
        model_kwargs, device, dtype, sample_batch_size, num_threads, threaded: local-backend keys,
            accepted and ignored (with a warning) so one recipe runs on both backends.
        service_client: a runtime ``tinker.ServiceClient``; not a config key.
    """

    #: What this backend cannot do although it has the method (which raises a clear error):
    #: no weight averaging (``ema_update``), no full next-token distributions, no logits in
    #: losses. :func:`tempering.interfaces.supports` reads it, so a stage that needs
    #: ``EmaWeights`` or ``FullDistributions`` fails at validation, before anything trains.
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
        sampling_client_kind: str = "snapshot",
        policy_logprobs: str = "trainer",
        max_retries: int = 5,
        retry_backoff: float = 1.0,
        retry_max_backoff: float = 30.0,
        max_recoveries: int = 3,
        setup_timeout_seconds: float = 600.0,
        request_timeout_seconds: float = 1800.0,
        wait_warning_seconds: float = 60.0,
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
        self.base_model, self.rank = _model_and_rank(base_model, model, rank, lora, {
            "model_kwargs": model_kwargs, "device": device, "dtype": dtype, "sample_batch_size": sample_batch_size,
            "num_threads": num_threads, "threaded": threaded})  # fmt: skip
        _check_settings(sampler_refresh_every=sampler_refresh_every, policy_logprobs=policy_logprobs,
                        sampling_client_kind=sampling_client_kind, max_retries=max_retries, retry_backoff=retry_backoff,
                        concurrency=concurrency, max_recoveries=max_recoveries,
                        setup_timeout_seconds=setup_timeout_seconds, request_timeout_seconds=request_timeout_seconds,
                        wait_warning_seconds=wait_warning_seconds, checkpoint_ttl_seconds=checkpoint_ttl_seconds,
                        snapshot_ttl_seconds=snapshot_ttl_seconds)  # fmt: skip
        self.seed = seed
        self.sampler_refresh_every = int(sampler_refresh_every)
        self.sampling_client_kind = sampling_client_kind
        self.policy_logprobs = policy_logprobs
        self.max_retries = int(max_retries)
        self.retry_backoff = float(retry_backoff)
        self.retry_max_backoff = float(retry_max_backoff)
        self.setup_timeout = float(setup_timeout_seconds)
        self.request_timeout = float(request_timeout_seconds)
        self.wait_warning = float(wait_warning_seconds)
        self.lora_targets = {"train_mlp": train_mlp, "train_attn": train_attn, "train_unembed": train_unembed}
        self.tokenizer_name = tokenizer
        self.init_state = init_state
        self.checkpoint_ttl_seconds = checkpoint_ttl_seconds
        self.snapshot_ttl_seconds = snapshot_ttl_seconds
        self.checkpoint_index_dir = checkpoint_index_dir or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tempering", "tinker"
        )
        self._connect(base_url, api_key, service_client)
        self._start_state(max_recoveries, concurrency)

    def _connect(self, base_url: str | None, api_key: str | None, service_client: Any) -> None:
        """The service client: the one given, or one built by :data:`service_client_factory` for
        ``base_url`` (resolved as the SDK does) after checking the key's form. Nothing is sent yet:
        a service client that is not given is probed before the first setup call."""
        if isinstance(service_client, (str, Mapping)):
            raise ConfigError("a runtime object (a tinker.ServiceClient), not a config key", path="backend.service_client")
        from tinker.lib.base_url import resolve_base_url

        self.base_url = resolve_base_url(base_url)
        self._api_key = api_key
        if service_client is None:
            _check_api_key(api_key)
            service_client = service_client_factory(base_url=base_url, api_key=api_key)
            self._owns_service = True
        else:
            self._owns_service = False
        self.service = service_client
        self._reachable = not self._owns_service  # probed before the first setup call

    def _start_state(self, max_recoveries: int, concurrency: int) -> None:
        """Step 0 and no clients yet: the training client is created (fresh, or from
        ``init_state``) on first use by :class:`~tempering.plugins.backends.tinker.recovery.TrainingCalls`,
        which also rebuilds it after a failure; samplers, the tokenizer and snapshot clients are
        made on first use too."""
        self.step = 0
        self.retry_count = 0
        self.last_plan: LossPlan | None = None
        self._lock = threading.RLock()  # orders submissions to the training client
        self.calls = TrainingCalls(self._create_training_client, lambda fut, what: self._wait(fut, what, training=True),
                                   max_recoveries, fresh_ok=self.seed is not None, lock=self._lock,
                                   state=self.init_state)  # fmt: skip
        self._tokenizer: Any = None
        self._stop_ids: list[int] | None = None
        self._sampler: Call | None = None  # the save_weights_and_get_sampling_client of the newest weights
        self._sampler_version = 0
        self._base_sampler: Any = None
        self._reference_lock = threading.Lock()
        self._snapshots: dict[str, _Snapshot] = {}
        self._snapshot_counter = 0
        self._names = itertools.count(1)
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="tempering-tinker")

    # ------------------------------------------------------------------ setup
    def _setup(self, what: str, make: Callable[[], Any]) -> Any:
        """``make().result()`` -- a setup call, which does its network work (the session) before
        it returns a future -- on a thread of its own, within ``setup_timeout_seconds``; errors
        one line. An unreachable service is reported at once (the SDK would retry for minutes)."""
        if not self._reachable:
            problem = probe(self.base_url)
            if problem is not None:
                raise TinkerServiceError(f"the Tinker service at {self.base_url} cannot be reached ({problem}): {URL_HINT}")
            self._reachable = True
        try:
            return wait_for(in_thread(lambda: make().result()), what, self.setup_timeout, self.wait_warning,
                            setting="backend.setup_timeout_seconds")  # fmt: skip
        except Overdue as err:
            raise TinkerServiceError(
                f"no answer from the Tinker service at {self.base_url} after {err.seconds:.0f} s while trying to {what} "
                f"(backend.setup_timeout_seconds): {URL_HINT}"
            ) from err
        except Exception as err:  # noqa: BLE001
            raise self._translate(err, what) from err

    def _create_training_client(self, state: str | None) -> Any:
        """A training client: from ``state`` (weights and optimizer state), or a fresh adapter."""
        if state:
            return self._setup(f"create the training client from {state}",
                               lambda: self.service.create_training_client_from_state_with_optimizer(state))  # fmt: skip
        try:
            return self._setup(
                f"create a LoRA training client for {self.base_model!r}",
                lambda: self.service.create_lora_training_client(base_model=self.base_model, rank=self.rank, seed=self.seed,
                                                                 **self.lora_targets),  # fmt: skip
            )
        except TinkerServiceError as err:
            if "rejected" not in str(err) and "found nothing" not in str(err):
                raise
            raise TinkerServiceError(
                f"{err}; is {self.base_model!r} a Tinker model name? Set backend.base_model, e.g. "
                "Qwen/Qwen3-4B-Instruct-2507 (`tinker model list` lists yours)"
            ) from err

    # ------------------------------------------------------------------ clients
    @property
    def training_client(self) -> Any:
        """The LoRA training client, created on first use (or by :meth:`load`, or rebuilt by a
        recovery)."""
        return self.calls.current()

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
        """Every id that ends a completion: the tokenizer's EOS, plus the end-of-text tokens of
        the base model where the SDK's tokenizer does not name them (:data:`END_TOKENS`)."""
        if self._stop_ids is None:
            tok = self.tokenizer
            eos = getattr(tok, "eos_token_id", None)
            ids = [int(eos)] if isinstance(eos, int) else [int(t) for t in (eos or [])]
            for prefix, names in END_TOKENS.items():
                if self.base_model.startswith(prefix):
                    vocab = tok.get_vocab() if hasattr(tok, "get_vocab") else {}
                    ids += [int(vocab[n]) for n in names if n in vocab and int(vocab[n]) not in ids]
            self._stop_ids = ids
        return self._stop_ids

    def _live_sampler(self) -> tuple[Call, int]:
        """The sampling client of the newest weights (refreshed when stale) and their step."""
        with self._lock:
            if self._sampler is None or self.step - self._sampler_version >= self.sampler_refresh_every:
                self._sampler = self.calls.submit("refresh the sampling client",
                                                  lambda c: c.save_weights_and_get_sampling_client(), stateful=False)  # fmt: skip
                self._sampler_version = self.step
            return self._sampler, self._sampler_version

    def _reference_sampler(self) -> Any:
        """A sampling client of the base model, created on first use (and again after a failed
        attempt: a failure is never cached)."""
        with self._reference_lock:  # not the backend's lock: training calls go on meanwhile
            if self._base_sampler is None:
                self._base_sampler = self._setup("create the base-model sampling client",
                                                 lambda: self.service.create_sampling_client(base_model=self.base_model))  # fmt: skip
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
                    snap.client = self._setup(f"create a sampling client for snapshot '{name}'",
                                              lambda: self.service.create_sampling_client(model_path=path))  # fmt: skip
                return snap.client

        return get

    def _snapshot_path(self, snap: _Snapshot) -> str:
        if snap.path is None:
            assert snap.save is not None
            snap.path = str(self.calls.result(snap.save).path)
        return snap.path

    # ------------------------------------------------------------------ sampling
    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        """``num_samples`` completions per prompt from the newest weights (one SDK request per
        prompt, all in flight at once; each retried on failures the SDK gives up on)."""
        sampler, version = self._live_sampler()
        return self._sample_with(sampler, version, prompts, num_samples, params)

    def sampling_client(self) -> Future[TinkerSamplingClient]:
        """A sampler of the current weights (``save_weights_and_get_sampling_client`` of kind
        ``sampling_client_kind``, queued after the training calls already submitted, e.g. an
        ``optim_step``), for sampling while training (asynchronous RL). Its completions carry the
        step it was taken at as ``policy_version``; it also becomes the sampler :meth:`sample`
        uses."""
        kind = self.sampling_client_kind
        with self._lock:
            call = self.calls.submit(f"save weights for a sampling client ({kind})",
                                     lambda c: c.save_weights_and_get_sampling_client(kind=kind), stateful=False)  # fmt: skip
            version = self.step
            self._sampler, self._sampler_version = call, version

        def ready() -> TinkerSamplingClient:
            self.calls.result(call)
            return TinkerSamplingClient(self, call, version)

        return self._spawn(ready)

    def _sample_with(self, sampler: Call, version: int, prompts: list[list[int]], num_samples: int,
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
        """Ours -> ``tinker.types.SamplingParams``. Stops are always explicit: stop strings as
        given, else the stop ids given (a renderer's) plus every EOS id (:attr:`eos_token_ids`),
        so a completion ends where it would on the local backend whatever the service's implicit
        stop for the model is (``None``) -- and never ``[]``, which disables EOS. ``top_k=0``
        -> -1."""
        items = [params.stop] if isinstance(params.stop, (str, int)) else list(params.stop or [])
        strings = [s for s in items if isinstance(s, str)]
        ids = [int(s) for s in items if not isinstance(s, str)]
        if strings and ids:
            raise ValueError("SamplingParams.stop: Tinker takes stop strings or stop token ids, not both")
        if any(s == "" for s in strings):
            raise ValueError("SamplingParams.stop: empty stop string")
        stop: list[Any] = strings if strings else ids + [e for e in self.eos_token_ids if e not in ids]
        return self._tinker.types.SamplingParams(
            max_tokens=int(params.max_tokens),
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            top_k=int(params.top_k) if params.top_k and params.top_k > 0 else -1,
            stop=stop,
            seed=params.seed,
        )

    def _sample(self, sampler: Call, version: int, prompts: list[list[int]], n: int,
                params: SamplingParams, tinker_params: Any) -> list[list[Completion]]:  # fmt: skip
        client = self.calls.result(sampler)
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
    def _scorer(self, reference: bool, weights: str | None) -> Callable[[], Any]:
        """The sampling client that scores: a snapshot's, the base model's, or the newest weights'."""
        if weights is not None:
            return self._snapshot_client(str(weights))
        if reference:
            return self._reference_sampler
        sampler, _ = self._live_sampler()
        return lambda: self.calls.result(sampler)

    def logprobs(self, batch: Batch, reference: bool = False, weights: str | None = None) -> Future[list[list[float]]]:
        """Per-target-token logprobs of each row (no gradients): the trainer's forward pass
        (default), the base model (``reference=True``) or a snapshot (``weights=NAME``)."""
        if reference and weights is not None:
            raise ValueError("logprobs: pass reference=True or weights=NAME, not both")
        if weights is not None or reference or self.policy_logprobs == "sampler":
            what = f"logprobs(weights={weights!r})" if weights is not None else "logprobs(reference=True)" if reference else "logprobs"
            return self._spawn(self._score_batch, self._scorer(reference, weights), batch, what)
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
        call = self.calls.submit("forward (logprobs)", lambda c: c.forward(data, "cross_entropy"), stateful=False)
        return self._spawn(self._forward_logprobs, call, batch)

    def reference_logprobs(self, batch: Batch) -> Future[list[list[float]]]:
        """Same as ``logprobs(batch, reference=True)``."""
        return self.logprobs(batch, reference=True)

    def _forward_logprobs(self, call: Call, batch: Batch) -> list[list[float]]:
        out = self.calls.result(call)
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
        return self._spawn(self._topk_batch, self._scorer(reference, weights), batch, int(topk))

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
        ttl = self.snapshot_ttl_seconds
        with self._lock:
            self._snapshot_counter += 1
            label = _safe_name(f"tempering-{name}-s{self.step}-{self._snapshot_counter}")
            call = self.calls.submit(f"save snapshot '{name}'", lambda c: c.save_weights_for_sampler(label, ttl_seconds=ttl),
                                     stateful=False)  # fmt: skip
            snap = _Snapshot(name, self.step, save=call)
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
        when it is exact for ``loss``, else ``forward_backward_custom`` (after a local dry run of
        the loss). Returns the loss's own metrics (computed from the logprobs Tinker returns)
        plus ``loss``. A failure on the service is recovered from (see ``max_recoveries``)."""
        plan = plan_loss(loss, batch)
        data = to_tinker_data(batch, plan, self._tinker.types)
        tensors = batch.to_tensors()
        captured: dict[str, Any] = {}
        if plan.custom:
            _dry_run(loss, tensors)
            fn = _custom_loss_fn(loss, tensors, captured)
            submit: Callable[[Any], Any] = lambda c: c.forward_backward_custom(data, fn)  # noqa: E731
        else:
            submit = lambda c: c.forward_backward(data, plan.loss_fn, plan.loss_fn_config)  # noqa: E731
        with self._lock:
            call = self.calls.submit("forward_backward", submit, stateful=True)
            self.last_plan = plan
        return self._spawn(self._finish_forward_backward, call, plan, loss, tensors, captured)

    def _finish_forward_backward(self, call: Call, plan: LossPlan, loss: Any, tensors: dict[str, Any],
                                 captured: dict[str, Any]) -> dict[str, float]:  # fmt: skip
        out = self.calls.result(call)
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
            metrics.update(float_metrics(getattr(result, "metrics", {}) or {}, type(loss).__name__))
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
            call = self.calls.submit("optim_step", lambda c: c.optim_step(adam), stateful=True)
            self.step += 1
        return self._spawn(self._finish_optim, call, float(params.learning_rate))

    def _finish_optim(self, call: Call, lr: float) -> dict[str, float]:
        response = self.calls.result(call)
        metrics = {"lr": lr}
        for key, value in (getattr(response, "metrics", None) or {}).items():
            metrics[f"tinker/{key}"] = float(value)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """``save_state`` (weights + optimizer, after all queued calls) under a name no other
        save of this run uses (a periodic and a stage-end checkpoint can share a step and a
        folder name; Tinker refuses a name twice), then write the tinker path, step, snapshots
        and ``extra`` to ``path/tinker_checkpoint.json``; returns ``path``. The saved state is
        where a recovery starts from."""
        payload = checked_extra(extra, "TinkerBackend.save")
        path = str(path)
        ttl = self.checkpoint_ttl_seconds
        with self._lock:
            base = os.path.basename(os.path.normpath(path)) or "checkpoint"
            name = _safe_name(f"tempering-{base}-s{self.step}-{next(self._names)}")
            call = self.calls.submit("save_state", lambda c: c.save_state(name, ttl_seconds=ttl), stateful=False)
            step, snaps = self.step, list(self._snapshots.values())
        state_path = str(self.calls.result(call).path)
        self.calls.saved(call, state_path)
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
        state = str(record["tinker_path"])
        with self._lock:
            self.calls.reset(self._create_training_client(state), state)
            self.step = int(record.get("step") or 0)
            self._sampler = None  # sampled from the restored weights on the next sample()
            self._sampler_version = self.step
            self._snapshots = {
                name: _Snapshot(name, int(s.get("step", 0)), path=str(s["path"]))
                for name, s in (record.get("snapshots") or {}).items()
            }
        return dict(record.get("extra") or {})

    def download_weights(self, dest: str, state: str | None = None) -> str:
        """Download the policy's weights (a LoRA adapter in peft format: ``adapter_config.json``,
        ``adapter_model.safetensors``) into the folder ``dest``; returns ``dest``.

        The weights are the training client's now (after every queued call: after :meth:`load`,
        the checkpoint's), or those of the saved state ``state`` (a ``tinker://`` path, loaded into
        a training client of its own). Exported with ``save_weights_external`` under the shortest
        TTL Tinker allows, fetched through the signed URLs ``RestClient.get_external_weights_urls``
        gives (each within ``request_timeout_seconds``), then deleted from the service (a failed
        delete only warns: the export expires anyway)."""
        ttl = MIN_TTL_SECONDS
        what = "save the weights for download (save_weights_external)"
        if state is None:
            with self._lock:
                name = _safe_name(f"tempering-export-s{self.step}-{next(self._names)}")
                call = self.calls.submit(what, lambda c: c.save_weights_external(name, ttl_seconds=ttl), stateful=False)
            export = str(self.calls.result(call).path)
        else:
            client = self._create_training_client(str(state))
            name = _safe_name(f"tempering-export-{next(self._names)}")
            export = str(self._wait(client.save_weights_external(name, ttl_seconds=ttl), what).path)
        rest = self._tinker.RestClient(base_url=self.base_url, api_key=self._api_key)
        try:
            urls = self._wait(rest.get_external_weights_urls(export), f"get the download URLs of {export}")
            _download_files(dict(urls.urls), dest, self.request_timeout)
        finally:
            try:
                self._wait(rest.delete_checkpoint_from_tinker_path(export), f"delete the temporary export {export}")
            except TemperingError as err:
                warnings.warn(f"TinkerBackend.download_weights: {err}; it expires in {ttl} s", RuntimeWarning, stacklevel=2)
        return dest

    def _index_file(self, tinker_path: str) -> str:
        key = hashlib.sha256(tinker_path.encode("utf-8")).hexdigest()[:32]
        return os.path.join(self.checkpoint_index_dir, f"{key}.json")

    def close(self, status: str | None = None) -> None:
        """Wait for queued work, stop the worker threads and (if this backend created the
        service client) finish the Tinker session with ``status``: by default ``success``,
        ``errored`` when an exception is on its way out of the run (the recipe runner closes the
        backend in a ``finally``) or a training call could not be recovered, ``interrupted``
        for Ctrl-C or a stage that stopped the run."""
        if status is None:
            status = _run_status(sys.exc_info()[1], self.calls.gave_up)
        self._pool.shutdown(wait=True)
        if self._owns_service and hasattr(self.service, "close"):
            closing: Any = None
            try:
                closing = self.service.close(status)
                if hasattr(closing, "result"):
                    try:  # a few seconds, then ask the service: a dead or frozen one is not waited on for long
                        closing.result(timeout=CLOSE_TIMEOUT / 6)
                    except (TimeoutError, concurrent.futures.TimeoutError):
                        if self._diagnose() is not None:
                            raise
                        closing.result(timeout=CLOSE_TIMEOUT * 5 / 6)
            except Exception as err:  # noqa: BLE001 - closing must not mask the run's outcome
                # a TimeoutError has no text: the warning said "TinkerBackend.close: " and nothing else
                if isinstance(err, (TimeoutError, concurrent.futures.TimeoutError)):
                    problem = self._diagnose()
                    text = "no answer" + (f"; the service at {self.base_url}: {problem}" if problem else f" within {CLOSE_TIMEOUT:.0f} s")
                else:
                    text = one_line(err) or type(err).__name__
                warnings.warn(f"TinkerBackend.close: the Tinker session was not finished ({status}): {text}", RuntimeWarning,
                              stacklevel=2)  # fmt: skip
                # The SDK would go on retrying the finish, and its session heartbeat would log a
                # warning every 10 s, for minutes, after the run ended: cancelling the finish
                # runs its cleanup, which stops the heartbeat and releases the connections.
                future = getattr(closing, "future", None)
                if callable(future):
                    future().cancel()

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
        """``fut.result()`` within ``request_timeout_seconds`` (warning after
        ``wait_warning_seconds``), the service's errors translated (no retry). A training call
        past its time is a :class:`TinkerTrainingError` (recoverable: its client is abandoned)."""
        try:
            return wait_for(fut, what, self.request_timeout, self.wait_warning, explain=self._diagnose)
        except Overdue as err:
            problem = self._diagnose()
            why = (f"the service at {self.base_url}: {problem}" if problem else
                   "the service answers its health check, so it may be queueing the call or paused for capacity or "
                   "rate limits, which the SDK waits out without a word")  # fmt: skip
            message = f"no result for {what} from Tinker after {err.seconds:.0f} s (backend.request_timeout_seconds; {why})"
            raise (TinkerTrainingError if training else TinkerServiceError)(message) from err
        except TemperingError:
            raise
        except Exception as err:  # noqa: BLE001
            raise self._translate(err, what, training=training) from err

    def _diagnose(self) -> str | None:
        """What is wrong with the service, asked when a wait runs out: a dead server (connection
        refused), one that answers HTTP 5xx, or a frozen one (no answer) -- the SDK retries all
        three silently, so without asking they looked like a queue paused for capacity. None
        when the service is not ours to ask (a client given by the caller) or answers."""
        if not self._owns_service:
            return None
        return diagnose(self.base_url, timeout=min(5.0, max(1.0, self.request_timeout / 2)))

    def _try_submit(self, submit: Callable[[T], Any], arg: T) -> Any:
        """Submit now; a synchronous failure is kept (as a failed future) for the retry loop."""
        try:
            return submit(arg)
        except Exception as err:  # noqa: BLE001
            failed: Future[Any] = Future()
            failed.set_exception(err)
            return failed

    def _result_with_retry(self, what: str, fut: Any, resubmit: Callable[[], Any]) -> Any:
        """The result of an *idempotent* request, resubmitting it after a retryable failure
        (each attempt bounded by ``request_timeout_seconds``)."""
        attempt = 0
        while True:
            try:
                return self._wait(fut, what)
            except TemperingError as translated:
                cause = translated.__cause__
                if not isinstance(cause, Exception) or isinstance(cause, Overdue) or not retryable(self._tinker, cause):
                    raise
                if attempt >= self.max_retries:
                    raise self._translate(cause, what, attempts=attempt + 1) from cause
                delay = min(self.retry_backoff * 2**attempt, self.retry_max_backoff) * random.uniform(0.75, 1.25)
                with self._lock:
                    self.retry_count += 1
                time.sleep(delay)
                attempt += 1
                fut = self._try_submit(lambda _: resubmit(), None)

    def _translate(self, err: BaseException, what: str, training: bool = False, attempts: int | None = None) -> TemperingError:
        return translate(self._tinker, err, what, training=training, attempts=attempts)


class TinkerSamplingClient:
    """A sampler of one weight snapshot (see :meth:`TinkerBackend.sampling_client`); ``sample``
    has the backend's signature and conventions, ``policy_version`` is the snapshot's step (for
    an ``inflight`` client, the step of the weights it was created with: samples use those or
    newer)."""

    def __init__(self, backend: TinkerBackend, call: Call, policy_version: int) -> None:
        self._backend = backend
        self._call = call
        self.policy_version = int(policy_version)

    @property
    def tokenizer(self) -> Any:
        return self._backend.tokenizer

    def sample(self, prompts: list[list[int]], num_samples: int, params: SamplingParams) -> Future[list[list[Completion]]]:
        return self._backend._sample_with(self._call, self.policy_version, prompts, num_samples, params)

    def __repr__(self) -> str:
        return f"TinkerSamplingClient(policy_version={self.policy_version})"


# ---------------------------------------------------------------------- helpers
def _model_and_rank(
    base_model: str | None, model: str | None, rank: int | None, lora: Mapping[str, Any] | None,
    local_keys: Mapping[str, Any],
) -> tuple[str, int]:
    """The Tinker model name and LoRA rank from the Tinker keys or the local backend's (``model``,
    ``lora.rank``), so that a recipe switches backends by name alone; the local-only keys that
    were set are named in one warning."""
    ignored = [k for k, v in local_keys.items() if v is not None]
    lora = dict(lora or {})
    ignored += [f"lora.{k}" for k in sorted(lora) if k != "rank"]
    if ignored:
        warnings.warn(f"backend 'tinker' ignores local-backend keys: {', '.join(ignored)}", UserWarning, stacklevel=3)
    if base_model is None and model is None:
        raise ConfigError(
            "set the Tinker model, e.g. base_model=Qwen/Qwen3-4B-Instruct-2507 "
            "(`tinker model list` lists the models you can use)",
            path="backend.base_model",
        )
    if base_model is not None and model is not None and model != base_model:
        warnings.warn(f"backend 'tinker' uses base_model={base_model!r}, not model={model!r}", UserWarning, stacklevel=3)
    lora_rank = int(rank if rank is not None else lora.get("rank", 32))
    if lora_rank < 1:
        raise ConfigError(f"must be >= 1, got {lora_rank}", path="backend.rank")
    return str(base_model if base_model is not None else model), lora_rank


def _check_settings(
    *,
    sampler_refresh_every: int,
    policy_logprobs: str,
    sampling_client_kind: str,
    max_retries: int,
    retry_backoff: float,
    concurrency: int,
    max_recoveries: int,
    setup_timeout_seconds: float,
    request_timeout_seconds: float,
    wait_warning_seconds: float,
    checkpoint_ttl_seconds: int | None,
    snapshot_ttl_seconds: int | None,
) -> None:
    """One :class:`~tempering.errors.ConfigError` at the first setting out of range, before
    anything is sent to the service."""
    if sampler_refresh_every < 1:
        raise ConfigError(f"must be >= 1, got {sampler_refresh_every}", path="backend.sampler_refresh_every")
    if policy_logprobs not in POLICY_LOGPROBS:
        raise ConfigError(f"use one of {POLICY_LOGPROBS}, got {policy_logprobs!r}", path="backend.policy_logprobs")
    if sampling_client_kind not in SAMPLING_CLIENT_KINDS:
        raise ConfigError(f"use one of {SAMPLING_CLIENT_KINDS}, got {sampling_client_kind!r}", path="backend.sampling_client_kind")
    if max_retries < 0 or retry_backoff < 0 or concurrency < 1 or max_recoveries < 0:
        raise ConfigError("max_retries, max_recoveries and retry_backoff must be >= 0, concurrency >= 1", path="backend")
    for key, value in (("setup_timeout_seconds", setup_timeout_seconds), ("request_timeout_seconds", request_timeout_seconds),
                       ("wait_warning_seconds", wait_warning_seconds)):  # fmt: skip
        if not value > 0:
            raise ConfigError(f"must be > 0 seconds, got {value}", path=f"backend.{key}")
    for key, ttl in (("checkpoint_ttl_seconds", checkpoint_ttl_seconds), ("snapshot_ttl_seconds", snapshot_ttl_seconds)):
        if ttl is not None and not MIN_TTL_SECONDS <= int(ttl) <= MAX_TTL_SECONDS:
            raise ConfigError(
                f"must be null (never expire) or {MIN_TTL_SECONDS}..{MAX_TTL_SECONDS} seconds (Tinker's range), got {ttl}",
                path=f"backend.{key}",
            )


def _check_api_key(api_key: str | None) -> None:
    """Fail fast (before any request) on a key that cannot work."""
    key = api_key or os.environ.get("TINKER_API_KEY")
    source = "backend.api_key" if api_key else "TINKER_API_KEY"
    if key and not key.startswith(("tml-", "eyJ")) and not os.environ.get("TINKER_CREDENTIAL_CMD"):
        raise TinkerAuthError(f"{source} must start with 'tml-' (the value set does not): {KEY_HINT}")


def _run_status(exc: BaseException | None, gave_up: bool) -> str:
    """The session's finish status for a run ending with ``exc`` in flight (or none)."""
    if exc is None:
        return "errored" if gave_up else "success"
    if type(exc).__name__ in ("RunStopped", "StopRun") or not isinstance(exc, Exception):
        return "interrupted"  # Ctrl-C, or a stage that stopped the run on purpose
    return "errored"


def _dry_run(loss: Any, tensors: dict[str, Any]) -> None:
    """Run ``loss`` on zero logprobs, with a gradient, before anything is sent: the SDK runs a
    custom loss inside the training client's queue, where an error poisons the client for good.
    Catches what does not depend on the logprobs' values (missing inputs, wrong shapes, a
    non-scalar loss, non-numeric metrics)."""
    try:
        lp = torch.zeros_like(tensors["weights"], dtype=torch.float32, requires_grad=True)
        out = loss(lp, tensors)
        value = getattr(out, "loss", None)
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            raise TypeError(f"it must return a LossOutput with a scalar tensor .loss, got {type(value).__name__}"
                            + (f" of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else ""))  # fmt: skip
        value.backward()
        float_metrics(getattr(out, "metrics", {}) or {}, type(loss).__name__)
    except Exception as err:  # noqa: BLE001
        raise TinkerLossError(
            f"forward_backward: {type(loss).__name__} failed on zero logprobs before anything was sent to Tinker "
            f"({type(err).__name__}: {one_line(err)}); the batch lacks what the loss reads (e.g. ref_logprobs: give the "
            "stage a reference) or the loss is wrong"
        ) from err


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


def _download_files(urls: Mapping[str, str], dest: str, timeout: float) -> None:
    """Fetch each ``relative path -> signed URL`` into ``dest`` (a path that would leave
    ``dest`` is refused: the names come from the service)."""
    import urllib.error
    import urllib.request

    if not urls:
        raise TinkerServiceError("download_weights: Tinker listed no files for the exported weights")
    root = os.path.realpath(dest)
    for name, url in sorted(urls.items()):
        target = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, target]) != root:
            raise TinkerServiceError(f"download_weights: refusing the file name {name!r}, which leaves the folder {dest}")
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(target, "wb") as fh:
                shutil.copyfileobj(response, fh)
        except (urllib.error.URLError, OSError) as err:
            raise TinkerServiceError(f"download_weights: could not download {name} of the exported weights ({one_line(err)})") from err


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
