"""An in-process fake of the Tinker service, for tests without network.

It implements the part of the SDK surface that :class:`TinkerBackend` uses --
``ServiceClient.create_lora_training_client / create_training_client_from_state_with_optimizer /
create_sampling_client / close``, ``TrainingClient.forward / forward_backward /
forward_backward_custom / optim_step / save_state / save_weights_for_sampler /
save_weights_and_get_sampling_client / get_tokenizer`` and ``SamplingClient.sample /
compute_logprobs`` -- on the real ``tinker.types`` (``Datum``, ``TensorData``, ``ModelInput``,
``SamplingParams``, ``AdamParams``, ``SampleResponse``, ``SampledSequence``,
``ForwardBackwardOutput``, ...) and the real exception classes.

The "service" computes with a tiny Llama (``tiny_llama``, full fine-tuning, AdamW) and evaluates
the built-in losses with the formulas of Tinker's documentation (:func:`builtin_loss`), checking
the inputs the way a strict server would: unknown ``loss_fn_inputs`` keys, lengths that do not
match ``model_input``, and ``loss_fn_config`` keys a loss does not take are rejected with
``BadRequestError``. ``forward_backward_custom`` does what the SDK does: a forward pass, the
user's loss on the returned logprobs, then a ``cross_entropy`` backward with weights
``-d loss / d logprobs``.

Like the real service, training requests run one at a time in submission order (one worker
thread); ``server.train_gate`` can hold them, to see what a caller does before results arrive.
``server.fail(method, *errors)`` makes the next calls of ``method`` fail with those errors.
Every call is logged in ``server.events`` as ``("submit" | "done", method)``; training rows
received are kept in ``server.received``.
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import tinker
import torch
from tinker import types

from tempering.plugins.models.tiny import tiny_llama

MODEL_KWARGS = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
REQUEST = httpx.Request("POST", "https://fake.tinker.invalid/api/v1")

# Documented defaults (Tinker docs / cookbook); TinkerBackend always sends thresholds explicitly.
DEFAULT_CLIPS = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0)}
ALLOWED_INPUTS = {
    "cross_entropy": ({"target_tokens"}, {"target_tokens", "weights"}),
    "importance_sampling": ({"target_tokens", "logprobs", "advantages"}, {"target_tokens", "logprobs", "advantages"}),
    "ppo": ({"target_tokens", "logprobs", "advantages"}, {"target_tokens", "logprobs", "advantages"}),
    "cispo": ({"target_tokens", "logprobs", "advantages"}, {"target_tokens", "logprobs", "advantages"}),
}
ALLOWED_CONFIG = {
    "cross_entropy": set(),
    "importance_sampling": set(),
    "ppo": {"clip_low_threshold", "clip_high_threshold"},
    "cispo": {"clip_low_threshold", "clip_high_threshold"},
}


# ---------------------------------------------------------------------- errors
def api_error(cls: type[Exception], message: str = "injected by the fake") -> Exception:
    """An instance of one of the SDK's exception classes, as the SDK would raise it."""
    if issubclass(cls, tinker.APIConnectionError):
        return cls(request=REQUEST) if cls is tinker.APITimeoutError else cls(request=REQUEST, message=message)
    if issubclass(cls, tinker.APIStatusError):
        status = {tinker.RateLimitError: 429, tinker.AuthenticationError: 401, tinker.BadRequestError: 400,
                  tinker.NotFoundError: 404, tinker.PermissionDeniedError: 403}.get(cls, 500)  # fmt: skip
        return cls(message, response=httpx.Response(status, request=REQUEST), body=None)
    return cls(message)


def bad_request(message: str) -> Exception:
    return api_error(tinker.BadRequestError, message)


