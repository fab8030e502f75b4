"""The local backend's settings checked before a model is built: the ``lora:`` block, ``dtype``,
``device``, ``parallel``, ``sample_batch_size``, the engine and the model source.

Apart from :class:`~tempering.plugins.backends.local.backend.LocalBackend` because the registry
runs these checks (``check_config``) without building anything, and the Tinker-protocol server
runs the model source's on its command line.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch

import tempering.plugins.backends.local.distributed as distributed
import tempering.plugins.backends.local.sharding as sharding
from tempering.errors import ConfigError
from tempering.plugins.backends.local.model_source import check_model
from tempering.plugins.backends.local.vllm_engine import check_engine
from tempering.schema import Problem, caught

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


#: The path the check gives the raising helpers it shares with the build (``check_lora``,
#: ``check_model`` ...); their errors come back relative to it (:func:`tempering.schema.caught`).
ROOT = "backend"


def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
    """The backend's check (``config``: every key): what can be checked before a model is built
    or downloaded, in this order -- the first problem is the one reported, and the model source
    (a hub lookup, maybe) is only looked at when everything before it is fine. The defaults
    pass every step; a ``model_builder`` takes any model name and arguments, so the model
    source is not checked then."""
    yield caught(ROOT, check_lora, config["lora"], f"{ROOT}.lora")
    yield caught(ROOT, resolve_dtype, config["dtype"], f"{ROOT}.dtype")
    yield caught(ROOT, resolve_device, config["device"], f"{ROOT}.device")
    if config["parallel"] not in sharding.PARALLEL_MODES:
        yield Problem("parallel", f"unknown mode {config['parallel']!r}; choose ddp (replicated) or fsdp (sharded)")
    if config["sample_batch_size"] < 1:
        yield Problem("sample_batch_size", f"must be >= 1, got {config['sample_batch_size']}")
    yield caught(ROOT, check_engine, config["engine"], config["vllm"], ROOT, config["device"])
    if config["model_builder"] is None:
        yield caught(ROOT, check_model, config["model"], config["model_kwargs"], ROOT)


def check_lora(lora: object, path: str) -> dict[str, Any] | None:
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
