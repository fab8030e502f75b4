"""The state and compute behind the local Tinker server: sessions, training runs, checkpoints
and samplers, on :class:`~tempering.plugins.backends.local.backend.LocalBackend`.

Each training run (``create_model`` / ``load_weights``) is a ``LocalBackend`` with a LoRA
adapter of the run's rank on its own copy of the served model (built in code, or pretrained); its built-in losses are
:mod:`~tempering.plugins.tinker_server.builtin_losses` evaluated by the local backend's
``forward_backward``, so the server computes exactly what Tinker's documentation says, with our
own training code. What Tinker guarantees and this service keeps:

* a run's requests execute in ``seq_id`` order, whatever order they arrive in (the SDK sends a
  forward_backward's chunks in parallel, the first one last); a request refused (a bad TTL, a
  name taken, a checkpoint that does not fit) is a failed future of category ``user`` that
  still consumes its ``seq_id`` -- never an HTTP status the SDK would retry (it retries 409 for
  five minutes whatever the headers say) and never a hole in the order that stalls the run;
* nothing waits forever on a client: a ``seq_id`` missing for ``gap_timeout_seconds`` is given
  up (the requests behind it run; it fails if it comes late), and a session silent for
  ``session_timeout_seconds`` (no heartbeat, no request) expires: its runs' queued requests
  fail and their models are released;
* the server runs for days: a finished or expired session frees everything it held (its runs,
  sampling sessions, records; see :meth:`LocalService._close_runs`), a run keeps only its newest
  ``keep_sampling_clients`` sampling clients in memory, a checkpoint's TTL is enforced, and
  ``keep_checkpoints`` keeps each run's newest N states and sampler weights;
* a saved state or sampler checkpoint keeps its name unless ``overwrite``, and a TTL is
  ``None`` or at least 3600 s;
* ``snapshot`` sampling sessions sample fixed weights; ``inflight`` ones sample the newest
  weights their run published (weights saved when the client was created, or newer);
* the base model of a run is the run at step 0 (the adapter starts at zero).

Differences from the service, on purpose: samples come from the local backend (its sampler
logprobs are those of the distribution sampled from; it always stops at the model's EOS, so
``stop=[]`` does not disable EOS here); ``train_mlp``/``train_attn``/``train_unembed`` are
ignored; a run's live state does
not survive a restart (its checkpoints do: :mod:`~tempering.plugins.tinker_server.registry`);
top-k logprobs (prompt and sampled) are of the model's untempered distribution.

Operations return :class:`concurrent.futures.Future` (the server's futures); a problem with a
request raises :class:`Rejected` (an HTTP status at submission) or, inside a future,
:class:`UserError` (a failed future of category ``user``); any other failure is a ``server``
failure.
"""

from __future__ import annotations

import datetime
import inspect
import itertools
import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from tempering.interfaces import LossOutput
from tempering.plugins.backends.common import failed, resolved
from tempering.plugins.backends.local.backend import LocalBackend, LocalSamplingClient
from tempering.plugins.backends.local.memory import give_back
from tempering.plugins.backends.local.model_source import registered_builder
from tempering.plugins.tinker_server.batching import SampleBatcher
from tempering.plugins.tinker_server.builtin_losses import builtin_loss, check_builtin
from tempering.plugins.tinker_server.registry import CheckpointRecord, Registry, RunRecord
from tempering.plugins.tinker_server.stability import StabilityRecords, session_of
from tempering.runs.rng import kept_rng
from tempering.types import AdamParams, Batch, Datum, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tinker import types

    from tempering.plugins.tinker_server.wire import ForwardBackwardCall

__all__ = ["ServedModel", "LocalService", "Rejected", "UserError", "MIN_TTL_SECONDS"]

_BUILDING = threading.RLock()  # see LocalService._backend

#: The SDK documents checkpoint TTLs "between 1 hour (3600) and 10 years".
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 3600, 10 * 365 * 24 * 3600