# ---------------------------------------------------------------------- the documented built-in losses
def builtin_loss(loss_fn: str, config: Mapping[str, float] | None, lp: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Tinker's documented built-in loss of one datum (a sum over its positions).

    ``lp`` is the trainer's logprob of each target token (``(N,)``, or ``(N, K)`` for 2-D
    ``target_tokens``); ``inputs`` the datum's ``loss_fn_inputs`` as tensors.
    """
    config = dict(config or {})
    unknown = set(config) - ALLOWED_CONFIG.get(loss_fn, set())
    if unknown:
        raise bad_request(f"loss_fn_config keys {sorted(unknown)} are not valid for {loss_fn}")
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights", torch.zeros_like(lp))
        return -(lp * weights).sum()
    q, adv = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(lp - q)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    low, high = DEFAULT_CLIPS[loss_fn]
    low, high = config.get("clip_low_threshold", low), config.get("clip_high_threshold", high)
    clipped = torch.clamp(ratio, low, high)
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, clipped * adv).sum()
    if loss_fn == "cispo":
        return -(clipped.detach() * lp * adv).sum()
    raise bad_request(f"Unknown loss_fn {loss_fn!r}")


def check_datum(loss_fn: str, datum: types.Datum) -> dict[str, torch.Tensor]:
    """The datum's inputs as tensors, after the checks a strict server makes."""
    if loss_fn not in ALLOWED_INPUTS:
        raise bad_request(f"Unknown loss_fn {loss_fn!r}")
    required, allowed = ALLOWED_INPUTS[loss_fn]
    keys = set(datum.loss_fn_inputs)
    if not required <= keys or not keys <= allowed:
        raise bad_request(f"{loss_fn} takes loss_fn_inputs {sorted(allowed)} (requires {sorted(required)}), got {sorted(keys)}")
    n = datum.model_input.length
    tensors = {k: v.to_torch() for k, v in datum.loss_fn_inputs.items()}
    for key, value in tensors.items():
        if value.shape[0] != n:
            raise bad_request(f"loss_fn_inputs[{key!r}] has {value.shape[0]} positions, model_input {n}")
    if tensors["target_tokens"].dtype != torch.int64:
        raise bad_request("target_tokens must be int64")
    return tensors


