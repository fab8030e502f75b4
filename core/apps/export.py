"""``tempering export RUN_DIR --to DIR``: a run's checkpoint as a Hugging Face model folder.

A checkpoint (``checkpoints/stepNNNNNN``) is the backend's own format -- weights or adapter,
optimizer state, RNG, loop position -- made for resuming, not for use elsewhere. Exporting
rebuilds the run's backend from ``run.json`` exactly as the run built it (same model source,
same seed, so a LoRA adapter lands on the base it was trained on), loads the checkpoint, and
asks the backend to write the policy: ``export_pretrained(path, adapter=...)``. The local
backend writes a folder ``AutoModelForCausalLM.from_pretrained`` loads (LoRA merged into the
base weights), or with ``adapter`` the peft adapter alone; the tokenizer goes with either, and
``tempering.json`` says which run, checkpoint and renderer it came from (``tempering eval`` and
the inspect bridge read the renderer there when the tokenizer has no chat template).

A backend that trains a LoRA adapter on a service offers ``download_weights(dir)`` instead
(Tinker: ``save_weights_external`` and the signed URLs of its SDK). Export downloads the
adapter and does the rest here, as the local backend does: with ``adapter`` the peft folder as
downloaded; else the adapter merged into the base model, built locally -- a model builder the
recipe names (``tiny_llama`` with the recipe's ``model_kwargs``: what the local Tinker server
serves), or a Hugging Face folder or cached hub model of that name, or ``base_model`` (``--base-model
PATH``: the base model's Hugging Face folder). The tokenizer is the backend's, the one training
used. A backend with neither method cannot be exported (the error says so).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from tempering.errors import ConfigError
from tempering.interfaces import DownloadableWeights, Exportable, LoadedModel, model_renderer, supports
from tempering.registry import Registry, registered_builder
from tempering.runs.pretrained import write_pretrained
from tempering.training.rundata import RunDir, run_backend

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import Backend

#: Written beside the model: where it came from, and the renderer it was trained with.
NOTE = "tempering.json"


@dataclass
class Exported:
    """Where the model went and what it came from."""

    path: str
    checkpoint: str
    global_step: int
    stage: str
    adapter: bool


def export_run(
    run_dir: str,
    to: str,
    step: int | None = None,
    adapter: bool = False,
    registry: Registry | None = None,
    base_model: str | None = None,
) -> Exported:
    """Export checkpoint ``step`` (default: the latest) of the run in ``run_dir`` to ``to``;
    ``base_model``: the base model's Hugging Face folder, for a run that trained an adapter on
    a service (Tinker) whose base cannot be built or found on this machine."""
    run = RunDir.open(run_dir)
    if os.path.exists(to) and os.listdir(to):
        raise ConfigError(f"'{to}' exists and is not empty; export into a new folder", "--to")
    with run_backend(run, step, registry) as (backend, checkpoint):
        if supports(backend, DownloadableWeights):
            export_downloaded(backend, run.recipe.get("backend") or {}, to, adapter, base_model)
        elif not supports(backend, Exportable):
            raise ConfigError(
                f"the {type(backend).__name__} backend cannot export a model (no export_pretrained)", "backend"
            )
        elif base_model is not None:
            raise ConfigError(
                f"the {type(backend).__name__} backend exports its own model; --base-model is for runs "
                "trained on a service (Tinker)",
                "--base-model",
            )
        else:
            try:
                backend.export_pretrained(to, adapter=adapter)
            except ValueError as exc:  # the backend's own refusal, e.g. --adapter without LoRA
                raise ConfigError(str(exc), "--adapter") from None
        renderer = trained_renderer(run.recipe) or model_renderer(backend)
    done = Exported(to, checkpoint["path"], int(checkpoint["global_step"]), str(checkpoint.get("stage", "")), adapter)
    note = {
        "run": os.path.abspath(run.path),
        "checkpoint": os.path.abspath(done.checkpoint),  # both paths absolute: the note is read from anywhere
        "global_step": done.global_step,
        "stage": done.stage,
        "adapter": adapter,
        "renderer": renderer,
    }
    with open(os.path.join(to, NOTE), "w", encoding="utf-8") as fh:
        json.dump(note, fh, indent=2)
    return done


def export_downloaded(
    backend: Backend, spec: Mapping[str, Any], to: str, adapter: bool, base_model: str | None
) -> None:
    """The adapter ``backend.download_weights`` fetches, written to ``to`` with the backend's
    tokenizer: as downloaded (``adapter``), or merged into the base model (:func:`adapter_base`)."""
    if adapter:
        cast("DownloadableWeights", backend).download_weights(to)
        backend.tokenizer.save_pretrained(to)
        return
    base = adapter_base(getattr(backend, "base_model", None) or spec.get("model"), spec.get("model_kwargs"), base_model)
    from peft import PeftModel

    with tempfile.TemporaryDirectory(prefix="tempering-export-") as folder:
        cast("DownloadableWeights", backend).download_weights(folder)
        if not os.path.isfile(os.path.join(folder, "adapter_config.json")):
            raise ConfigError(
                f"the weights {type(backend).__name__} downloaded are not a LoRA adapter (no "
                "adapter_config.json); export them with --adapter",
                "--adapter",
            )
        model = PeftModel.from_pretrained(base, folder)
        write_pretrained(model, backend.tokenizer, to, merge=True, keep=False)


def adapter_base(name: object, model_kwargs: Mapping[str, Any] | None, folder: str | None) -> Any:
    """The base model an adapter trained on a service merges into: ``folder`` (``--base-model``),
    else the model builder ``name`` with ``model_kwargs`` at its own default seed (the local Tinker
    server's base), else the Hugging Face folder or cached hub model ``name`` -- never downloaded."""
    from transformers import AutoModelForCausalLM  # lazy: torch and transformers load only when exporting

    if folder is not None:
        if not os.path.isfile(os.path.join(folder, "config.json")):
            raise ConfigError(
                f"'{folder}' holds no config.json; give the base model's Hugging Face folder", "--base-model"
            )
        return AutoModelForCausalLM.from_pretrained(folder)
    builder = registered_builder(str(name)) if isinstance(name, str) and name else None
    if builder is not None:
        return LoadedModel.of(builder(**dict(model_kwargs or {}))).model
    local = _local_model_folder(str(name))
    if local is None:
        raise ConfigError(
            f"the base model {name!r} is not on this machine (no model builder, folder or Hugging Face "
            "cache entry of that name), so the adapter cannot be merged; pass --base-model PATH (the "
            "base model's Hugging Face folder) or export the adapter alone with --adapter",
            "--base-model",
        )
    return AutoModelForCausalLM.from_pretrained(local)


def _local_model_folder(name: str) -> str | None:
    """``name`` as a saved-model folder, or its Hugging Face cache snapshot; ``None`` if it is
    neither (the hub is not asked: ``from_pretrained`` retries it for tens of seconds)."""
    if os.path.isfile(os.path.join(name, "config.json")):
        return name
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        config = try_to_load_from_cache(name, "config.json")
    except HFValidationError:  # not a hub id either
        return None
    return os.path.dirname(config) if isinstance(config, str) else None


def trained_renderer(recipe: Mapping[str, Any]) -> str | None:
    """The renderer the recipe's last stage that names one trained with (``auto`` says nothing)."""
    named = [s.get("renderer") for s in recipe.get("stages") or [] if isinstance(s, Mapping)]
    named = [r for r in named if isinstance(r, str) and r != "auto"]
    return named[-1] if named else None


def exported_renderer(model_dir: str) -> str | None:
    """The renderer an exported model was trained with (``tempering.json``), when its
    tokenizer alone cannot say (a tiny chat model's tokenizer has no chat template)."""
    try:
        with open(os.path.join(model_dir, NOTE), encoding="utf-8") as fh:
            value = json.load(fh).get("renderer")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None
