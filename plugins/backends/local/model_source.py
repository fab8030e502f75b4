"""Where the local backend's model comes from, checked before anything is built or downloaded.

``model:`` is one of four things, tried in this order:

1. a model builder registered by a plugin (``tiny_llama``, ``smollm2``); ``model_kwargs`` are
   its arguments and are checked against its signature, so ``hiden_size`` fails with a
   suggestion instead of a ``TypeError`` from deep inside the build;
2. a GGUF file (``*.gguf``), converted once into a cached Hugging Face folder
   (:mod:`tempering.plugins.models.gguf`) and loaded from there;
3. an existing folder holding a saved model (``config.json`` and a tokenizer);
4. a Hugging Face hub id, found in the local cache or -- unless the hub is off
   (``HF_HUB_OFFLINE=1``) -- looked up once, with a short timeout.

A name that is none of these used to reach ``from_pretrained``, which retries the hub for the
better part of a minute before an ``OSError``. :func:`check_model` says at once which of the
three the name is not. Only :func:`registered_builder` is needed at build time.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
from collections.abc import Iterator, Mapping

from tempering.errors import ConfigError, PluginError
from tempering.registry import get_registry, registered_builder, validate_params  # registered_builder: re-exported

#: Seconds for the one hub lookup of a name that is neither a builder nor a folder.
HUB_TIMEOUT = 10.0
_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
#: Files any of which makes a folder's tokenizer loadable by ``AutoTokenizer``.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tml_tokenizer.json")


def is_gguf(name: str) -> bool:
    """Whether ``model:`` names a GGUF file (by its extension: the file itself is checked later)."""
    return name.lower().endswith(".gguf")


@contextlib.contextmanager
def quiet_loading() -> Iterator[None]:
    """transformers 5 draws a "Loading weights" progress bar on every ``from_pretrained``; a run
    shows its own progress, so the bar (and nothing else) is turned off while a model loads."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def source_folder(name: str) -> str:
    """The folder ``from_pretrained`` loads for ``model: name``: a GGUF file's cached conversion,
    else ``name`` itself (a folder or a hub id)."""
    if is_gguf(name):
        from tempering.plugins.models.gguf import converted_folder

        return converted_folder(os.path.expanduser(name))
    return name


def check_model(name: object, model_kwargs: object, path: str) -> None:
    """Raise a one-line :class:`ConfigError` under ``path`` (the backend's config path) unless
    ``name`` is a builder whose arguments ``model_kwargs`` fit, a saved-model folder, or a hub id
    that exists."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"expected a model builder name, a folder or a Hugging Face hub id, got {name!r}", f"{path}.model"
        )
    if model_kwargs is not None and not isinstance(model_kwargs, Mapping):
        raise ConfigError(
            f"expected a mapping of keyword arguments, got {type(model_kwargs).__name__}", f"{path}.model_kwargs"
        )
    try:
        builder = registered_builder(name)
    except PluginError as exc:  # two packages register this model name
        raise PluginError(f"{path}.model: {exc}") from None
    if builder is not None:
        validate_params(builder, dict(model_kwargs or {}), f"{path}.model_kwargs")
        return
    if is_gguf(name):
        from tempering.plugins.models.gguf import check_gguf_file

        check_gguf_file(os.path.expanduser(name), f"{path}.model")
        return
    if os.path.isdir(name):
        if not os.path.isfile(os.path.join(name, "config.json")):
            raise ConfigError(
                f"the folder '{name}' holds no config.json, so it is not a saved model "
                "(write one with save_pretrained or the backend's export_pretrained)",
                f"{path}.model",
            )
        if not any(os.path.isfile(os.path.join(name, f)) for f in TOKENIZER_FILES):
            raise ConfigError(
                f"the folder '{name}' holds a model but no tokenizer (none of {', '.join(TOKENIZER_FILES)}); "
                "save one there with tokenizer.save_pretrained(folder)",
                f"{path}.model",
            )
        return
    problem = _hub_problem(name, (model_kwargs or {}).get("revision"))
    if problem is None:
        return
    builders = get_registry().names("model")
    close = difflib.get_close_matches(name, builders, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    raise ConfigError(
        f"'{name}' is not a registered model builder{hint}, not an existing folder, and {problem}. "
        f"Model builders: {', '.join(builders) or '(none)'}",
        f"{path}.model",
    )


def _hub_problem(name: str, revision: str | None) -> str | None:
    """``None`` if ``name`` is a usable hub id, else why not (the end of the error message)."""
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return "not a Hugging Face hub id either (those read 'name' or 'org/name')"
    if isinstance(try_to_load_from_cache(name, "config.json", revision=revision), str):
        return None
    if hub_offline():
        why = " / ".join(v for v in _OFFLINE_VARS if _env_true(v)) or "HF_HUB_OFFLINE"
        return f"not in the Hugging Face cache ({why} is set, so the hub was not asked)"
    return hub_lookup(name)


def hub_offline() -> bool:
    """Whether the hub may not be asked (read now, not at import: tests and users set it late)."""
    from huggingface_hub import is_offline_mode

    return any(_env_true(v) for v in _OFFLINE_VARS) or bool(is_offline_mode())


def _env_true(var: str) -> bool:
    return os.environ.get(var, "").strip().lower() in {"1", "true", "yes", "on"}


@functools.lru_cache(maxsize=64)
def hub_lookup(name: str) -> str | None:
    """Ask the hub once whether model ``name`` exists (``None``: it does, gated ones included).
    Cached: the backend checks its config when the registry validates it and again when built."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:
        HfApi().model_info(name, timeout=HUB_TIMEOUT)
    except GatedRepoError:
        return None  # it exists; access is from_pretrained's business
    except RepositoryNotFoundError:
        return "not a model on the Hugging Face hub (no such repository, or a private one: log in with `hf auth login`)"
    except Exception as exc:  # noqa: BLE001 - any network failure: say so in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return (
            f"the Hugging Face hub could not be reached to look it up ({type(exc).__name__}: {first}); "
            "fix the name, or download the model and set HF_HUB_OFFLINE=1"
        )
    return None
