"""The local backend's settings checked before a model is built: the ``lora:`` block, ``dtype``,
``device``, ``parallel``, ``sample_batch_size``, the engine and the model source.

Apart from :class:`~tempering.plugins.backends.local.backend.LocalBackend` because the registry
runs these checks (``check_params``) without building anything, and the Tinker-protocol server
runs them on its command line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import torch

import tempering.plugins.backends.local.distributed as distributed
import tempering.plugins.backends.local.sharding as sharding
from tempering.errors import ConfigError
from tempering.plugins.backends.local.model_source import check_model
from tempering.plugins.backends.local.vllm_engine import check_engine

DEFAULT_MODEL = "tiny_llama"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class LoraParams:
    """The ``lora:`` block: adapter rank, alpha, dropout and the modules it wraps (peft's
    ``r``, ``lora_alpha``, ``lora_dropout``, ``target_modules``)."""

    rank: int = 32
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Any = "all-linear"


def check_params(params: Mapping[str, Any], path: str = "backend") -> None:
    """Check what can be checked before a model is built or downloaded; the keys present only
    (see :meth:`~tempering.plugins.backends.local.backend.LocalBackend.check_params`)."""
    if "lora" in params:
        check_lora(params["lora"], f"{path}.lora")
    if "dtype" in params:
        resolve_dtype(params["dtype"], f"{path}.dtype")
    if "device" in params:
        resolve_device(params["device"], f"{path}.device")
    if params.get("parallel", "ddp") not in sharding.PARALLEL_MODES:
        raise ConfigError(
            f"unknown mode {params['parallel']!r}; choose ddp (replicated) or fsdp (sharded)", f"{path}.parallel"
        )
    if params.get("sample_batch_size", 1) < 1:
        raise ConfigError(f"must be >= 1, got {params['sample_batch_size']}", f"{path}.sample_batch_size")
    if "engine" in params or "vllm" in params:
        check_engine(params.get("engine", "generate"), params.get("vllm"), path)
    if params.get("model_builder") is None:  # a runtime builder takes any name and arguments
        check_model(params.get("model", DEFAULT_MODEL), params.get("model_kwargs"), path)


def check_lora(lora: Any, path: str) -> dict[str, Any] | None:
    """The ``lora:`` block with defaults filled in (``None``: full fine-tuning)."""
    from tempering.registry import validate_params

    if lora is None:
        return None
    if not isinstance(lora, Mapping):
        raise ConfigError(f"expected a mapping such as {{rank: 8}} (or null for full fine-tuning), got {lora!r}", path)
    cfg = dataclasses.asdict(LoraParams(**validate_params(LoraParams, lora, path)))
    if cfg["rank"] < 1:
        raise ConfigError(f"must be >= 1, got {cfg['rank']}", f"{path}.rank")
    tm = cfg["target_modules"]
    cfg["target_modules"] = tm if isinstance(tm, str) else [str(m) for m in tm]
    return cfg


def resolve_dtype(name: str, path: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError(f"unknown dtype '{name}'; choose one of {', '.join(sorted(DTYPES))}", path)
    return DTYPES[name]


def resolve_device(name: str, path: str) -> torch.device:
    """``auto`` picks CUDA when present; under torchrun a bare ``cuda`` is the local GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and distributed.world_size() > 1:
        name = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    try:
        return torch.device(name)
    except RuntimeError as err:
        raise ConfigError(f"invalid device '{name}' ({err}); use cpu, cuda, cuda:N or auto", path) from err
