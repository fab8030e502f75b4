"""The local backend's checkpoints: weights, optimizer state, snapshots, the step, every RNG and
the caller's ``extra``, so that a resumed run takes exactly the step an uninterrupted one would;
and the Hugging Face export of the policy.

A checkpoint is a folder of two files, ``state.pt`` (tensors, ``torch.load(weights_only=True)``
safe) and ``meta.json``, in the single-process format even under FSDP (shards are gathered to
rank 0, which alone writes). It is written into a temporary sibling folder and swapped in, so a
run killed mid-save never leaves half a checkpoint where a resume would look for one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import torch

import tempering.plugins.backends.local.distributed as distributed
import tempering.plugins.backends.local.sharding as sharding
from tempering.interfaces import Tokenizer
from tempering.plugins.backends.local.training import Trainer
from tempering.plugins.backends.local.weights import PolicyWeights
from tempering.runs.pretrained import write_pretrained
from tempering.runs.rng import rng_state, set_rng_state

CHECKPOINT_FORMAT = 1
STATE_FILE, META_FILE = "state.pt", "meta.json"


# ---------------------------------------------------------------------- save and load
def training_state(weights: PolicyWeights, trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Weights and optimizer state in the single-process format. Weights are only what
    training changes: the adapter with LoRA, the whole state dict otherwise. Under FSDP every
    rank must call this (it gathers the shards) and rank 0 alone gets them."""
    if weights.sharded:
        names = [n for n, _ in weights.named]
        return sharding.gather_state(weights.model, trainer.optimizer, names, weights.lora)
    return weights.state(), None if trainer.optimizer is None else trainer.optimizer.state_dict()


def save(
    path: str,
    weights: PolicyWeights,
    trainer: Trainer,
    *,
    step: int,
    extra: dict[str, Any],
    model: str,
    lora: Mapping[str, Any] | None,
    world_size: int,
    optimizer_state: bool = True,
    snapshots_state: bool = True,
) -> str:
    """Write a checkpoint folder at ``path``; every rank calls this (each rank's RNG state is
    gathered), rank 0 alone writes, and no rank returns before the folder is complete.
    ``optimizer_state`` / ``snapshots_state`` false leave Adam's moments / the snapshots out
    (weights for sampling: a third of the size with Adam's two moments gone)."""
    rng = distributed.gather_to_main(rng_state())
    if weights.sharded or distributed.is_main():  # under FSDP every rank takes part in gathering
        tensors, optimizer = training_state(weights, trainer)
        optimizer = optimizer if optimizer_state else None
        snapshots = weights.snapshots_state() if snapshots_state else {}
    if distributed.is_main():
        state = {"weights": tensors, "optimizer": optimizer, "rng": rng, "snapshots": snapshots}
        meta = {
            "format": CHECKPOINT_FORMAT,
            "step": step,
            "extra": extra,
            "model": model,
            "lora": lora,
            "world_size": world_size,
        }
        write_dir_atomically(path, lambda tmp: _write_checkpoint(tmp, state, meta))
    distributed.barrier()  # nobody reads the checkpoint before it is complete
    return path


def load(path: str, weights: PolicyWeights, trainer: Trainer) -> dict[str, Any]:
    """Restore weights, optimizer state, snapshots and this rank's RNGs from the checkpoint at
    ``path``; returns its ``meta.json`` (``step``, ``extra``, ...)."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"LocalBackend.load: no checkpoint at '{path}' (missing {META_FILE})")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"LocalBackend.load: '{path}' has format {meta.get('format')}, expected {CHECKPOINT_FORMAT}")
    if bool(meta.get("lora")) != weights.lora:
        kind = "a LoRA adapter" if meta.get("lora") else "full weights"
        raise ValueError(f"LocalBackend.load: '{path}' holds {kind}; configure lora to match ({meta.get('lora')})")
    state = torch.load(os.path.join(path, STATE_FILE), map_location="cpu", weights_only=True)
    weights.load(state["weights"])
    if state["optimizer"] is None:
        trainer.optimizer = None
    elif weights.sharded:
        names = [n for n, _ in weights.named]
        sharding.load_optimizer(weights.model, trainer.get_optimizer(), state["optimizer"], names)
    else:
        trainer.get_optimizer().load_state_dict(state["optimizer"])
    weights.restore_snapshots(state.get("snapshots") or {})
    rngs = state["rng"]
    rank = distributed.rank()
    set_rng_state(rngs[rank] if rank < len(rngs) else rngs[0])
    return meta


def export(
    path: str,
    adapter: bool,
    weights: PolicyWeights,
    trainer: Trainer,
    tokenizer: Tokenizer,
    build_copy: Callable[[], Any],
) -> str:
    """Write the policy in Hugging Face format at ``path`` (rank 0): merged, or the adapter alone.
    Under FSDP the whole policy is first gathered into ``build_copy()``, a fresh unsharded
    model on rank 0's CPU; every rank calls this."""
    model = _whole_policy(weights, trainer, build_copy) if weights.sharded else weights.model
    if distributed.is_main():
        write_pretrained(model, tokenizer, path, merge=weights.lora and not adapter, keep=not weights.sharded)
    distributed.barrier()
    return path


def _whole_policy(weights: PolicyWeights, trainer: Trainer, build_copy: Callable[[], Any]) -> Any:
    """Under FSDP: an unsharded copy of the policy on rank 0's CPU (``None`` on the other
    ranks), rebuilt from the source with the gathered trainable weights. Every rank calls it."""
    tensors, _ = training_state(weights, trainer)
    if not distributed.is_main():
        return None
    model = build_copy()
    model.load_state_dict(tensors, strict=not weights.lora)
    return model


# ---------------------------------------------------------------------- RNGs
def seed_everything(seed: int) -> None:
    """Seed Python's, torch's (every device) and numpy's global RNGs."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    with contextlib.suppress(ImportError):
        import numpy as np

        np.random.seed(seed % 2**32)


# ---------------------------------------------------------------------- files
def _write_checkpoint(directory: str, state: Mapping[str, Any], meta: Mapping[str, Any]) -> None:
    torch.save(dict(state), os.path.join(directory, STATE_FILE))
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def write_dir_atomically(path: str, write: Callable[[str], None]) -> None:
    """Fill a temporary sibling directory, then swap it in: a crash mid-save never leaves a
    half-written checkpoint where a resume would look for one."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    if os.path.exists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