# ---------------------------------------------------------------------- futures
class FakeFuture:
    """The APIFuture surface: ``result(timeout)``, ``future()``, ``done()``."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    @classmethod
    def of(cls, value: Any = None, error: BaseException | None = None) -> FakeFuture:
        f: Future[Any] = Future()
        if error is not None:
            f.set_exception(error)
        else:
            f.set_result(value)
        return cls(f)

    def result(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)

    def future(self) -> Future[Any]:
        return self._future

    def done(self) -> bool:
        return self._future.done()


# ---------------------------------------------------------------------- the service
class FakeTinkerServer:
    """Shared state of the fake service (saved states outlive the clients, as on Tinker)."""

    def __init__(self, model_kwargs: Mapping[str, Any] | None = None, seed: int = 0) -> None:
        self.model_kwargs = dict(MODEL_KWARGS if model_kwargs is None else model_kwargs)
        self.seed = seed
        self.base_model_obj, self.tokenizer = tiny_llama(**self.model_kwargs, seed=seed)
        self.events: list[tuple[str, str]] = []
        self.received: list[dict[str, Any]] = []  # training calls: method, loss_fn, config, data
        self.sample_requests: list[dict[str, Any]] = []
        self.states: dict[str, dict[str, Any]] = {}
        self.sampler_weights: dict[str, dict[str, torch.Tensor]] = {}
        self.failures: dict[str, list[BaseException]] = defaultdict(list)
        self.calls: dict[str, int] = defaultdict(int)
        self.train_gate = threading.Event()
        self.train_gate.set()
        self.reject_key = False
        self.clients: list[FakeServiceClient] = []
        self._lock = threading.Lock()
        self._train_pool = ThreadPoolExecutor(1, thread_name_prefix="fake-tinker-train")
        self._sample_pool = ThreadPoolExecutor(4, thread_name_prefix="fake-tinker-sample")
        self._runs = 0
        self._sequences = 0

    # hooks for tests
    def service_client(self, base_url: str | None = None, api_key: str | None = None) -> FakeServiceClient:
        client = FakeServiceClient(self, base_url=base_url, api_key=api_key)
        self.clients.append(client)
        return client

    def fail(self, method: str, *errors: type[Exception] | Exception) -> None:
        """The next ``len(errors)`` calls of ``method`` fail with these errors, in order."""
        for e in errors:
            self.failures[method].append(api_error(e) if isinstance(e, type) else e)

    def methods(self, *names: str, kind: str = "submit") -> list[str]:
        return [m for k, m in self.events if k == kind and (not names or m in names)]

    # internals
    def log(self, kind: str, method: str) -> None:
        with self._lock:
            self.events.append((kind, method))

    def injected(self, method: str) -> BaseException | None:
        with self._lock:
            self.calls[method] += 1
            return self.failures[method].pop(0) if self.failures[method] else None

    def run_training(self, method: str, fn: Any) -> FakeFuture:
        """Queue ``fn`` on the single training worker (submission order, like seq ids)."""
        self.log("submit", method)
        error = self.injected(method)

        def job() -> Any:
            self.train_gate.wait(timeout=30)
            try:
                if error is not None:
                    raise error
                return fn()
            finally:
                self.log("done", method)

        return FakeFuture(self._train_pool.submit(job))

    def run_sampling(self, method: str, fn: Any) -> FakeFuture:
        self.log("submit", method)
        error = self.injected(method)
        if error is not None:
            self.log("done", method)
            return FakeFuture.of(error=error)

        def job() -> Any:
            try:
                return fn()
            finally:
                self.log("done", method)

        return FakeFuture(self._sample_pool.submit(job))

    def new_run_id(self) -> str:
        with self._lock:
            self._runs += 1
            return f"fake-run-{self._runs}"

    def next_sequence_id(self) -> str:
        with self._lock:
            self._sequences += 1
            return f"seq-{self._sequences}"

    def fresh_model(self) -> Any:
        return copy.deepcopy(self.base_model_obj)


class FakeServiceClient:
    def __init__(self, server: FakeTinkerServer, base_url: str | None = None, api_key: str | None = None) -> None:
        self.server, self.base_url, self.api_key = server, base_url, api_key
        self.closed: str | None = None

    def create_lora_training_client(self, base_model: str, rank: int = 32, seed: int | None = None,
                                    train_mlp: bool = True, train_attn: bool = True, train_unembed: bool = True,
                                    user_metadata: Any = None, optimizer: Any = None) -> FakeFuture:  # fmt: skip
        s = self.server
        s.log("submit", "create_lora_training_client")
        s.received.append({"method": "create_lora_training_client", "base_model": base_model, "rank": rank, "seed": seed})
        if s.reject_key:
            return FakeFuture.of(error=api_error(tinker.AuthenticationError, "Invalid API key"))
        error = s.injected("create_lora_training_client")
        if error is not None:
            return FakeFuture.of(error=error)
        return FakeFuture.of(FakeTrainingClient(s, base_model, rank, s.fresh_model()))

    def create_training_client_from_state_with_optimizer(self, path: str, base_model: str | None = None,
                                                         user_metadata: Any = None, weights_access_token: Any = None) -> FakeFuture:  # fmt: skip
        s = self.server
        s.log("submit", "create_training_client_from_state_with_optimizer")
        s.received.append({"method": "create_training_client_from_state_with_optimizer", "path": path})
        if path not in s.states:
            return FakeFuture.of(error=api_error(tinker.NotFoundError, f"no checkpoint at {path}"))
        state = s.states[path]
        model = s.fresh_model()
        model.load_state_dict(state["weights"])
        client = FakeTrainingClient(s, state["base_model"], state["rank"], model)
        if state["optimizer"] is not None:
            client.optimizer().load_state_dict(state["optimizer"])
        return FakeFuture.of(client)

    def create_sampling_client(self, model_path: str | None = None, base_model: str | None = None,
                               retry_config: Any = None, record_stability_info: bool = False) -> FakeFuture:  # fmt: skip
        s = self.server
        s.log("submit", "create_sampling_client")
        model = s.fresh_model()
        if model_path is not None:
            weights = s.sampler_weights.get(model_path) or (s.states.get(model_path) or {}).get("weights")
            if weights is None:
                return FakeFuture.of(error=api_error(tinker.NotFoundError, f"no weights at {model_path}"))
            model.load_state_dict(weights)
        return FakeFuture.of(FakeSamplingClient(s, model, label=model_path or f"base:{base_model}"))

    def close(self, status: str, detail: str | None = None) -> FakeFuture:
        self.closed = status
        return FakeFuture.of(None)


class FakeTrainingClient:
    """A tiny Llama trained in full (the adapter's role), Adam as ``torch.optim.AdamW``."""

    def __init__(self, server: FakeTinkerServer, base_model: str, rank: int, model: Any) -> None:
        self.server, self.base_model, self.rank = server, base_model, rank
        self.model = model
        self.model.train()
        self.run_id = server.new_run_id()
        self._optimizer: torch.optim.Optimizer | None = None
        self.steps = 0

    def optimizer(self) -> torch.optim.Optimizer:
        if self._optimizer is None:
            self._optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        return self._optimizer

    def get_tokenizer(self) -> Any:
        return self.server.tokenizer

    def _target_logprobs(self, datum: types.Datum, targets: torch.Tensor, grad: bool) -> torch.Tensor:
        ids = torch.tensor([datum.model_input.to_ints()], dtype=torch.long)
        with torch.set_grad_enabled(grad):
            logp = torch.log_softmax(self.model(input_ids=ids).logits[0].float(), dim=-1)
            if targets.dim() == 1:
                return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            return logp.gather(-1, targets)

    def _run(self, data: list[types.Datum], loss_fn: str, config: Any, backward: bool) -> types.ForwardBackwardOutput:
        outputs, total = [], 0.0
        for datum in data:
            inputs = check_datum(loss_fn, datum)
            lp = self._target_logprobs(datum, inputs["target_tokens"], grad=backward)
            loss = builtin_loss(loss_fn, config, lp, inputs)
            if backward:
                loss.backward()
            total += float(loss.detach())
            outputs.append({"logprobs": types.TensorData.from_torch(lp.detach())})
        return types.ForwardBackwardOutput(loss_fn_output_type="fake", loss_fn_outputs=outputs, metrics={"loss:sum": total})

    def _record(self, method: str, data: list[types.Datum], loss_fn: str | None, config: Any) -> None:
        self.server.received.append({"method": method, "loss_fn": loss_fn, "loss_fn_config": config, "data": list(data)})

    def forward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: Any = None) -> FakeFuture:
        self._record("forward", data, loss_fn, loss_fn_config)
        return self.server.run_training("forward", lambda: self._run(data, loss_fn, loss_fn_config, backward=False))

    def forward_backward(self, data: list[types.Datum], loss_fn: str, loss_fn_config: Any = None) -> FakeFuture:
        self._record("forward_backward", data, loss_fn, loss_fn_config)
        return self.server.run_training("forward_backward", lambda: self._run(data, loss_fn, loss_fn_config, backward=True))

    def forward_backward_custom(self, data: list[types.Datum], loss_fn: Any) -> FakeFuture:
        """As the SDK does it client-side: forward, the custom loss on the logprobs, then a
        cross_entropy backward with weights ``-d loss / d logprobs``."""
        self._record("forward_backward_custom", data, None, None)

        def run() -> types.ForwardBackwardOutput:
            forward_data = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                            "weights": d.loss_fn_inputs["weights"]}) for d in data]  # fmt: skip
            fwd = self._run(forward_data, "cross_entropy", None, backward=False)
            lps = [o["logprobs"].to_torch().clone().requires_grad_(True) for o in fwd.loss_fn_outputs]
            loss, metrics = loss_fn(data, lps)
            loss.backward()
            linear = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                      "weights": types.TensorData.from_torch(-lp.grad)}) for d, lp in zip(data, lps)]  # fmt: skip
            out = self._run(linear, "cross_entropy", None, backward=True)
            out.metrics.update(metrics)
            out.metrics["surrogate_loss:sum"] = out.metrics["loss:sum"]
            out.metrics["loss:sum"] = float(loss.detach())
            return out

        return self.server.run_training("forward_backward_custom", run)

    def optim_step(self, params: types.AdamParams) -> FakeFuture:
        self.server.received.append({"method": "optim_step", "params": params})

        def run() -> types.OptimStepResponse:
            params_list = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.clip_grad_norm_(params_list, params.grad_clip_norm if params.grad_clip_norm > 0 else float("inf"))
            opt = self.optimizer()
            for group in opt.param_groups:
                group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                             weight_decay=params.weight_decay)  # fmt: skip
            opt.step()
            opt.zero_grad(set_to_none=True)
            self.steps += 1
            return types.OptimStepResponse(metrics={"grad_norm": float(norm)})

        return self.server.run_training("optim_step", run)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def save_state(self, name: str, ttl_seconds: int | None = None, overwrite: bool = False, user_metadata: Any = None) -> FakeFuture:
        def run() -> types.SaveWeightsResponse:
            path = f"tinker://{self.run_id}/weights/{name}"
            opt = None if self._optimizer is None else copy.deepcopy(self._optimizer.state_dict())
            self.server.states[path] = {"weights": self._weights(), "optimizer": opt, "base_model": self.base_model,
                                        "rank": self.rank, "steps": self.steps}  # fmt: skip
            return types.SaveWeightsResponse(path=path)

        return self.server.run_training("save_state", run)

    def save_weights_for_sampler(self, name: str, ttl_seconds: int | None = None, user_metadata: Any = None) -> FakeFuture:
        def run() -> types.SaveWeightsForSamplerResponse:
            path = f"tinker://{self.run_id}/sampler_weights/{name}"
            self.server.sampler_weights[path] = self._weights()
            return types.SaveWeightsForSamplerResponse(path=path)

        return self.server.run_training("save_weights_for_sampler", run)

    def save_weights_and_get_sampling_client(self, name: str | None = None, retry_config: Any = None) -> FakeFuture:
        def run() -> FakeSamplingClient:
            model = self.server.fresh_model()
            model.load_state_dict(self._weights())
            return FakeSamplingClient(self.server, model, label=f"{self.run_id}@{self.steps}", steps=self.steps)

        return self.server.run_training("save_weights_and_get_sampling_client", run)


