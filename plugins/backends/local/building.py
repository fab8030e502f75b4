"""Building the local backend's policy: the base model from its source, the LoRA adapter, the
special token ids and a neutral generation config.

Every build is deterministic given the seed, on purpose: data-parallel ranks, the full
fine-tuning reference model and (under FSDP) the unsharded copy written by an export are each
rebuilt this way and must come out identical to the policy at start-up (:func:`fingerprint`
checks it for the reference).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from transformers import GenerationConfig

from tempering.errors import ConfigError
from tempering.interfaces import LoadedModel, Tokenizer
from tempering.plugins.backends.local.model_source import quiet_loading, registered_builder, source_folder


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the base model comes from and how it is laid out: a registered builder's name (or a
    Hugging Face folder / hub id) with its keyword arguments, the seed, dtype and device; a
    runtime ``builder`` wins over the name."""

    name: str
    kwargs: Mapping[str, Any]
    seed: int
    dtype: torch.dtype
    device: torch.device
    builder: Callable[..., LoadedModel | tuple[Any, Any]] | None = None

    def build(self, device: torch.device | None = None) -> LoadedModel:
        """The base model (in eval mode, on ``device``, default :attr:`device`), its tokenizer and
        the renderer it declares, built with a private RNG seeded by :attr:`seed`, so the global
        RNGs are left alone."""
        with torch.random.fork_rng(devices=[]), quiet_loading():
            torch.manual_seed(self.seed)
            loaded = LoadedModel.of(self._load())
        model = loaded.model.to(device=device or self.device, dtype=self.dtype)
        model.eval()
        return LoadedModel(model, loaded.tokenizer, loaded.renderer)

    def _load(self) -> LoadedModel | tuple[Any, Any]:
        builder = self.builder
        if builder is None:
            builder = registered_builder(self.name)
        if builder is not None:
            kwargs = dict(self.kwargs)
            if "seed" not in kwargs and "seed" in inspect.signature(builder).parameters:
                kwargs["seed"] = self.seed
            return builder(**kwargs)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs = dict(self.kwargs)
        revision = kwargs.get("revision")
        folder = source_folder(self.name)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=self.dtype, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(folder, revision=revision)
        return model, tokenizer


def special_ids(model: torch.nn.Module, tokenizer: Tokenizer) -> tuple[int, set[int]]:
    """Pad id (eos when the tokenizer has none) and every id that ends a completion."""
    eos: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif source is not None:
            eos.update(int(t) for t in source)
    if not eos:
        raise ValueError("LocalBackend: the tokenizer has no eos token; completions could never stop")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    return int(pad), eos


def neutral_generation_config(tokenizer: Tokenizer, pad_token_id: int, eos_token_ids: set[int]) -> GenerationConfig:
    """Only the special ids: a checkpoint's sampling defaults (Qwen ships top_k=20,
    repetition_penalty=1.05, ...) would otherwise leak into every ``generate`` call and
    make sampler logprobs disagree with the model. Sampling is set by SamplingParams alone."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return GenerationConfig(pad_token_id=pad_token_id, bos_token_id=bos, eos_token_id=sorted(eos_token_ids))


def apply_lora(model: torch.nn.Module, cfg: Mapping[str, Any], seed: int) -> Any:
    """``model`` wrapped in a peft LoRA adapter per the ``lora:`` block, initialised from
    ``seed`` with a private RNG."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=int(cfg["rank"]),
        # peft annotates lora_alpha as int, but scales by lora_alpha / r: a float alpha is honoured
        lora_alpha=cast(int, float(cfg["alpha"])),
        lora_dropout=float(cfg["dropout"]),
        target_modules=cfg["target_modules"],
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft 0.21 calls a transformers-5 deprecated alias; the warning is not actionable here.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def enable_gradient_checkpointing(model: Any, key: str) -> None:
    """Turn on transformers' gradient checkpointing for ``model`` (a peft wrapper passes it on),
    non-reentrant: it needs no input that requires grad, so frozen embeddings under LoRA work.
    A model that cannot is a :class:`ConfigError` at ``key``."""
    if not getattr(model, "supports_gradient_checkpointing", False):  # peft forwards the attribute
        raise ConfigError(f"{type(model).__name__} does not support gradient checkpointing; set it to false", key)
    try:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    except (ValueError, AttributeError) as exc:
        raise ConfigError(f"gradient checkpointing cannot be turned on: {exc}; set it to false", key) from None


def fingerprint(model: torch.nn.Module) -> list[float]:
    """A cheap checksum of up to 8 parameter tensors spread over the model."""
    params = list(model.parameters())
    picked = params[:: max(1, len(params) // 8)]
    with torch.no_grad():
        return [float(p.detach().reshape(-1)[:65536].double().sum()) for p in picked]