class Rejected(Exception):
    """A request refused at submission with an HTTP status (the SDK raises it as an API error)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class UserError(Exception):
    """A request that failed because of what it asked for (a failed future, category ``user``)."""


@dataclass
class ServedModel:
    """A base model the server serves: a local-backend model source (a registered builder such
    as ``tiny_llama`` or ``smollm2``, a Hugging Face folder, or a callable returning ``(model,
    tokenizer)``) and its keyword arguments. ``lora=False`` trains every weight instead of an
    adapter. ``seed`` reaches only builders that take one (models built in code)."""

    model: str | Callable[..., tuple[Any, Any]] = "tiny_llama"
    model_kwargs: dict[str, Any] = field(default_factory=dict)
    lora: bool = True
    seed: int = 0  # the base weights' seed (a run's own seed only initialises its adapter)


def _then(future: Future[Any], fn: Callable[[Any], Any]) -> Future[Any]:
    """A future of ``fn(future.result())``."""
    out: Future[Any] = Future()

    def done(f: Future[Any]) -> None:
        try:
            out.set_result(fn(f.result()))
        except BaseException as err:  # noqa: BLE001 - the future carries it
            out.set_exception(err)

    future.add_done_callback(done)
    return out


def _utcnow() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def _check_ttl(ttl: int | None) -> None:
    if ttl is not None and not MIN_TTL_SECONDS <= int(ttl) <= MAX_TTL_SECONDS:
        raise Rejected(400, f"ttl_seconds must be between {MIN_TTL_SECONDS} and {MAX_TTL_SECONDS} (or null), got {ttl}")


class SamplingWeights:
    """The weights a sampling session samples: a frozen snapshot of a run, a run's inflight
    target, or a base model (``client=None``: the owner's live, never-trained weights)."""

    #: Batch concurrent requests (:class:`~tempering.plugins.tinker_server.batching.SampleBatcher`);
    #: set by the service (``batch_sampling``); off, each request is its own generate call.
    batching = False

    def __init__(
        self,
        owner: LocalBackend,
        base_model: str,
        client: LocalSamplingClient | None = None,
        snapshot: str | None = None,
        path: str | None = None,
    ) -> None:
        self.owner, self.base_model, self.client, self.snapshot, self.path = owner, base_model, client, snapshot, path
        self._batcher: SampleBatcher | None = None
        self._batcher_lock = threading.Lock()
        self.retired = False  # its owner was released (the run's session ended): reload from ``path``

    def sample(self, prompt: list[int], n: int, params: SamplingParams) -> Future[list[Any]]:
        target = self.client if self.client is not None else self.owner
        if not self.batching:
            return _then(target.sample([prompt], n, params), lambda groups: groups[0])
        with self._batcher_lock:
            if self._batcher is None:
                self._batcher = SampleBatcher(target.sample)
        return self._batcher.sample(prompt, n, params)

    def score(self, prompt: list[int], topk: int = 0) -> Future[Any]:
        """Logprobs of each prompt token after the first (``topk``: the top-k pairs per position)."""
        batch = Batch([Datum(prompt[:-1], prompt[1:], [0.0] * (len(prompt) - 1))])
        if topk:
            return _then(self.owner.distributions(batch, weights=self.snapshot, topk=topk), lambda rows: rows[0])
        return _then(self.owner.logprobs(batch, weights=self.snapshot), lambda rows: rows[0])


class InflightWeights:
    """A session of a run's inflight weights: whatever the run published last, at sample time."""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.base_model = run.base_model
        self.path = None

    def sample(self, prompt: list[int], n: int, params: SamplingParams) -> Future[list[Any]]:
        return self._published().sample(prompt, n, params)

    def score(self, prompt: list[int], topk: int = 0) -> Future[Any]:
        return self._published().score(prompt, topk)

    def _published(self) -> SamplingWeights:
        """What the run published last (a session of a run that published nothing yet is refused
        where it is created, so there always is one here)."""
        assert self.run.inflight is not None, "an inflight session of a run that published no weights"
        return self.run.inflight


class TrainingRun:
    """One training model: a local backend and the ``seq_id`` order of its requests."""

    def __init__(self, model_id: str, base_model: str, rank: int, backend: LocalBackend) -> None:
        self.model_id, self.base_model, self.rank, self.backend = model_id, base_model, rank, backend
        self.inflight: SamplingWeights | None = None
        self.closed: str | None = None  # why the run takes no more requests
        self._next = 1  # seq 0 is the request that created the run
        self._waiting: dict[int, tuple[Callable[[], Future[Any]], Future[Any], float]] = {}
        self._lock = threading.Lock()
        self.names: set[str] = set()
        self._snapshots = itertools.count()
        self.published: list[SamplingWeights] = []  # its sampling clients' weights in memory, oldest first

    def run(self, seq_id: int, fn: Callable[[], Future[Any]]) -> Future[Any]:
        """Run ``fn`` (which submits to the backend) once every earlier ``seq_id`` has run."""
        out: Future[Any] = Future()
        with self._lock:
            if self.closed is not None:
                out.set_exception(UserError(f"training run {self.model_id} is closed: {self.closed}"))
            elif int(seq_id) < self._next:
                out.set_exception(
                    UserError(
                        f"request seq_id {seq_id} of {self.model_id} came after its place in the "
                        "order was given up (or used); the client must start again from a checkpoint"
                    )
                )
            else:
                self._waiting[int(seq_id)] = (fn, out, time.monotonic())
                self._drain()
        return out

    def skip(self, seq_id: int) -> None:
        """A request refused at submission still takes its place in the order."""
        self.run(seq_id, lambda: failed(UserError("refused at submission")))

    def admit(self, seq_id: int, check: Callable[[], None]) -> Future[Any] | None:
        """The checks of a request at submission: one they refuse (:class:`Rejected` or
        :class:`UserError`) takes its place in the order and becomes a failed future of
        category ``user`` (returned); None when the request may go on."""
        try:
            check()
        except (Rejected, UserError) as err:
            self.skip(seq_id)
            return failed(UserError(str(err)))
        return None

    def give_up_gaps(self, timeout: float) -> list[int]:
        """Skip the ``seq_id`` s that a waiting request has waited for longer than ``timeout``
        (their client died, or lost them); returns the ids given up."""
        with self._lock:
            if not self._waiting or self._next in self._waiting:
                return []
            first = min(self._waiting)
            if time.monotonic() - self._waiting[first][2] < timeout:
                return []
            missing = list(range(self._next, first))
            self._next = first
            self._drain()
            return missing

    def close(self, why: str) -> None:
        """Fail every queued request and refuse new ones (the model is released by the caller)."""
        with self._lock:
            self.closed = why
            waiting, self._waiting = self._waiting, {}
        for _, out, _ in waiting.values():
            out.set_exception(UserError(f"training run {self.model_id} closed: {why}"))

    def _drain(self) -> None:
        while self._next in self._waiting:
            fn, out, _ = self._waiting.pop(self._next)
            self._next += 1
            try:
                inner = fn()
            except BaseException as err:  # noqa: BLE001 - a request's failure is its future's
                out.set_exception(err)
                continue
            inner.add_done_callback(partial(_relay, out=out))

    def snapshot_name(self) -> str:
        return f"sampler-{next(self._snapshots)}"


class BuiltinLoss:
    """One of Tinker's built-in losses as a local-backend loss: the sum over datums of
    :func:`builtin_loss`, on the real (unpadded) positions of each row. Keeps each row's target
    logprobs (``rows``) for the response."""

    needs_all_positions = True  # Tinker returns every position's logprob, trained or not

    def __init__(self, loss_fn: str, config: Mapping[str, Any] | None, keys: frozenset[str], two_d: bool) -> None:
        self.loss_fn, self.config, self.keys, self.two_d = loss_fn, dict(config or {}), keys, two_d
        self.needs_logits = two_d
        self.tinker_builtin: str | None = None  # the Loss protocol's: this loss is computed here, not sent on
        self.rows: list[torch.Tensor] = []

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput:
        names = {
            "weights": "weights",
            "logprobs": "sampler_logprobs",
            "advantages": "advantages",
            "sequence_ratio_mask": "sequence_ratio_mask",
        }
        total, self.rows = logprobs.new_zeros(()), []
        for b, n in enumerate(batch["attention_mask"].sum(-1).tolist()):
            if self.two_d:
                ids = batch["soft_ids"][b, :n].long()
                row = torch.log_softmax(batch["logits"][b, :n].float(), dim=-1).gather(-1, ids)
                inputs = {"target_tokens": ids, "weights": batch["soft_weights"][b, :n]}
            else:
                row = logprobs[b, :n]
                inputs = {"target_tokens": batch["target_ids"][b, :n]}
                inputs.update({k: batch[names[k]][b, :n] for k in self.keys if k != "target_tokens"})
            total = total + builtin_loss(self.loss_fn, self.config, row, inputs)
            self.rows.append(row.detach())
        return LossOutput(total, {})


def _to_batch(
    data: list[Any],
    loss_fn: str,
    config: Mapping[str, Any] | None,
    recorded: Callable[[Any, list[int], list[bool]], list[float | None]] | None = None,
) -> tuple[Batch, BuiltinLoss]:
    """Tinker datums -> our rows (and the loss that reads them), after the checks of a strict
    server: the loss's input and config keys, and one value per ``model_input`` position.
    ``stable_reinforce`` takes its sampler logprobs from ``recorded(datum, targets, needed)``
    (the server's records, matched where the advantage is non-zero; the client's ``logprobs``
    fill the prompt positions no sampler scored)."""
    rows, keys = [], None
    for i, datum in enumerate(data):
        tokens = datum.model_input.to_ints()
        inputs = {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()}
        these = frozenset(inputs)
        if keys is not None and these != keys:
            raise UserError(f"datum {i} has loss_fn_inputs {sorted(these)}, datum 0 {sorted(keys)}")
        keys = these
        try:
            check_builtin(loss_fn, config, these)
        except ValueError as err:
            raise UserError(str(err)) from err
        for key, value in inputs.items():
            if value.shape[0] != len(tokens):
                raise UserError(
                    f"datum {i}: loss_fn_inputs[{key!r}] has {value.shape[0]} positions, model_input {len(tokens)}"
                )
        target = inputs["target_tokens"]
        if target.dtype != np.int64:
            raise UserError(f"datum {i}: target_tokens must be int64, got {target.dtype}")
        extra: dict[str, Any] = {}
        if target.ndim == 2:
            if loss_fn != "cross_entropy":
                raise UserError(f"(N, K) target_tokens are for cross_entropy, not {loss_fn}")
            extra = {
                "soft_ids": target.tolist(),
                "soft_weights": inputs.get("weights", np.zeros(target.shape)).tolist(),
            }
            target = target[:, 0]
        if "sequence_ratio_mask" in inputs:
            extra["sequence_ratio_mask"] = inputs["sequence_ratio_mask"].tolist()
        weights = (
            inputs["weights"].tolist() if "weights" in inputs and inputs["weights"].ndim == 1 else [0.0] * len(tokens)
        )
        sampler = inputs["logprobs"].tolist() if "logprobs" in inputs else None
        if loss_fn == "stable_reinforce":
            if recorded is None:
                raise UserError("stable_reinforce needs the server's sampling records")
            try:
                found = recorded(datum, target.tolist(), (inputs["advantages"] != 0).tolist())
            except ValueError as err:
                raise UserError(f"datum {i}: {err}") from err
            given = sampler or [0.0] * len(tokens)
            sampler = [given[t] if q is None else q for t, q in enumerate(found)]
        rows.append(
            Datum(
                tokens,
                target.tolist(),
                weights,
                sampler,
                inputs["advantages"].tolist() if "advantages" in inputs else None,
                extra,
            )
        )
    two_d = bool(rows) and "soft_ids" in rows[0].extra
    if loss_fn == "stable_reinforce":
        keys = (keys or frozenset()) | {"logprobs"}
    return Batch(rows), BuiltinLoss(loss_fn, config, keys or frozenset(), two_d)


def _builder_kwargs(spec: ServedModel) -> dict[str, Any]:
    """The served model's keyword arguments, with its ``seed`` for a builder that takes one: the
    base weights of a model built in code come from that seed, not from a run's (which only
    seeds its adapter). A pretrained model (``smollm2``, a folder) has no seed to give."""
    builder = spec.model if callable(spec.model) else registered_builder(spec.model)
    params = inspect.signature(builder).parameters.values() if builder is not None else ()
    if not any(p.name == "seed" or p.kind is p.VAR_KEYWORD for p in params):
        return dict(spec.model_kwargs)
    return {**spec.model_kwargs, "seed": spec.seed}


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


@dataclass
class SampleResult:
    """What a sampling request returns (rendered by the server as a protobuf ``SampleResponse``)."""

    completions: list[Any]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt: list[Any] | None = None
    k: int = 0
    topk_sampled: list[list[Any]] | None = None
    k_sampled: int = 0


@dataclass
class _Session:
    status: str | None = None  # None: open; else how it ended ("success", "expired", ...)
    seen: float = field(default_factory=time.monotonic)


def _topk_rows(result: Any) -> list[list[tuple[int, float]]]:
    """``(values, ids)`` of :meth:`LocalBackend.distributions` -> per position ``[(id, lp), ...]``."""
    values, ids = result
    return [list(zip(i.tolist(), v.tolist())) for v, i in zip(values, ids)]


class LocalService:
    """Sessions, training runs, checkpoints and sampling sessions (see the module docstring).

    Args:
        models: base-model name -> :class:`ServedModel` (or a mapping of its fields).
        root: a folder for checkpoints, tokenizers and ``registry.json`` (reused across restarts).
        session_timeout_seconds: a session with no heartbeat and no request for this long expires.
        gap_timeout_seconds: how long a run's request waits for a missing earlier ``seq_id``.
        batch_sampling: batch concurrent sampling requests while the model is busy (much faster
            under a cookbook RL step; off, each request is one generate call, timing-independent).
        keep_checkpoints: keep only the newest N saved states and the newest N sampler weights of
            each training run (older ones are deleted as a new one is saved; published ones are
            kept); None keeps all. A checkpoint's TTL (``ttl_seconds``) is enforced either way.
        keep_sampling_clients: how many of a run's newest sampling clients
            (``save_weights_and_get_sampling_client``, named sampler weights) stay in memory;
            see :meth:`_keep_newest`.
    """

    def __init__(
        self,
        models: Mapping[str, ServedModel | Mapping[str, Any]],
        root: str,
        session_timeout_seconds: float = 60.0,
        gap_timeout_seconds: float = 30.0,
        batch_sampling: bool = False,
        keep_checkpoints: int | None = None,
        keep_sampling_clients: int = 16,
    ) -> None:
        self.models = {
            name: spec if isinstance(spec, ServedModel) else ServedModel(**spec) for name, spec in models.items()
        }
        self.root = root
        self.session_timeout_seconds, self.gap_timeout_seconds = (
            float(session_timeout_seconds),
            float(gap_timeout_seconds),
        )
        self.registry = Registry(root)
        for run_id, record in self.registry.runs.items():  # live state died with the last process
            if record.closed is None:
                self.registry.close_run(run_id, "the server restarted")
        self.records = StabilityRecords()
        self.sessions: dict[str, _Session] = {}
        self.runs: dict[str, TrainingRun] = {}
        self.samplers: dict[str, SamplingWeights | InflightWeights] = {}  # sampling session id -> sampler
        self.sampler_paths: dict[str, SamplingWeights] = {}  # tinker path -> saved sampler weights (loaded)
        self.request_sessions: dict[str, str] = {}  # server future id -> session (a poll is a sign of life)
        self._bases: dict[str, LocalBackend] = {}
        self._tokenizer_dirs: dict[str, str] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tinker-sample")
        self.batch_sampling = bool(batch_sampling)
        if keep_checkpoints is not None and keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be at least 1 (or None: keep all), got {keep_checkpoints}")
        self.keep_checkpoints = keep_checkpoints
        if keep_sampling_clients < 1:
            raise ValueError(f"keep_sampling_clients must be at least 1, got {keep_sampling_clients}")
        self.keep_sampling_clients = int(keep_sampling_clients)
        self.released: dict[str, str] = {}  # sampling session -> why it was released (a 404's message)
        #: padded tokens per forward/backward call (a request's datums are split to fit; see _micro_batches)
        self.micro_batch_tokens = 2048

    def _sampler(self, *args: Any) -> SamplingWeights:
        sampler = SamplingWeights(*args)
        sampler.batching = self.batch_sampling
        return sampler

    # ------------------------------------------------------------------ checkpoints (views)
    @property
    def states(self) -> dict[str, CheckpointRecord]:
        """Saved training states by ``tinker://`` path."""
        return {p: c for p, c in self.registry.checkpoints.items() if c.checkpoint_type == "training"}

    @property
    def external(self) -> dict[str, str]:
        """External (Hugging Face) exports by ``tinker://`` path -> folder."""
        return {p: c.folder for p, c in self.registry.checkpoints.items() if c.checkpoint_type == "external"}

    def _folder(self, kind: str, path: str) -> str:
        return os.path.join(self.root, kind, _safe(path.removeprefix("tinker://")))

    # ------------------------------------------------------------------ models
    def _spec(self, base_model: str) -> ServedModel:
        if base_model not in self.models:
            raise UserError(f"unknown base model {base_model!r}; this server serves {sorted(self.models)}")
        return self.models[base_model]

    def _backend(self, base_model: str, lora_rank: int | None, seed: int) -> LocalBackend:
        spec = self._spec(base_model)
        kwargs: dict[str, Any] = {"model_kwargs": _builder_kwargs(spec), "seed": seed}
        if callable(spec.model):
            kwargs["model_builder"] = spec.model
        else:
            kwargs["model"] = spec.model
        lora = {"rank": int(lora_rank)} if spec.lora and lora_rank else None
        # Building a backend seeds torch's global RNG and draws the base weights from it: two at once
        # (runs created concurrently) would interleave and get different base models. One at a time,
        # and the RNG put back, since the client (same process in tests) uses it too.
        with _BUILDING, kept_rng():
            return LocalBackend(lora=lora, **kwargs)

    def base(self, base_model: str) -> LocalBackend:
        """The never-trained model (base-model sampling sessions, tokenizer)."""
        with self._lock:
            if base_model not in self._bases:
                self._bases[base_model] = self._backend(
                    base_model, None, self.models[base_model].seed if base_model in self.models else 0
                )
            return self._bases[base_model]

    def tokenizer_dir(self, base_model: str) -> str:
        """A folder holding the model's tokenizer (``save_pretrained``)."""
        with self._lock:
            if base_model not in self._tokenizer_dirs:
                path = os.path.join(self.root, "tokenizers", _safe(base_model))
                self.base(base_model).tokenizer.save_pretrained(path)
                self._tokenizer_dirs[base_model] = path
            return self._tokenizer_dirs[base_model]

    def close(self) -> None:
        """Release every model (their worker threads)."""
        for backend in [run.backend for run in self.runs.values()] + list(self._bases.values()):
            backend.close()
        for sampler in self.sampler_paths.values():
            if sampler.owner not in self._bases.values():
                sampler.owner.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ sessions
    def create_session(self) -> str:
        session = f"session-{secrets.token_hex(6)}"  # unique across restarts: run ids derive from it
        self.sessions[session] = _Session()
        return session

    def seen(self, identifier: str | None) -> None:
        """A request from the session ``identifier`` starts with: it is alive."""
        if identifier:
            state = self.sessions.get(session_of(identifier))
            if state is not None:
                state.seen = time.monotonic()

    def heartbeat(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise Rejected(404, f"no session {session_id!r}")
        if self.sessions[session_id].status is not None:
            raise Rejected(410, f"session {session_id!r} has finished ({self.sessions[session_id].status})")
        self.seen(session_id)

    def finish(self, session_id: str, status: str) -> None:
        if session_id in self.sessions and self.sessions[session_id].status is None:
            self.sessions[session_id].status = status  # first wins, as on the service
            self._close_runs(session_id, f"its session {session_id} finished ({status})")

    def reap(self) -> list[str]:
        """Expire silent sessions and give up missing ``seq_id`` s: what the server's
        housekeeping thread calls every second. Returns what it did, one line each."""
        done: list[str] = []
        stamp = time.monotonic()
        for session_id, state in list(self.sessions.items()):
            if state.status is None and stamp - state.seen > self.session_timeout_seconds:
                state.status = "expired"
                why = f"its session {session_id} sent no heartbeat or request for {self.session_timeout_seconds:g} s"
                done += [f"closed {run}: {why}" for run in self._close_runs(session_id, why)]
        done += self.expire_checkpoints()
        for run in list(self.runs.values()):
            missing = run.give_up_gaps(self.gap_timeout_seconds)
            if missing:
                done.append(f"{run.model_id}: gave up seq_id {missing} after {self.gap_timeout_seconds:g} s")
        return done

    def _close_runs(self, session_id: str, why: str) -> list[str]:
        """End a session's runs and sampling sessions and free what they held: queued requests
        fail, each run's model (training copy, sampling copy, snapshots, optimizer) is released,
        and so are the session's sampling sessions, its ``stable_reinforce`` records and any
        sampler weights loaded from disk that no live sampling session uses any more. The runs
        stay in the registry (their checkpoints outlive them); a later request to one answers
        404 naming its saved states. Returns the runs closed."""
        closed, released = [], []
        for model_id, run in list(self.runs.items()):
            if session_of(model_id) == session_id and run.closed is None:
                run.close(why)
                run.backend.close()  # finishes what is running, then frees the worker
                released.append(run.backend)
                self.registry.close_run(model_id, why)
                del self.runs[model_id]
                closed.append(model_id)
        for path, sampler in list(self.sampler_paths.items()):
            if sampler.owner in released:  # loaded again from disk when someone asks for it
                del self.sampler_paths[path]
        for name, used in list(self.samplers.items()):
            if session_of(name) == session_id:
                del self.samplers[name]
            elif isinstance(used, SamplingWeights) and used.owner in released:
                used.retired = True  # another session's; reloaded from its path at its next use
        for name in [n for n in self.released if session_of(n) == session_id]:
            del self.released[name]
        self.records.drop_session(session_id)
        self._drop_unused_loaded()
        give_back()
        return closed

    def _drop_unused_loaded(self) -> None:
        """Release sampler weights loaded from disk (:meth:`_sampler_at`) that no sampling
        session uses: each is a model copy of its own."""
        with self._lock:
            live = {id(s) for s in self.samplers.values()}
            owners = {id(run.backend) for run in self.runs.values()} | {id(b) for b in self._bases.values()}
            for path, sampler in list(self.sampler_paths.items()):
                if id(sampler) not in live and id(sampler.owner) not in owners:
                    del self.sampler_paths[path]
                    sampler.owner.close()

    def run(self, model_id: str) -> TrainingRun:
        self.seen(model_id)
        if model_id not in self.runs:
            record = self.registry.runs.get(model_id)
            if record is not None:
                saved = [
                    c.tinker_path for c in self.registry.checkpoints_of(model_id) if c.checkpoint_type == "training"
                ]
                raise Rejected(
                    404,
                    f"training run {model_id} is closed ({record.closed}); its saved states: "
                    f"{saved or 'none'} (create_training_client_from_state loads one into a new run)",
                )
            raise Rejected(404, f"no training run {model_id!r}")
        self.registry.touch(model_id)
        return self.runs[model_id]

    # ------------------------------------------------------------------ training runs
    def _new_run(self, model_id: str, base_model: str, rank: int, backend: LocalBackend, metadata: Any) -> None:
        self.runs[model_id] = TrainingRun(model_id, base_model, rank, backend)
        meta = {str(k): str(v) for k, v in dict(metadata or {}).items()} or None
        self.registry.add_run(
            RunRecord(model_id, base_model, rank if backend.lora is not None else None, session_of(model_id), meta)
        )

    def create_model(self, req: types.CreateModelRequest) -> tuple[str, Future[Any]]:
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        self.seen(req.session_id)
        rank = req.lora_config.rank if req.lora_config is not None else 32
        seed = req.lora_config.seed if req.lora_config is not None and req.lora_config.seed is not None else 0
        try:
            backend = self._backend(req.base_model, rank, seed)
        except UserError as err:
            return model_id, failed(err)
        self._new_run(model_id, req.base_model, rank, backend, req.user_metadata)
        return model_id, resolved({"model_id": model_id, "type": "create_model"})

    def info(self, model_id: str) -> dict[str, Any]:
        run = self.run(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "is_lora": run.backend.lora is not None,
            "lora_rank": run.rank,
            "model_name": run.base_model,
            "model_data": {
                "arch": "llama",
                "model_name": run.base_model,
                "tokenizer_id": self.tokenizer_id(run.base_model),
            },
        }

    def tokenizer_id(self, base_model: str) -> str:
        """What ``get_info`` names as the tokenizer: the served name when the client can load it
        by that name (the server placed it in the Hugging Face cache, see
        :mod:`~tempering.plugins.tinker_server.tokenizers`), else the folder it saved."""
        from tempering.plugins.tinker_server.tokenizers import cached_name

        return cached_name(base_model) or self.tokenizer_dir(base_model)

    def forward_backward(
        self, call: ForwardBackwardCall
    ) -> Future[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
        run = self.run(call.model_id)
        session = session_of(call.model_id)

        def go() -> Future[Any]:
            batch, loss = _to_batch(
                call.data,
                call.loss_fn,
                call.loss_fn_config,
                lambda datum, targets, needed: self.records.sampler_logprobs(datum, targets, session, needed),
            )
            parts = []  # micro-batches: the losses are sums over datums, so gradients accumulate exactly
            for rows in _micro_batches(batch.data, self.micro_batch_tokens):
                part, part_loss = Batch(rows), BuiltinLoss(loss.loss_fn, loss.config, loss.keys, loss.two_d)
                if call.forward_only and loss.two_d:  # (N, K) targets: each candidate's logprob
                    parts.append(
                        _then(run.backend.distributions(part), partial(self._score_forward_2d, part, part_loss))
                    )
                elif call.forward_only:
                    parts.append(_then(run.backend.logprobs(part), partial(self._score_forward, part, part_loss)))
                else:
                    parts.append(
                        _then(run.backend.forward_backward(part, part_loss), partial(self._outputs_of, part_loss))
                    )
            return _then(_all(parts), _joined)

        return run.run(call.seq_id, go)

    @staticmethod
    def _outputs(loss: BuiltinLoss, total: float) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        return [{"logprobs": r.cpu().numpy()} for r in loss.rows], {"loss:sum": float(total)}

    @classmethod
    def _outputs_of(
        cls, loss: BuiltinLoss, metrics: Mapping[str, float]
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """:meth:`_outputs` of a finished ``forward_backward`` (its metrics hold the loss)."""
        return cls._outputs(loss, metrics["loss"])

    def _score_forward_2d(self, batch: Batch, loss: BuiltinLoss, dists: list[torch.Tensor]) -> Any:
        """A forward of ``(N, K)`` ``target_tokens`` (``cross_entropy`` only): the ``(N, K)``
        logprobs of the candidates, gathered from each position's full distribution, and the
        loss ``-sum(weights * logprobs)`` -- what the SDK's ``forward_backward_custom`` reads
        (the cookbook's SDFT with ``reverse=true`` sends the teacher's top-K this way)."""
        total, loss.rows = 0.0, []
        for datum, dist in zip(batch.data, dists):
            ids = torch.tensor(datum.extra["soft_ids"], dtype=torch.long)
            row = dist.float().gather(-1, ids)
            weights = torch.tensor(datum.extra["soft_weights"], dtype=torch.float32)
            total += float(builtin_loss(loss.loss_fn, loss.config, row, {"target_tokens": ids, "weights": weights}))
            loss.rows.append(row)
        return self._outputs(loss, total)

    def _score_forward(self, batch: Batch, loss: BuiltinLoss, rows: list[list[float]]) -> Any:
        width = max(len(r) for r in rows)
        lp = torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)
        with torch.no_grad():
            total = loss(lp, batch.to_tensors()).loss
        return self._outputs(loss, float(total))

    def optim_step(self, req: Any) -> Future[Any]:
        run, p = self.run(req.model_id), req.optim_params

        def check() -> None:
            if not hasattr(p, "beta2"):
                raise UserError(
                    f"this server trains with Adam, got optimizer params of type {getattr(p, 'type', '?')!r}"
                )

        if (refused := run.admit(req.seq_id, check)) is not None:
            return refused
        params = AdamParams(
            learning_rate=p.learning_rate,
            beta1=p.beta1,
            beta2=p.beta2,
            eps=p.eps,
            weight_decay=p.weight_decay,
            grad_clip_norm=p.grad_clip_norm,
        )
        return run.run(req.seq_id, lambda: _then(run.backend.optim_step(params), lambda m: {"metrics": m}))

    def _check_name(self, path: str, overwrite: bool, what: str) -> None:
        if path in self.registry.checkpoints and not overwrite:
            raise UserError(
                f"{what} {path} already exists (a name is taken once; pass overwrite=True where the call "
                "takes it, or choose another name)"
            )

    def save_state(self, req: Any) -> Future[Any]:
        run = self.run(req.model_id)
        path = f"tinker://{req.model_id}/weights/{req.path}"

        def check() -> None:
            _check_ttl(req.ttl_seconds)
            self._check_name(path, req.overwrite, "a checkpoint")

        if (refused := run.admit(req.seq_id, check)) is not None:
            return refused
        folder = self._folder("states", path)

        def go() -> Future[Any]:
            # returns once written, after every earlier call; without the server's own sampler
            # snapshots (one adapter copy per sampling client made, a state would grow with each)
            run.backend.save(folder, snapshots=False)
            self._saved(
                CheckpointRecord(path, "training", folder, run.base_model, run.rank, user_metadata=req.user_metadata),
                req.ttl_seconds,
            )
            return resolved({"path": path, "type": "save_weights"})

        return run.run(req.seq_id, go)

    def _saved(self, record: CheckpointRecord, ttl_seconds: int | None) -> None:
        """Register a checkpoint just written (with its expiry), then apply the retention rule."""
        if ttl_seconds is not None:
            record.expires_at = (_utcnow() + datetime.timedelta(seconds=int(ttl_seconds))).isoformat()
        self.registry.add_checkpoint(record)
        if self.keep_checkpoints is None:
            return
        same = [
            c
            for c in self.registry.checkpoints_of(record.run_id)
            if c.checkpoint_type == record.checkpoint_type and not c.public
        ]
        for old in same[: -self.keep_checkpoints]:
            self.delete_checkpoint(old.tinker_path)

    def expire_checkpoints(self) -> list[str]:
        """Delete the checkpoints whose TTL ran out (the housekeeping thread calls it)."""
        stamp, done = _utcnow(), []
        for record in list(self.registry.checkpoints.values()):
            if record.expires_at and datetime.datetime.fromisoformat(record.expires_at) <= stamp:
                self.delete_checkpoint(record.tinker_path)
                done.append(f"deleted {record.tinker_path}: its TTL ran out ({record.expires_at})")
        return done

    def _checkpoint(self, path: str, kinds: tuple[str, ...] = ("training",)) -> CheckpointRecord:
        record = self.registry.checkpoints.get(path)
        if record is None or record.checkpoint_type not in kinds:
            known = [c.tinker_path for c in self.registry.checkpoints.values() if c.checkpoint_type in kinds][-5:]
            raise UserError(f"no saved state at {path} (the newest this server has: {known or 'none'})")
        return record

    def _load_into(self, backend: LocalBackend, record: CheckpointRecord, optimizer: bool) -> None:
        """Weights (and, with ``optimizer``, the optimizer state) of a saved state."""
        with _BUILDING, kept_rng():  # loading restores the saved RNGs, which the client (same process in tests) uses
            backend.load(record.folder)
        if not optimizer:  # weights only: the next optim_step starts a fresh Adam
            backend._submit(lambda: setattr(backend._trainer, "optimizer", None)).result()

    def load_state(self, req: types.LoadWeightsRequest) -> tuple[str, Future[Any]]:
        """``load_weights``: a saved state into a new run (``create_training_client_from_state``,
        with or without its optimizer state) or into a live run, in its order
        (``load_state`` / ``load_state_with_optimizer``)."""
        if req.session_id is not None:
            model_id = f"{req.session_id}:train:{req.model_seq_id}"
            self.seen(req.session_id)
            try:
                record = self._checkpoint(req.path)
                base_model = req.base_model or record.base_model
                backend = self._backend(base_model, record.lora_rank, 0)
                self._load_into(backend, record, bool(req.optimizer))
            except (UserError, ValueError, FileNotFoundError) as err:
                return model_id, failed(UserError(str(err)))
            self._new_run(model_id, base_model, record.lora_rank or 0, backend, req.user_metadata)
            return model_id, resolved({"path": req.path, "model_id": model_id, "type": "load_weights"})
        if req.model_id is None or req.seq_id is None:
            raise Rejected(400, "load_weights needs session_id and model_seq_id (a new run) or model_id and seq_id")
        run = self.run(req.model_id)
        found: list[CheckpointRecord] = []

        def check() -> None:
            record = self._checkpoint(req.path)
            if record.base_model != run.base_model or record.lora_rank != run.rank:
                raise UserError(
                    f"{req.path} is a state of {record.base_model} (LoRA rank {record.lora_rank}); run "
                    f"{req.model_id} trains {run.base_model} (rank {run.rank})"
                )
            found.append(record)

        if (refused := run.admit(req.seq_id, check)) is not None:
            return req.model_id, refused

        def go() -> Future[Any]:
            self._load_into(run.backend, found[0], bool(req.optimizer))
            return resolved({"path": req.path, "type": "load_weights"})

        return req.model_id, run.run(req.seq_id, go)

    def save_for_sampler(self, req: Any) -> Future[Any]:
        """Named: sampler weights at a ``tinker://`` path (also written to disk, so they outlive
        the process). Unnamed: a sampling session of a snapshot (``kind=snapshot``) or of the
        run's inflight weights (``kind=inflight``)."""
        run = self.run(req.model_id)
        path = f"tinker://{req.model_id}/sampler_weights/{req.path}" if req.path else None

        def check() -> None:
            if path is not None:
                _check_ttl(req.ttl_seconds)
                self._check_name(path, False, "sampler weights")

        if (refused := run.admit(req.seq_id, check)) is not None:
            return refused

        def go() -> Future[Any]:
            name = run.snapshot_name()
            if path is not None:
                folder = self._folder("sampler_weights", path)
                run.backend.save(folder, optimizer=False, snapshots=False)  # weights to sample, nothing else
                self._saved(
                    CheckpointRecord(
                        path, "sampler", folder, run.base_model, run.rank, user_metadata=req.user_metadata
                    ),
                    req.ttl_seconds,
                )
            return _then(
                run.backend.sampling_client(snapshot=name),  # one copy: the client's, also scored with
                lambda client: publish(self._sampler(run.backend, run.base_model, client, name, path)),
            )

        def publish(sampler: SamplingWeights) -> dict[str, Any]:
            self._keep_newest(run, sampler)
            if path is not None:
                self.sampler_paths[path] = sampler
                return {"path": path, "type": "save_weights_for_sampler"}
            session = f"{req.model_id}:sample:{req.sampling_session_seq_id}"
            if req.kind == "inflight":
                run.inflight = sampler
                self.samplers[session] = InflightWeights(run)
            else:
                self.samplers[session] = sampler
            return {"sampling_session_id": session, "type": "save_weights_for_sampler"}

        return run.run(req.seq_id, go)

    def _keep_newest(self, run: TrainingRun, sampler: SamplingWeights) -> None:
        """Hold the newest ``keep_sampling_clients`` sampling clients of a run in memory (each
        is a copy of the trainable weights; the SDK never says one is dropped, so a long run
        would grow by one per step). An older one is released: named sampler weights are
        loaded again from disk at their next use, an unnamed client's session answers 404."""
        run.published.append(sampler)
        while len(run.published) > self.keep_sampling_clients:
            old = run.published.pop(0)
            if old is run.inflight:  # an inflight session samples the newest published weights
                continue
            run.backend.drop_snapshot(old.snapshot or "")
            old.retired = True
            for path, kept in list(self.sampler_paths.items()):
                if kept is old:
                    del self.sampler_paths[path]
            for session, used in list(self.samplers.items()):
                if used is old and old.path is None:
                    del self.samplers[session]
                    self.released[session] = (
                        f"sampling session {session!r} was released: this server keeps each training run's "
                        f"newest {self.keep_sampling_clients} sampling clients in memory "
                        "(--keep-sampling-clients); save named weights (save_weights_for_sampler) to keep one"
                    )

    def save_external(self, req: Any) -> Future[Any]:
        """``save_weights_external``: the run's weights as a Hugging Face folder at a
        ``tinker://<run>/external_weights/<name>`` path -- for a LoRA run the peft adapter
        (``adapter_config.json``, ``adapter_model.safetensors``), the format Tinker exports;
        with ``age_encryption_recipients`` each file age-encrypted (``.age``), as the service
        does (needs ``pyrage``, which tinker-cookbook installs)."""
        run = self.run(req.model_id)
        path = f"tinker://{req.model_id}/external_weights/{req.path}"

        def check() -> None:
            _check_ttl(req.ttl_seconds)
            if req.age_encryption_recipients:
                try:
                    import pyrage  # type: ignore[import-not-found]  # noqa: F401
                except ImportError as err:
                    raise UserError(
                        "this server encrypts external weights (age_encryption_recipients) with pyrage, "
                        "which is not installed here: pip install pyrage"
                    ) from err
            self._check_name(path, False, "external weights")

        if (refused := run.admit(req.seq_id, check)) is not None:
            return refused
        folder = self._folder("external", path)

        def go() -> Future[Any]:
            run.backend.export_pretrained(folder, adapter=run.backend.lora is not None)  # after every earlier call
            if req.age_encryption_recipients:
                _encrypt_folder(folder, list(req.age_encryption_recipients))
            self.registry.add_checkpoint(CheckpointRecord(path, "external", folder, run.base_model, run.rank))
            return resolved(
                {
                    "path": path,
                    "size_bytes": self.registry.checkpoints[path].size_bytes,
                    "type": "save_weights_external",
                }
            )

        return run.run(req.seq_id, go)

    def external_files(self, path: str) -> dict[str, str]:
        """The files of external weights: path relative to the checkpoint root -> local file."""
        if path not in self.external:
            raise Rejected(404, f"no external weights at {path}")
        root = self.external[path]
        return {
            os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"): os.path.join(d, f)
            for d, _, files in os.walk(root)
            for f in files
        }

    def delete_checkpoint(self, path: str) -> None:
        """Forget a saved state, sampler weights or external weights, and remove its files."""
        record = self.registry.drop_checkpoint(path)
        if record is None:
            raise Rejected(404, f"no checkpoint at {path}")
        self.sampler_paths.pop(path, None)
        shutil.rmtree(record.folder, ignore_errors=True)

    def weights_info(self, path: str) -> dict[str, Any]:
        """``WeightsInfoResponse`` of a checkpoint."""
        record = self.registry.checkpoints.get(path)
        if record is None:
            raise Rejected(404, f"no checkpoint at {path}")
        return {"base_model": record.base_model, "is_lora": record.lora_rank is not None, "lora_rank": record.lora_rank}

    # ------------------------------------------------------------------ sampling
    def _sampler_at(self, path: str) -> SamplingWeights:
        """Saved sampler weights: in memory while their run lives, else loaded from disk."""
        with self._lock:
            if path not in self.sampler_paths:
                record = self.registry.checkpoints.get(path)
                if record is None or record.checkpoint_type not in ("sampler", "training"):
                    raise Rejected(404, f"no sampler weights at {path}")
                backend = self._backend(record.base_model, record.lora_rank, 0)
                with _BUILDING, kept_rng():
                    backend.load(record.folder)
                self.sampler_paths[path] = self._sampler(backend, record.base_model, None, None, path)
            return self.sampler_paths[path]

    def create_sampling_session(self, req: types.CreateSamplingSessionRequest) -> str:
        session = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        self.seen(req.session_id)
        if req.model_path:
            with self._lock:  # not released between loading and use (_drop_unused_loaded)
                self.samplers[session] = self._sampler_at(req.model_path)
        elif req.base_model:
            try:
                self.samplers[session] = self._sampler(self.base(req.base_model), req.base_model)
            except UserError as err:
                raise Rejected(400, str(err)) from err
        else:
            raise Rejected(400, "give model_path or base_model")
        return session

    def sampler(self, session: str) -> SamplingWeights | InflightWeights:
        if session in self.released:
            raise Rejected(404, self.released[session])
        if session not in self.samplers:
            state = self.sessions.get(session_of(session))
            ended = f" (its session {state.status})" if state is not None and state.status else ""
            raise Rejected(404, f"no sampling session {session!r}{ended}")
        self.seen(session)
        found = self.samplers[session]
        if isinstance(found, SamplingWeights) and found.retired and found.path is not None:
            with self._lock:  # the weights of a run whose session ended: from disk, as after a restart
                found = self.samplers[session] = self._sampler_at(found.path)
        return found

    def sample(self, req: Any, sequence_ids: list[str] | None = None) -> Future[SampleResult]:
        """Completions, and what the request asks for besides: prompt logprobs (all, or the last
        ``prompt_logprobs_last_n``), top-k prompt logprobs, top-k logprobs of each sampled
        token (``topk_sample_logprobs``), and a record of each sequence for
        ``stable_reinforce`` (``record_stability_info``)."""
        sampler = self.sampler(req.sampling_session_id)
        prompt = req.prompt.to_ints()
        if not prompt:
            raise Rejected(400, "empty prompt")
        last_n = req.prompt_logprobs_last_n
        if last_n is not None and not 1 <= int(last_n) <= len(prompt) - 1:
            raise Rejected(
                400, f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1}, got {last_n}"
            )
        sp = req.sampling_params
        stop = sp.stop if sp.stop is not None else []
        params = SamplingParams(
            max_tokens=int(sp.max_tokens if sp.max_tokens is not None else 32),
            temperature=float(sp.temperature),
            top_p=float(sp.top_p),
            top_k=max(int(sp.top_k), 0),
            stop=cast("list[str] | list[int]", [stop] if isinstance(stop, (str, int)) else list(stop)),
            seed=sp.seed,
        )
        k, k_sampled = int(req.topk_prompt_logprobs or 0), int(req.topk_sample_logprobs or 0)
        completions = sampler.sample(prompt, int(req.num_samples), params)
        scored = sampler.score(prompt) if (req.prompt_logprobs or k) and len(prompt) > 1 else None
        topk = sampler.score(prompt, k) if k and len(prompt) > 1 else None

        def compose() -> SampleResult:
            out = SampleResult(completions.result(), k=k, k_sampled=k_sampled)
            hide = len(prompt) - int(last_n) if last_n is not None else 1  # positions before the scored suffix
            if req.prompt_logprobs or k:
                values = [None, *scored.result()] if scored is not None else [None]
                out.prompt_logprobs = [None if i < hide else v for i, v in enumerate(values)]
            if k:
                rows: list[Any] = [None, *_topk_rows(topk.result())] if topk is not None else [None]
                out.topk_prompt = [None if i < hide else r for i, r in enumerate(rows)]
            if k_sampled:  # one more forward per sequence: the distribution at each sampled position
                futures = [sampler.score(prompt + list(c.tokens), k_sampled) for c in out.completions]
                out.topk_sampled = [_topk_rows(f.result())[len(prompt) - 1 :] for f in futures]
            if req.record_stability_info and sequence_ids is not None:
                for sid, c in zip(sequence_ids, out.completions):
                    self.records.record(sid, prompt, c.tokens, c.logprobs)
            return out

        return self._pool.submit(compose)


def _encrypt_folder(folder: str, recipients: list[str]) -> None:
    """Replace each file by its age encryption to ``recipients`` (``name.age``)."""
    import pyrage

    keys = [pyrage.x25519.Recipient.from_str(r) for r in recipients]
    for d, _, files in os.walk(folder):
        for name in files:
            plain = os.path.join(d, name)
            with open(plain, "rb") as fh:
                data = pyrage.encrypt(fh.read(), keys)
            with open(plain + ".age", "wb") as fh:
                fh.write(data)
            os.remove(plain)


def _micro_batches(rows: list[Datum], max_tokens: int) -> list[list[Datum]]:
    """Consecutive runs of rows whose padded size (rows x longest) stays within ``max_tokens``
    (a row longer than that goes alone): what bounds the memory of one forward and backward --
    the LM head's logits are ``tokens x vocabulary`` floats (SmolLM2: 49152 per token)."""
    out: list[list[Datum]] = []
    for row in rows:
        if (
            out
            and (len(out[-1]) + 1) * max(len(row.input_tokens), *(len(r.input_tokens) for r in out[-1])) <= max_tokens
        ):
            out[-1].append(row)
        else:
            out.append([row])
    return out


def _joined(
    parts: list[tuple[list[dict[str, np.ndarray]], dict[str, float]]],
) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
    """The micro-batches' outputs in order, their losses summed."""
    return [o for outputs, _ in parts for o in outputs], {"loss:sum": float(sum(m["loss:sum"] for _, m in parts))}


def _all(futures: list[Future[Any]]) -> Future[list[Any]]:
    """A future of every result, in order (the first failure fails it)."""
    out: Future[list[Any]] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def one(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            out.set_exception(failed)
        else:
            out.set_result([f.result() for f in futures])

    for f in futures:
        f.add_done_callback(one)
    return out


def _relay(inner: Future[Any], out: Future[Any]) -> None:
    """``inner``'s outcome onto ``out``."""
    if inner.exception() is not None:
        out.set_exception(inner.exception())
    else:
        out.set_result(inner.result())
