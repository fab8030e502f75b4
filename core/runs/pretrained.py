"""A model as a Hugging Face folder: what ``from_pretrained`` loads elsewhere.

Here, below the backends and the apps, because both write one: the local backend's
``export_pretrained`` (a checkpoint's policy) and ``tempering export`` for weights a service
trained (:mod:`tempering.apps.export`). With it in ``apps``, the backend imported the app that
calls the backend.
"""

from __future__ import annotations

import copy
from typing import Any

from tempering.interfaces import Tokenizer


def write_pretrained(model: Any, tokenizer: Tokenizer, path: str, merge: bool, keep: bool = True) -> str:
    """Save ``model`` (a peft model merged into its base weights when ``merge``) and the
    tokenizer to ``path``. ``keep``: merge a copy, as merging in place ends a model still in use."""
    if merge:
        model = (copy.deepcopy(model) if keep else model).merge_and_unload()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
