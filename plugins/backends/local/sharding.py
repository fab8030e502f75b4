"""Fully sharded data parallelism (FSDP2) for the local backend: models larger than one device.

With ``backend.parallel: fsdp`` under ``torchrun`` each rank keeps ``1/world_size`` of every
weight, gradient and Adam moment (``torch.distributed.fsdp.fully_shard``), and all-gathers a
decoder layer's weights just for its forward and backward. What that means for the backend:

* **Layout.** :func:`shard_model` shards each decoder layer (the classes a transformers model
  lists in ``_no_split_modules``) as its own unit, then the transformers model itself as the
  root (embeddings, final norm, head). With LoRA the adapter tensors live inside the layers and
  are sharded with them; the frozen base weights are sharded too, which is where the memory is.
* **Precision.** Weights are stored and computed in the backend's ``dtype``; gradients are
  reduce-scattered in float32 (the mixed-precision policy), so averaging across ranks adds no
  rounding beyond that of the single-process run. FSDP all-gathers one dtype per unit, so a
  LoRA adapter (peft keeps it, and its Adam moments, in float32) computes in ``dtype`` too,
  where a single bf16 process computes it in float32: bf16 runs agree less tightly than float32.
* **Gradients** come out of ``backward`` already averaged across ranks (FSDP's reduce-scatter),
  so the data-parallel all-reduce is skipped. :func:`clip_grad_norm_` computes the *global*
  norm over the sharded gradients (a DTensor reduction) before clipping.
* **Lockstep.** Every forward all-gathers, so every rank must run the same calls in the same
  order. Stage drivers already do (every rank runs the recipe on the same prompts). Generation
  runs in lockstep too: the model is marked as FSDP-managed, so ``generate`` keeps stepping
  (transformers' ``synced_gpus``) until every rank's rows have finished. This costs no extra
  memory, unlike gathering the full weights for generation, which would not fit for a model
  larger than one device; the price is an all-gather per layer per generated token. The root
  unit, too, frees its gathered weights after each forward (FSDP's default keeps them), so an
  in-place write (snapshot swap, checkpoint load) is never shadowed by a stale full copy.
  Asynchronous sampling clients (a second thread issuing forwards concurrently with training)
  cannot keep that order and are refused.
* **Checkpoints** stay the single-file, single-process format: :func:`gather_state` builds full
  (unsharded) state dicts with ``torch.distributed.checkpoint.state_dict.get_state_dict`` on
  rank 0, and the optimizer state is re-keyed from parameter names to positions, which is what
  ``torch.optim.Optimizer.load_state_dict`` in a single-process run (or ``tempering export``)
  expects. :func:`load_weights` and :func:`load_optimizer` are the inverse (every rank reads the
  file and keeps its slice, via ``set_model_state_dict`` / ``set_optimizer_state_dict``).
  Weight snapshots (``snapshot``/``ema_update``) are held sharded and saved whole.

``torch.distributed``'s FSDP and checkpoint modules are imported inside the functions that
shard, so a single-process or DDP run (which only clips gradients here) never loads them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import torch

import tempering.plugins.backends.local.distributed as distributed

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

PARALLEL_MODES = ("ddp", "fsdp")
"""``backend.parallel``: ``ddp`` replicates the model and all-reduces gradients (the default);
``fsdp`` shards it. Both are the plain single-process path when ``WORLD_SIZE`` is 1."""


def transformers_model(model: object) -> Any:
    """The transformers model inside ``model`` (a peft wrapper's base model, or itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to shard one by one: those whose class a transformers model names in
    ``_no_split_modules`` (its decoder layer). Empty for a model that names none."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def shard_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Shard ``model`` (a transformers model, or a peft model around one) in place across the
    default process group: every decoder layer, then the transformers model as the root.

    Must run on every rank, after the weights are identical across ranks (each rank keeps its
    slice of its own copy) and before the optimizer is created (it must hold the sharded
    parameters).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (distributed.world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    root = transformers_model(model)
    for layer in decoder_layers(root):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    # The root too gives its gathered weights back after every forward (FSDP's default keeps them
    # until the backward): a forward without backward (scoring, sampling) would otherwise leave
    # a stale full copy that ignores the next in-place write (a snapshot swap, a checkpoint load).
    fully_shard(root, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    root._is_fsdp_managed_module = True  # transformers' generate then runs in lockstep (synced_gpus)


def clip_grad_norm_(params: Sequence[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients of ``params`` to a global norm of ``max_norm``; returns the norm
    before clipping. With sharded gradients the norm must be that of the *whole* gradient, or
    each rank would clip its slice by a different factor: ``get_total_norm`` on DTensors reduces
    the per-shard norms across ranks (torch 2.13 returns a replicated DTensor) and
    ``full_tensor`` turns that into a plain tensor. Plain gradients take the same path, so the
    single-process and DDP norms are computed exactly as ``clip_grad_norm_`` would."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return 0.0
    total = torch.nn.utils.get_total_norm(grads)
    total = full_tensor(total)
    torch.nn.utils.clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, total)
    return float(total)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (a collective for a DTensor; ``tensor`` itself otherwise)."""
    return tensor.full_tensor() if _is_dtensor(tensor) else tensor


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``full`` laid out like ``param``: this rank's slice when ``param`` is sharded. Every rank
    holds the same ``full`` (all read one checkpoint), so no data is sent."""
    full = full.to(device=param.device)
    if not _is_dtensor(param):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)


def _is_dtensor(tensor: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``tensor`` is a DTensor, without importing DTensor in a run that has none."""
    return hasattr(tensor, "device_mesh") and hasattr(tensor, "full_tensor")


def _options(lora: bool, cpu_offload: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload, ignore_frozen_params=lora, strict=not lora)


def gather_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, names: Sequence[str], lora: bool
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Full (unsharded) weights and optimizer state on rank 0, ``({}, None)`` elsewhere.

    Every rank must call this (it all-gathers). ``names`` are the trainable parameters in the
    optimizer's order; with ``lora`` only they are saved, as in a single-process checkpoint.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
    )

    options = _options(lora, cpu_offload=True)
    if optimizer is None:
        return _full_weights(get_model_state_dict(model, options=options)), None
    model_state, optim = get_state_dict(model, optimizer, options=options)
    weights = _full_weights(model_state)
    if not distributed.is_main():
        return weights, None
    return weights, _by_position(optim, names)


def _full_weights(state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """A model state dict gathered with ``full_state_dict=True``: plain tensors. The cast is
    for torch's annotation, which gives every state dict's values as ``ValueType`` (DTensors,
    sharded tensors and nested containers too), whatever the options."""
    return cast(dict[str, torch.Tensor], state)


def load_weights(model: torch.nn.Module, weights: Mapping[str, torch.Tensor], lora: bool) -> None:
    """Load full (single-process format) weights into the sharded ``model``: every rank passes
    the same full tensors and keeps its slice. With ``lora`` only the adapter is expected."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, dict(weights), options=_options(lora, cpu_offload=False))


def load_optimizer(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: Mapping[str, Any], names: Sequence[str]
) -> None:
    """Load a single-process (position-keyed) optimizer state into the optimizer of the sharded
    ``model``; ``names`` are its parameters in the optimizer's order."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    options = _options(lora=False, cpu_offload=False)
    set_optimizer_state_dict(model, optimizer, _by_name(state, names), options=options)


def _by_position(optim: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (``get_state_dict``'s form) re-keyed by
    position, the form ``Optimizer.state_dict()`` has in a single-process run."""
    index = {name: i for i, name in enumerate(names)}
    unknown = [n for n in optim["state"] if n not in index]
    if unknown:
        raise RuntimeError(
            f"sharding: optimizer state for unknown parameters {unknown[:3]} (names differ from the model's)"
        )
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in optim["param_groups"]]
    return {"state": {index[n]: s for n, s in optim["state"].items()}, "param_groups": groups}


def _by_name(optim: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The inverse of :func:`_by_position`."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in optim["param_groups"]]
    return {"state": {names[int(i)]: s for i, s in optim["state"].items()}, "param_groups": groups}