class FakeSamplingClient:
    """Samples from frozen weights; logprobs are those of the untempered model (as Tinker's)."""

    def __init__(self, server: FakeTinkerServer, model: Any, label: str, steps: int = 0) -> None:
        self.server, self.model, self.label, self.steps = server, model, label, steps
        self.model.eval()
        self._lock = threading.Lock()
        self._gen = torch.Generator().manual_seed(server.seed + 12345)

    def get_tokenizer(self) -> Any:
        return self.server.tokenizer

    def _logp(self, tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(self.model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)

    def sample(self, prompt: types.ModelInput, num_samples: int, sampling_params: types.SamplingParams,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0, **kwargs: Any) -> FakeFuture:  # fmt: skip
        tokens = prompt.to_ints()
        self.server.sample_requests.append({"client": self.label, "prompt": tokens, "num_samples": num_samples,
                                            "params": sampling_params, "topk_prompt_logprobs": topk_prompt_logprobs})  # fmt: skip

        def run() -> types.SampleResponse:
            seqs = [self._one(tokens, sampling_params) for _ in range(num_samples)]
            prompt_lps = topk = None
            if include_prompt_logprobs or topk_prompt_logprobs:
                logp = self._logp(tokens)
                prompt_lps = [None] + [float(logp[i - 1, t]) for i, t in enumerate(tokens) if i > 0]
                if topk_prompt_logprobs:
                    values, ids = torch.topk(logp[:-1], k=topk_prompt_logprobs, dim=-1)
                    topk = [None] + [list(zip(i.tolist(), v.tolist())) for v, i in zip(values, ids)]
            return types.SampleResponse(sequences=seqs, _prompt_logprobs_list=prompt_lps, _topk_prompt_logprobs_list=topk)

        return self.server.run_sampling("sample", run)

    def _one(self, prompt: list[int], params: types.SamplingParams) -> types.SampledSequence:
        eos = self.server.tokenizer.eos_token_id
        stop = params.stop
        stop_ids = {eos} if stop is None else {int(s) for s in stop if not isinstance(s, str)}
        stop_strings = [] if stop is None or isinstance(stop, int) else [s for s in ([stop] if isinstance(stop, str) else stop) if isinstance(s, str)]
        tokens, lps, reason = list(prompt), [], "length"
        for _ in range(int(params.max_tokens or 16)):
            logp = self._logp(tokens)[-1]
            if params.temperature <= 0:
                token = int(logp.argmax())
            else:
                scores = logp / params.temperature
                if params.top_k and params.top_k > 0:
                    kth = torch.topk(scores, params.top_k).values[-1]
                    scores = torch.where(scores < kth, torch.full_like(scores, float("-inf")), scores)
                with self._lock:
                    token = int(torch.multinomial(torch.softmax(scores, -1), 1, generator=self._gen))
            tokens.append(token)
            lps.append(float(logp[token]))  # untempered, as Tinker's sampler reports
            completion = tokens[len(prompt) :]
            if token in stop_ids or any(s in self.server.tokenizer.decode(completion) for s in stop_strings):
                reason = "stop"
                break
        completion = tokens[len(prompt) :]
        return types.SampledSequence(stop_reason=reason, sequence_id=self.server.next_sequence_id(),
                                     tokens_np=np.asarray(completion, dtype=np.int32),
                                     logprobs_np=np.asarray(lps, dtype=np.float32))  # fmt: skip

    def compute_logprobs(self, prompt: types.ModelInput, prompt_logprobs_last_n: int | None = None) -> FakeFuture:
        tokens = prompt.to_ints()
        self.server.sample_requests.append({"client": self.label, "prompt": tokens, "compute_logprobs": True})

        def run() -> list[float | None]:
            logp = self._logp(tokens)
            return [None] + [float(logp[i - 1, t]) for i, t in enumerate(tokens) if i > 0]

        return self.server.run_sampling("compute_logprobs", run)
