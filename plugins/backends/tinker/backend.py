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

``TinkerBackend`` is a facade: it checks its settings (:mod:`.settings`), holds the state of the
run (step, training client, samplers) and hands each call to the module that does it --
requests, waits and retries (:mod:`.session`), sampling (:mod:`.sampling`), scoring
(:mod:`.scoring`), snapshots (:mod:`.snapshots`), training (:mod:`.training`, with
:mod:`.mapping`'s loss plan and :mod:`.recovery`'s replayable training calls) and checkpoints
(:mod:`.checkpoint`).

This module imports torch but not the Tinker SDK at import time; the SDK is imported when a
backend is built, with a clear message if the ``tinker`` extra is missing.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from functools import partial
from typing import Any

from tempering.errors import ConfigError, TemperingError
from tempering.interfaces import Loss
from tempering.plugins.backends.common import checked_extra
from tempering.plugins.backends.tinker.checkpoint import (
    CHECKPOINT_FORMAT,
    download_files,
    read_record,
    safe_name,
    write_record,
)
from tempering.plugins.backends.tinker.errors import TinkerBackendError, TinkerServiceError, one_line
from tempering.plugins.backends.tinker.mapping import plan_loss, to_tinker_data
from tempering.plugins.backends.tinker.recovery import Call, TrainingCalls
from tempering.plugins.backends.tinker.sampling import (
    TinkerSamplingClient,
    checked_prompts,
    empty_completions,
    sample_prompts,
    sampling_params,
)
from tempering.plugins.backends.tinker.scoring import forward_data, forward_logprobs, score_batch, topk_batch
from tempering.plugins.backends.tinker.sdk_logging import one_line_sdk_logs
from tempering.plugins.backends.tinker.session import Session, run_status
from tempering.plugins.backends.tinker.settings import (
    END_TOKENS,
    MIN_TTL_SECONDS,
    check_api_key,
    check_settings,
    model_and_rank,
    sdk,
)
from tempering.plugins.backends.tinker.snapshots import Snapshots
from tempering.plugins.backends.tinker.training import (
    custom_loss_fn,
    dry_run,
    loss_metrics,
    optim_metrics,
    tinker_adam,
)
from tempering.types import AdamParams, Batch, Completion, SamplingParams


def _default_service_client(base_url: str | None = None, api_key: str | None = None) -> Any:
    return sdk().ServiceClient(base_url=base_url, api_key=api_key)


