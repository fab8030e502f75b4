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

A backend without ``export_pretrained`` cannot be exported (the error says so); a remote
backend implements it by downloading its weights (Tinker: the sampler weights, through its SDK).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tempering.errors import ConfigError
from tempering.rundata import RunDir, run_backend

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


def export_run(run_dir: str, to: str, step: int | None = None, adapter: bool = False, registry: Any = None) -> Exported:
    """Export checkpoint ``step`` (default: the latest) of the run in ``run_dir`` to ``to``."""
    run = RunDir.open(run_dir)
    if os.path.exists(to) and os.listdir(to):
        raise ConfigError(f"'{to}' exists and is not empty; export into a new folder", "--to")
    with run_backend(run, step, registry) as (backend, checkpoint):
        export = getattr(backend, "export_pretrained", None)
        if export is None:
            raise ConfigError(f"the {type(backend).__name__} backend cannot export a model (no export_pretrained)", "backend")
        try:
            export(to, adapter=adapter)
        except ValueError as exc:  # the backend's own refusal, e.g. --adapter without LoRA
            raise ConfigError(str(exc), "--adapter") from None
        renderer = trained_renderer(run.recipe) or getattr(getattr(backend, "tokenizer", None), "tempering_renderer", None)
    done = Exported(to, checkpoint["path"], int(checkpoint["global_step"]), str(checkpoint.get("stage", "")), adapter)
    note = {"run": os.path.abspath(run.path), "checkpoint": done.checkpoint, "global_step": done.global_step,
            "stage": done.stage, "adapter": adapter, "renderer": renderer}  # fmt: skip
    with open(os.path.join(to, NOTE), "w", encoding="utf-8") as fh:
        json.dump(note, fh, indent=2)
    return done


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
