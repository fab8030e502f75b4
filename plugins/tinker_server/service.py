"""The state and compute behind the local Tinker server: sessions, training runs, checkpoints
and samplers, on :class:`~tempering.plugins.backends.local.backend.LocalBackend`.

Each training run (``create_model`` / ``load_weights``) is a ``LocalBackend`` with a LoRA
adapter of the run's rank on its own copy of the served model (built in code, or pretrained); its built-in losses are
:mod:`~tempering.plugins.tinker_server.builtin_losses` evaluated by the local backend's
``forward_backward``, so the server computes exactly what Tinker's documentation says, with our
own training code. What Tinker guarantees and this service keeps:

* a run's requests execute in ``seq_id`` order, whatever order they arrive in (the SDK sends a
  forward_backward's chunks in parallel, the first one last), and a request rejected at
  submission consumes its ``seq_id``;
* a saved state or sampler checkpoint keeps its name unless ``overwrite`` (else HTTP 409), and
  a TTL is ``None`` or at least 3600 s (else HTTP 400);
* ``snapshot`` sampling sessions sample fixed weights; ``inflight`` ones sample the newest
  weights their run published (weights saved when the client was created, or newer);
* the base model of a run is the run at step 0 (the adapter starts at zero).

Differences from the service, on purpose: samples come from the local backend (its sampler
logprobs are those of the distribution sampled from; it always stops at the model's EOS, so
``stop=[]`` does not disable EOS here); ``train_mlp``/``train_attn``/``train_unembed`` are
ignored; checkpoints live in a temporary folder and never expire.

Operations return :class:`concurrent.futures.Future` (the server's futures); a problem with a
request raises :class:`Rejected` (an HTTP status at submission) or, inside a future,
:class:`UserError` (a failed future of category ``user``); any other failure is a ``server``
failure.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tempering.interfaces import LossOutput
from tempering.plugins.backends.common import failed, resolved
from tempering.plugins.backends.local.backend import LocalBackend, LocalSamplingClient
from tempering.plugins.backends.local.checkpoint import kept_rng
from tempering.plugins.backends.local.model_source import registered_builder
from tempering.plugins.tinker_server.builtin_losses import builtin_loss, check_builtin
from tempering.types import AdamParams, Batch, Datum, SamplingParams

__all__ = ["ServedModel", "LocalService", "Rejected", "UserError", "MIN_TTL_SECONDS"]

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


def _check_ttl(ttl: int | None) -> None:
    if ttl is not None and not MIN_TTL_SECONDS <= int(ttl) <= MAX_TTL_SECONDS:
        raise Rejected(400, f"ttl_seconds must be between {MIN_TTL_SECONDS} and {MAX_TTL_SECONDS} (or null), got {ttl}")


class Sampler:
    """The weights a sampling session samples: a frozen snapshot of a run, a run's inflight
    target, or a base model (``client=None``: the owner's live, never-trained weights)."""

    def __init__(self, owner: LocalBackend, base_model: str, client: LocalSamplingClient | None = None,
                 snapshot: str | None = None, path: str | None = None) -> None:  # fmt: skip
        self.owner, self.base_model, self.client, self.snapshot, self.path = owner, base_model, client, snapshot, path

    def sample(self, prompt: list[int], n: int, params: SamplingParams) -> Future[list[Any]]:
        target = self.client if self.client is not None else self.owner
        return _then(target.sample([prompt], n, params), lambda groups: groups[0])

    def score(self, prompt: list[int], topk: int = 0) -> Future[Any]:
        """Logprobs of each prompt token after the first (``topk``: the top-k pairs per position)."""
        batch = Batch([Datum(prompt[:-1], prompt[1:], [0.0] * (len(prompt) - 1))])
        if topk:
            return _then(self.owner.distributions(batch, weights=self.snapshot, topk=topk), lambda rows: rows[0])
        return _then(self.owner.logprobs(batch, weights=self.snapshot), lambda rows: rows[0])


class InflightSampler:
    """A session of a run's inflight weights: whatever the run published last, at sample time."""

    def __init__(self, run: TrainingRun) -> None:
        self.run = run
        self.base_model = run.base_model
        self.path = None

    def sample(self, prompt: list[int], n: int, params: SamplingParams) -> Future[list[Any]]:
        return self.run.inflight.sample(prompt, n, params)

    def score(self, prompt: list[int], topk: int = 0) -> Future[Any]:
        return self.run.inflight.score(prompt, topk)


class TrainingRun:
    """One training model: a local backend and the ``seq_id`` order of its requests."""

    def __init__(self, model_id: str, base_model: str, rank: int, backend: LocalBackend) -> None:
        self.model_id, self.base_model, self.rank, self.backend = model_id, base_model, rank, backend
        self.inflight: Sampler | None = None
        self._next = 1  # seq 0 is the request that created the run
        self._waiting: dict[int, tuple[Callable[[], Future[Any]], Future[Any]]] = {}
        self._lock = threading.Lock()
        self.names: set[str] = set()
        self._snapshots = itertools.count()

    def run(self, seq_id: int, fn: Callable[[], Future[Any]]) -> Future[Any]:
        """Run ``fn`` (which submits to the backend) once every earlier ``seq_id`` has run."""
        out: Future[Any] = Future()
        with self._lock:
            self._waiting[int(seq_id)] = (fn, out)
            self._drain()
        return out

    def skip(self, seq_id: int) -> None:
        """A request rejected at submission still takes its place in the order."""
        self.run(seq_id, lambda: failed(UserError("rejected at submission")))

    @contextlib.contextmanager
    def admitting(self, seq_id: int) -> Iterator[None]:
        """The checks of a request at submission: one they reject (:class:`Rejected`) still
        takes its place in the order (:meth:`skip`), so the requests behind it run."""
        try:
            yield
        except Rejected:
            self.skip(seq_id)
            raise

    def _drain(self) -> None:
        while self._next in self._waiting:
            fn, out = self._waiting.pop(self._next)
            self._next += 1
            try:
                inner = fn()
            except BaseException as err:  # noqa: BLE001 - a request's failure is its future's
                out.set_exception(err)
                continue
            inner.add_done_callback(lambda f, out=out: out.set_exception(f.exception()) if f.exception() else out.set_result(f.result()))

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
        self.rows: list[torch.Tensor] = []

    def __call__(self, lp: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> LossOutput:
        names = {"weights": "weights", "logprobs": "sampler_logprobs", "advantages": "advantages",
                 "sequence_ratio_mask": "sequence_ratio_mask"}  # fmt: skip
        total, self.rows = lp.new_zeros(()), []
        for b, n in enumerate(tensors["attention_mask"].sum(-1).tolist()):
            if self.two_d:
                ids = tensors["soft_ids"][b, :n].long()
                row = torch.log_softmax(tensors["logits"][b, :n].float(), dim=-1).gather(-1, ids)
                inputs = {"target_tokens": ids, "weights": tensors["soft_weights"][b, :n]}
            else:
                row = lp[b, :n]
                inputs = {"target_tokens": tensors["target_ids"][b, :n]}
                inputs.update({k: tensors[names[k]][b, :n] for k in self.keys if k != "target_tokens"})
            total = total + builtin_loss(self.loss_fn, self.config, row, inputs)
            self.rows.append(row.detach())
        return LossOutput(total, {})


def _to_batch(data: list[Any], loss_fn: str, config: Mapping[str, Any] | None) -> tuple[Batch, BuiltinLoss]:
    """Tinker datums -> our rows (and the loss that reads them), after the checks of a strict
    server: the loss's input and config keys, and one value per ``model_input`` position."""
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
                raise UserError(f"datum {i}: loss_fn_inputs[{key!r}] has {value.shape[0]} positions, model_input {len(tokens)}")
        target = inputs["target_tokens"]
        if target.dtype != np.int64:
            raise UserError(f"datum {i}: target_tokens must be int64, got {target.dtype}")
        extra: dict[str, Any] = {}
        if target.ndim == 2:
            if loss_fn != "cross_entropy":
                raise UserError(f"(N, K) target_tokens are for cross_entropy, not {loss_fn}")
            extra = {"soft_ids": target.tolist(), "soft_weights": inputs.get("weights", np.zeros(target.shape)).tolist()}
            target = target[:, 0]
        if "sequence_ratio_mask" in inputs:
            extra["sequence_ratio_mask"] = inputs["sequence_ratio_mask"].tolist()
        weights = inputs["weights"].tolist() if "weights" in inputs and inputs["weights"].ndim == 1 else [0.0] * len(tokens)
        rows.append(Datum(tokens, target.tolist(), weights,
                          inputs["logprobs"].tolist() if "logprobs" in inputs else None,
                          inputs["advantages"].tolist() if "advantages" in inputs else None, extra))  # fmt: skip
    two_d = bool(rows) and "soft_ids" in rows[0].extra
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


class LocalService:
    """Sessions, training runs, checkpoints and sampling sessions (see the module docstring).

    Args:
        models: base-model name -> :class:`ServedModel` (or a mapping of its fields).
        root: a folder for checkpoints and tokenizers.
    """

    def __init__(self, models: Mapping[str, ServedModel | Mapping[str, Any]], root: str) -> None:
        self.models = {name: spec if isinstance(spec, ServedModel) else ServedModel(**spec) for name, spec in models.items()}
        self.root = root
        self.sessions: dict[str, str | None] = {}  # id -> finish status (None: open)
        self.runs: dict[str, TrainingRun] = {}
        self.states: dict[str, dict[str, Any]] = {}  # tinker path -> saved training state
        self.samplers: dict[str, Sampler | InflightSampler] = {}  # sampling session id -> sampler
        self.sampler_paths: dict[str, Sampler] = {}  # tinker path -> saved sampler weights
        self.external: dict[str, str] = {}  # tinker path -> folder of external (Hugging Face) weights
        self._bases: dict[str, LocalBackend] = {}
        self._tokenizer_dirs: dict[str, str] = {}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)

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
        with kept_rng():  # building a backend seeds the global RNGs, which the client (same process in tests) uses
            return LocalBackend(lora=lora, **kwargs)

    def base(self, base_model: str) -> LocalBackend:
        """The never-trained model (base-model sampling sessions, tokenizer)."""
        with self._lock:
            if base_model not in self._bases:
                self._bases[base_model] = self._backend(base_model, None, self.models[base_model].seed if base_model in self.models else 0)
            return self._bases[base_model]

    def tokenizer_dir(self, base_model: str) -> str:
        """A folder holding the model's tokenizer: ``get_info``'s ``tokenizer_id``, so the SDK's
        ``get_tokenizer`` loads it offline."""
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

    # ------------------------------------------------------------------ sessions
    def create_session(self) -> str:
        session = f"session-{next(self._ids)}"
        self.sessions[session] = None
        return session

    def heartbeat(self, session_id: str) -> None:
        if session_id not in self.sessions:
            raise Rejected(404, f"no session {session_id!r}")
        if self.sessions[session_id] is not None:
            raise Rejected(410, f"session {session_id!r} has finished")

    def finish(self, session_id: str, status: str) -> None:
        if self.sessions.get(session_id, "x") is None:
            self.sessions[session_id] = status  # first wins, as on the service

    def run(self, model_id: str) -> TrainingRun:
        if model_id not in self.runs:
            raise Rejected(404, f"no training run {model_id!r}")
        return self.runs[model_id]

    # ------------------------------------------------------------------ training runs
    def create_model(self, req: Any) -> tuple[str, Future[Any]]:
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        rank = req.lora_config.rank if req.lora_config is not None else 32
        seed = req.lora_config.seed if req.lora_config is not None and req.lora_config.seed is not None else 0
        try:
            backend = self._backend(req.base_model, rank, seed)
        except UserError as err:
            return model_id, failed(err)
        self.runs[model_id] = TrainingRun(model_id, req.base_model, rank, backend)
        done: Future[Any] = Future()
        done.set_result({"model_id": model_id, "type": "create_model"})
        return model_id, done

    def info(self, model_id: str) -> dict[str, Any]:
        run = self.run(model_id)
        return {"type": "get_info", "model_id": model_id, "is_lora": run.backend.lora is not None, "lora_rank": run.rank,
                "model_name": run.base_model,
                "model_data": {"arch": "llama", "model_name": run.base_model, "tokenizer_id": self.tokenizer_dir(run.base_model)}}  # fmt: skip

    def forward_backward(self, call: Any) -> Future[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
        run = self.run(call.model_id)

        def go() -> Future[Any]:
            batch, loss = _to_batch(call.data, call.loss_fn, call.loss_fn_config)
            if call.forward_only:
                if loss.two_d:
                    raise UserError("forward with (N, K) target_tokens is not supported by this server")
                return _then(run.backend.logprobs(batch), lambda rows: self._score_forward(batch, loss, rows))
            return _then(run.backend.forward_backward(batch, loss), lambda m: self._outputs(loss, m["loss"]))

        return run.run(call.seq_id, go)

    @staticmethod
    def _outputs(loss: BuiltinLoss, total: float) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        return [{"logprobs": r.cpu().numpy()} for r in loss.rows], {"loss:sum": float(total)}

    def _score_forward(self, batch: Batch, loss: BuiltinLoss, rows: list[list[float]]) -> Any:
        width = max(len(r) for r in rows)
        lp = torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)
        with torch.no_grad():
            total = loss(lp, batch.to_tensors()).loss
        return self._outputs(loss, float(total))

    def optim_step(self, req: Any) -> Future[Any]:
        run, p = self.run(req.model_id), req.optim_params
        with run.admitting(req.seq_id):
            if not hasattr(p, "beta2"):
                raise Rejected(400, f"this server trains with Adam, got optimizer params of type {getattr(p, 'type', '?')!r}")
        params = AdamParams(learning_rate=p.learning_rate, beta1=p.beta1, beta2=p.beta2, eps=p.eps,
                            weight_decay=p.weight_decay, grad_clip_norm=p.grad_clip_norm)  # fmt: skip
        return run.run(req.seq_id, lambda: _then(run.backend.optim_step(params), lambda m: {"metrics": m}))

    def save_state(self, req: Any) -> Future[Any]:
        run = self.run(req.model_id)
        path = f"tinker://{req.model_id}/weights/{req.path}"
        with run.admitting(req.seq_id):
            _check_ttl(req.ttl_seconds)
            if path in self.states and not req.overwrite:
                raise Rejected(409, f"a checkpoint named {req.path!r} already exists for {req.model_id} (pass overwrite=True)")
        folder = os.path.join(self.root, "states", _safe(path))

        def go() -> Future[Any]:
            run.backend.save(folder)  # returns once written, after every earlier call
            self.states[path] = {"folder": folder, "base_model": run.base_model, "rank": run.rank}
            done: Future[Any] = Future()
            done.set_result({"path": path, "type": "save_weights"})
            return done

        return run.run(req.seq_id, go)

    def load_state(self, req: Any) -> tuple[str, Future[Any]]:
        """``load_weights``: a new run from a saved state (the SDK's create-from-state)."""
        if req.session_id is None or not req.optimizer:
            raise Rejected(400, "this server loads a state, with its optimizer state, into a new run only "
                                "(create_training_client_from_state_with_optimizer)")
        model_id = f"{req.session_id}:train:{req.model_seq_id}"
        state = self.states.get(req.path)
        if state is None:
            return model_id, failed(UserError(f"no saved state at {req.path}"))
        backend = self._backend(req.base_model or state["base_model"], state["rank"], 0)
        with kept_rng():  # building a backend seeds the global RNGs, which the client (same process in tests) uses
            backend.load(state["folder"])
        self.runs[model_id] = TrainingRun(model_id, state["base_model"], state["rank"], backend)
        done: Future[Any] = Future()
        done.set_result({"path": req.path, "model_id": model_id, "type": "load_weights"})
        return model_id, done

    def save_for_sampler(self, req: Any) -> Future[Any]:
        """Named: sampler weights at a ``tinker://`` path. Unnamed: a sampling session of a
        snapshot (``kind=snapshot``) or of the run's inflight weights (``kind=inflight``)."""
        run = self.run(req.model_id)
        path = f"tinker://{req.model_id}/sampler_weights/{req.path}" if req.path else None
        with run.admitting(req.seq_id):
            if req.path is not None:
                _check_ttl(req.ttl_seconds)
                if path in self.sampler_paths:
                    raise Rejected(409, f"sampler weights named {req.path!r} already exist for {req.model_id}")

        def go() -> Future[Any]:
            name = run.snapshot_name()
            run.backend.snapshot(name)
            return _then(run.backend.sampling_client(), lambda client: publish(Sampler(run.backend, run.base_model, client, name, path)))

        def publish(sampler: Sampler) -> dict[str, Any]:
            if path is not None:
                self.sampler_paths[path] = sampler
                return {"path": path, "type": "save_weights_for_sampler"}
            session = f"{req.model_id}:sample:{req.sampling_session_seq_id}"
            if req.kind == "inflight":
                run.inflight = sampler
                self.samplers[session] = InflightSampler(run)
            else:
                self.samplers[session] = sampler
            return {"sampling_session_id": session, "type": "save_weights_for_sampler"}

        return run.run(req.seq_id, go)

    def save_external(self, req: Any) -> Future[Any]:
        """``save_weights_external``: the run's weights as a Hugging Face folder at a
        ``tinker://<run>/external_weights/<name>`` path -- for a LoRA run the peft adapter
        (``adapter_config.json``, ``adapter_model.safetensors``), the format Tinker exports."""
        run = self.run(req.model_id)
        path = f"tinker://{req.model_id}/external_weights/{req.path}"
        with run.admitting(req.seq_id):
            _check_ttl(req.ttl_seconds)
            if req.age_encryption_recipients:
                raise Rejected(400, "this server does not encrypt external weights (age_encryption_recipients)")
            if path in self.external:
                raise Rejected(409, f"external weights named {req.path!r} already exist for {req.model_id}")
        folder = os.path.join(self.root, "external", _safe(path))

        def go() -> Future[Any]:
            run.backend.export_pretrained(folder, adapter=run.backend.lora is not None)  # after every earlier call
            self.external[path] = folder
            size = sum(os.path.getsize(f) for f in self.external_files(path).values())
            return resolved({"path": path, "size_bytes": size, "type": "save_weights_external"})

        return run.run(req.seq_id, go)

    def external_files(self, path: str) -> dict[str, str]:
        """The files of external weights: path relative to the checkpoint root -> local file."""
        if path not in self.external:
            raise Rejected(404, f"no external weights at {path}")
        root = self.external[path]
        return {os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"): os.path.join(d, f)
                for d, _, files in os.walk(root) for f in files}  # fmt: skip

    def delete_checkpoint(self, path: str) -> None:
        """Forget a saved state, sampler weights or external weights (404 if there is none)."""
        with self._lock:
            found = [table.pop(path, None) for table in (self.states, self.sampler_paths, self.external)]
        if all(f is None for f in found):
            raise Rejected(404, f"no checkpoint at {path}")

    # ------------------------------------------------------------------ sampling
    def create_sampling_session(self, req: Any) -> str:
        session = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        if req.model_path:
            if req.model_path not in self.sampler_paths:
                raise Rejected(404, f"no sampler weights at {req.model_path}")
            self.samplers[session] = self.sampler_paths[req.model_path]
        elif req.base_model:
            try:
                self.samplers[session] = Sampler(self.base(req.base_model), req.base_model)
            except UserError as err:
                raise Rejected(400, str(err)) from err
        else:
            raise Rejected(400, "give model_path or base_model")
        return session

    def sampler(self, session: str) -> Sampler | InflightSampler:
        if session not in self.samplers:
            raise Rejected(404, f"no sampling session {session!r}")
        return self.samplers[session]

    def sample(self, req: Any) -> Future[tuple[list[Any], list[float | None] | None, list[Any] | None, int]]:
        """``(completions, prompt logprobs, top-k prompt logprobs, k)``."""
        sampler = self.sampler(req.sampling_session_id)
        prompt = req.prompt.to_ints()
        if not prompt:
            raise Rejected(400, "empty prompt")
        sp = req.sampling_params
        stop = sp.stop if sp.stop is not None else []
        params = SamplingParams(max_tokens=int(sp.max_tokens if sp.max_tokens is not None else 32), temperature=float(sp.temperature),
                                top_p=float(sp.top_p), top_k=max(int(sp.top_k), 0),
                                stop=[stop] if isinstance(stop, (str, int)) else list(stop), seed=sp.seed)  # fmt: skip
        k = int(req.topk_prompt_logprobs or 0)
        parts = [sampler.sample(prompt, int(req.num_samples), params)]
        if req.prompt_logprobs or k:
            parts.append(sampler.score(prompt) if len(prompt) > 1 else resolved([]))
        if k:
            parts.append(sampler.score(prompt, k) if len(prompt) > 1 else resolved(None))
        return _then(_all(parts), lambda results: _sample_result(results, k))


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


def _sample_result(results: list[Any], k: int) -> tuple[list[Any], list[float | None] | None, list[Any] | None, int]:
    completions = results[0]
    prompt_lps = [None, *results[1]] if len(results) > 1 else None
    topk = None
    if k:
        values, ids = results[2] if results[2] is not None else (torch.zeros(0, k), torch.zeros(0, k))
        topk = [None] + [list(zip(i.tolist(), v.tolist())) for v, i in zip(values, ids)]
    return completions, prompt_lps, topk, k