#: Builds the ``tinker.ServiceClient`` (called with ``base_url=`` and ``api_key=``). Tests and
#: embedders replace it (e.g. ``monkeypatch.setattr(backend_module, "service_client_factory",
#: fake)``) to run a recipe against an in-process fake of the service; a ``service_client``
#: passed to :class:`TinkerBackend` wins over it.
service_client_factory: Callable[..., Any] = _default_service_client


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
        model_kwargs, device, dtype, sample_batch_size, num_threads, threaded,
            gradient_checkpointing: local-backend keys,
            accepted and ignored (with a warning) so one recipe runs on both backends.
        service_client: a runtime ``tinker.ServiceClient``; not a config key.
    """

    #: What this backend cannot do although it has the method (which raises a clear error):
    #: no weight averaging (``ema_update``), no full next-token distributions, no logits in
    #: losses. :func:`tempering.interfaces.supports` reads it, so a stage that needs
    #: ``EmaWeights`` or ``FullDistributions`` fails at validation, before anything trains.
    capabilities = {"ema_update": False, "full_distributions": False, "logits": False}
    #: ``weights=`` in :meth:`logprobs` / :meth:`distributions` may be a sampler-weights path
    #: with one of these prefixes as well as a snapshot's name: weights saved by another run (a
    #: distillation teacher, the cookbook's ``teacher_checkpoint``), scored by their own client.
    weight_path_schemes = ("tinker://",)

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
        gradient_checkpointing: bool | None = None,
        service_client: Any = None,
    ) -> None:
        self._tinker = sdk()
        self.base_model, self.rank = model_and_rank(
            base_model,
            model,
            rank,
            lora,
            {
                "model_kwargs": model_kwargs,
                "device": device,
                "dtype": dtype,
                "sample_batch_size": sample_batch_size,
                "num_threads": num_threads,
                "threaded": threaded,
                "gradient_checkpointing": gradient_checkpointing,
            },
        )
        check_settings(
            sampler_refresh_every=sampler_refresh_every,
            policy_logprobs=policy_logprobs,
            sampling_client_kind=sampling_client_kind,
            max_retries=max_retries,
            retry_backoff=retry_backoff,
            concurrency=concurrency,
            max_recoveries=max_recoveries,
            setup_timeout_seconds=setup_timeout_seconds,
            request_timeout_seconds=request_timeout_seconds,
            wait_warning_seconds=wait_warning_seconds,
            checkpoint_ttl_seconds=checkpoint_ttl_seconds,
            snapshot_ttl_seconds=snapshot_ttl_seconds,
        )
        self.seed = seed
        self.sampler_refresh_every = int(sampler_refresh_every)
        self.sampling_client_kind = sampling_client_kind
        self.policy_logprobs = policy_logprobs
        self.lora_targets = {"train_mlp": train_mlp, "train_attn": train_attn, "train_unembed": train_unembed}
        self.tokenizer_name = tokenizer
        self.checkpoint_ttl_seconds = checkpoint_ttl_seconds
        self.snapshot_ttl_seconds = snapshot_ttl_seconds
        self.checkpoint_index_dir = checkpoint_index_dir or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tempering", "tinker"
        )
        one_line_sdk_logs()  # the SDK's telemetry logged ~75 lines per failed flush when the service died
        self.session = self._connect(
            base_url,
            api_key,
            service_client,
            setup_timeout=float(setup_timeout_seconds),
            request_timeout=float(request_timeout_seconds),
            wait_warning=float(wait_warning_seconds),
            max_retries=int(max_retries),
            retry_backoff=float(retry_backoff),
            retry_max_backoff=float(retry_max_backoff),
            concurrency=concurrency,
        )
        self.service, self.base_url = self.session.service, self.session.base_url
        # Step 0 and no clients yet: the training client is created (fresh, or from init_state) on
        # first use by TrainingCalls, which also rebuilds it after a failure; samplers, the
        # tokenizer and snapshot clients are made on first use too.
        self.step = 0
        self._lock = threading.RLock()  # orders submissions to the training client
        self.calls = TrainingCalls(
            self._create_training_client,
            lambda fut, what: self.session.wait(fut, what, training=True),
            max_recoveries,
            fresh_ok=self.seed is not None,
            lock=self._lock,
            state=init_state,
        )
        self.snapshots = Snapshots(self.calls, self._lock)
        self._tokenizer: Any = None
        self._stop_ids: list[int] | None = None
        self._sampler: Call | None = None  # the save_weights_and_get_sampling_client of the newest weights
        self._sampler_version = 0
        self._base_sampler: Any = None
        self._path_samplers: dict[str, Any] = {}  # sampling clients of weights given by path
        self._reference_lock = threading.Lock()
        self._names = itertools.count(1)

    @staticmethod
    def _connect(base_url: str | None, api_key: str | None, service_client: Any, **rules: Any) -> Session:
        """The session: the service client given, or one built by :data:`service_client_factory`
        for ``base_url`` (resolved as the SDK does) after checking the key's form. Nothing is sent
        yet: a service client that is not given is probed before the first setup call."""
        if isinstance(service_client, (str, Mapping)):
            raise ConfigError(
                "a runtime object (a tinker.ServiceClient), not a config key", path="backend.service_client"
            )
        from tinker.lib.base_url import resolve_base_url

        owns = service_client is None
        if owns:
            check_api_key(api_key)
            service_client = service_client_factory(base_url=base_url, api_key=api_key)
        return Session(sdk(), service_client, resolve_base_url(base_url), api_key, owns, **rules)

    @property
    def retry_count(self) -> int:
        """Requests sent again after a retryable failure, over the backend's life."""
        return self.session.retry_count

    def _create_training_client(self, state: str | None) -> Any:
        """A training client: from ``state`` (weights and optimizer state), or a fresh adapter."""
        if state:
            return self.session.setup(
                f"create the training client from {state}",
                lambda: self.service.create_training_client_from_state_with_optimizer(state),
            )
        try:
            return self.session.setup(
                f"create a LoRA training client for {self.base_model!r}",
                lambda: self.service.create_lora_training_client(
                    base_model=self.base_model, rank=self.rank, seed=self.seed, **self.lora_targets
                ),
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
                except Exception as err:
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
                self._sampler = self.calls.submit(
                    "refresh the sampling client", lambda c: c.save_weights_and_get_sampling_client(), stateful=False
                )
                self._sampler_version = self.step
            return self._sampler, self._sampler_version

    def _reference_sampler(self) -> Any:
        """A sampling client of the base model, created on first use (and again after a failed
        attempt: a failure is never cached)."""
        with self._reference_lock:  # not the backend's lock: training calls go on meanwhile
            if self._base_sampler is None:
                self._base_sampler = self.session.setup(
                    "create the base-model sampling client",
                    lambda: self.service.create_sampling_client(base_model=self.base_model),
                )
            return self._base_sampler

    def _path_sampler(self, path: str) -> Any:
        """A sampling client of the weights at ``path`` (a ``tinker://`` sampler-weights path),
        created on first use and kept (a failed attempt is never cached)."""
        with self._reference_lock:
            if path not in self._path_samplers:
                self._path_samplers[path] = self.session.setup(
                    f"create a sampling client for {path}", lambda: self.service.create_sampling_client(model_path=path)
                )
            return self._path_samplers[path]

    def _scorer(self, reference: bool, weights: str | None) -> Callable[[], Any]:
        """The sampling client that scores: a snapshot's, weights' by path, the base model's, or
        the newest weights'."""
        if weights is not None and str(weights).startswith(self.weight_path_schemes):
            return partial(self._path_sampler, str(weights))
        if weights is not None:
            return self.snapshots.client(str(weights), self.session.setup, self.service)
        if reference:
            return self._reference_sampler
        sampler, _ = self._live_sampler()
        return lambda: self.calls.result(sampler)

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
            call = self.calls.submit(
                f"save weights for a sampling client ({kind})",
                lambda c: c.save_weights_and_get_sampling_client(kind=kind),
                stateful=False,
            )
            version = self.step
            self._sampler, self._sampler_version = call, version

        def ready() -> TinkerSamplingClient:
            self.calls.result(call)
            return TinkerSamplingClient(partial(self._sample_with, call, version), lambda: self.tokenizer, version)

        return self.session.spawn(ready)

    def sampling_params(self, params: SamplingParams) -> Any:
        """Ours -> ``tinker.types.SamplingParams``, stops explicit (see :func:`.sampling.sampling_params`)."""
        return sampling_params(self._tinker.types, params, self.eos_token_ids)

    def _sample_with(
        self, sampler: Call, version: int, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        prompts = checked_prompts(prompts, num_samples)
        if params.max_tokens <= 0:
            return empty_completions(prompts, num_samples, params, version)
        tinker_params = self.sampling_params(params)

        def run() -> list[list[Completion]]:
            client = self.calls.result(sampler)
            return sample_prompts(
                self.session, client, prompts, num_samples, params, tinker_params, version, self._decode
            )

        return self.session.spawn(run)

    def _decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    # ------------------------------------------------------------------ scoring
    def logprobs(self, batch: Batch, reference: bool = False, weights: str | None = None) -> Future[list[list[float]]]:
        """Per-target-token logprobs of each row (no gradients): the trainer's forward pass
        (default), the base model (``reference=True``), a snapshot (``weights=NAME``) or weights
        saved elsewhere (``weights="tinker://..."``, :attr:`weight_path_schemes`)."""
        if reference and weights is not None:
            raise ValueError("logprobs: pass reference=True or weights=NAME, not both")
        if weights is not None or reference or self.policy_logprobs == "sampler":
            what = (
                f"logprobs(weights={weights!r})"
                if weights is not None
                else "logprobs(reference=True)"
                if reference
                else "logprobs"
            )
            return self.session.spawn(score_batch, self.session, self._scorer(reference, weights), batch, what)
        data = forward_data(self._tinker.types, batch)
        call = self.calls.submit("forward (logprobs)", lambda c: c.forward(data, "cross_entropy"), stateful=False)
        return self.session.spawn(lambda: forward_logprobs(self.calls.result(call), batch))

    def reference_logprobs(self, batch: Batch) -> Future[list[list[float]]]:
        """Same as ``logprobs(batch, reference=True)``."""
        return self.logprobs(batch, reference=True)

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
                "distributions; pass topk=K (e.g. SDFT topk_logits with topk_support: teacher), "
                "or use the local backend"
            )
        if topk < 1:
            raise ValueError(f"distributions: topk must be >= 1 (or None), got {topk}")
        if reference and weights is not None:
            raise ValueError("distributions: pass reference=True or weights=NAME, not both")
        return self.session.spawn(topk_batch, self.session, self._scorer(reference, weights), batch, int(topk))

    # ------------------------------------------------------------------ snapshots
    def snapshot(self, name: str) -> Future[None]:
        """Save the current weights for sampling under ``name`` (``save_weights_for_sampler``,
        queued after the training calls already submitted); score with ``weights=name``.
        Snapshots are recorded in checkpoints."""
        with self._lock:
            snap = self.snapshots.take(str(name), self.step, self.snapshot_ttl_seconds, safe_name)
        return self.session.spawn(lambda: (self.snapshots.path(snap), None)[1])

    def ema_update(self, name: str, rate: float) -> Future[None]:
        """Not possible on Tinker: it cannot average weights on the service."""
        raise NotImplementedError(
            "TinkerBackend.ema_update: Tinker cannot average weights on the service, "
            "so EMA teachers are not available; "
            "use a frozen teacher (SDFT teacher: stage_start or base) or the live policy (teacher: live) on Tinker"
        )

    def drop_snapshot(self, name: str) -> Future[None]:
        """Forget a snapshot (its sampler weights stay on the service until their TTL)."""
        self.snapshots.drop(str(name))
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def snapshot_names(self) -> list[str]:
        return self.snapshots.names()

    # ------------------------------------------------------------------ training
    def forward_backward(self, batch: Batch, loss: Loss) -> Future[dict[str, float]]:
        """Accumulate the gradients of ``loss`` on ``batch`` on the service: a Tinker built-in
        when it is exact for ``loss``, else ``forward_backward_custom`` (after a local dry run of
        the loss). Returns the loss's own metrics (computed from the logprobs Tinker returns)
        plus ``loss``. A failure on the service is recovered from (see ``max_recoveries``)."""
        plan = plan_loss(loss, batch)
        data = to_tinker_data(batch, plan, self._tinker.types)
        tensors = batch.to_tensors()
        captured: dict[str, Any] = {}
        submit: Callable[[Any], Any]
        if plan.custom:
            dry_run(loss, tensors)
            fn = custom_loss_fn(loss, tensors, captured)
            submit = lambda c: c.forward_backward_custom(data, fn)
        else:
            submit = lambda c: c.forward_backward(data, plan.loss_fn, plan.loss_fn_config)
        with self._lock:
            call = self.calls.submit("forward_backward", submit, stateful=True)
        return self.session.spawn(lambda: loss_metrics(self.calls.result(call), plan, loss, tensors, captured))

    def optim_step(self, params: AdamParams) -> Future[dict[str, float]]:
        """One Adam step on the service (submitted right away, after any queued
        forward_backward); the next ``sample`` refreshes the sampling client."""
        adam = tinker_adam(self._tinker.types, params)
        with self._lock:
            call = self.calls.submit("optim_step", lambda c: c.optim_step(adam), stateful=True)
            self.step += 1
        lr = float(params.learning_rate)
        return self.session.spawn(lambda: optim_metrics(self.calls.result(call), lr))

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
            name = safe_name(f"tempering-{base}-s{self.step}-{next(self._names)}")
            call = self.calls.submit("save_state", lambda c: c.save_state(name, ttl_seconds=ttl), stateful=False)
            step, snaps = self.step, self.snapshots.current()
        state_path = str(self.calls.result(call).path)
        self.calls.saved(call, state_path)
        record = {
            "format": CHECKPOINT_FORMAT,
            "backend": "tinker",
            "tinker_path": state_path,
            "step": step,
            "base_model": self.base_model,
            "rank": self.rank,
            "snapshots": self.snapshots.records(snaps),
            "extra": payload,
            "saved_at": time.time(),
        }
        write_record(path, self.checkpoint_index_dir, record)
        return path

    def load(self, path: str) -> dict[str, Any]:
        """Restore a checkpoint written by :meth:`save` (a local checkpoint folder, or its
        ``tinker://`` state path); returns its ``extra``."""
        record = read_record(str(path), self.checkpoint_index_dir, self.base_model)
        state = str(record["tinker_path"])
        with self._lock:
            self.calls.reset(self._create_training_client(state), state)
            self.step = int(record.get("step") or 0)
            self._sampler = None  # sampled from the restored weights on the next sample()
            self._sampler_version = self.step
            self.snapshots.restore(record.get("snapshots") or {})
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
                name = safe_name(f"tempering-export-s{self.step}-{next(self._names)}")
                call = self.calls.submit(what, lambda c: c.save_weights_external(name, ttl_seconds=ttl), stateful=False)
            export = str(self.calls.result(call).path)
        else:
            client = self._create_training_client(str(state))
            name = safe_name(f"tempering-export-{next(self._names)}")
            export = str(self.session.wait(client.save_weights_external(name, ttl_seconds=ttl), what).path)
        rest = self._tinker.RestClient(base_url=self.base_url, api_key=self.session.api_key)
        try:
            urls = self.session.wait(rest.get_external_weights_urls(export), f"get the download URLs of {export}")
            download_files(dict(urls.urls), dest, self.session.request_timeout)
        finally:
            try:
                self.session.wait(
                    rest.delete_checkpoint_from_tinker_path(export), f"delete the temporary export {export}"
                )
            except TemperingError as err:
                warnings.warn(
                    f"TinkerBackend.download_weights: {err}; it expires in {ttl} s", RuntimeWarning, stacklevel=2
                )
        return dest

    def close(self, status: str | None = None) -> None:
        """Wait for queued work, stop the worker threads and (if this backend created the
        service client) finish the Tinker session with ``status``: by default ``success``,
        ``errored`` when an exception is on its way out of the run (the recipe runner closes the
        backend in a ``finally``) or a training call could not be recovered, ``interrupted``
        for Ctrl-C or a stage that stopped the run."""
        self.session.close(status if status is not None else run_status(sys.exc_info()[1], self.calls.gave_up))


__all__ = ["TinkerBackend", "TinkerSamplingClient", "service_client_factory"]
