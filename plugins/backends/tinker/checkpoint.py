"""Tinker checkpoints on local disk, and weights downloaded off the service.

The weights and optimizer state stay on the service (``save_state`` gives a ``tinker://``
path); what a run folder keeps is the record of it: ``tinker_checkpoint.json`` with that path,
the step, the snapshots' paths and the caller's ``extra``. The same record is also indexed by
its ``tinker://`` path (under ``checkpoint_index_dir``), so ``load("tinker://...")`` finds the
step and ``extra`` too.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

from tempering.plugins.backends.tinker.errors import TinkerServiceError, one_line
from tempering.runs.runfolder import write_json

CHECKPOINT_FILE = "tinker_checkpoint.json"
CHECKPOINT_FORMAT = 1


def safe_name(name: str) -> str:
    """A name the service accepts for a saved state or weights (letters, digits, ``_.-``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-")[:120] or "checkpoint"


def index_file(index_dir: str, tinker_path: str) -> str:
    key = hashlib.sha256(tinker_path.encode("utf-8")).hexdigest()[:32]
    return os.path.join(index_dir, f"{key}.json")


def write_record(path: str, index_dir: str, record: Mapping[str, Any]) -> None:
    """``record`` into the checkpoint folder ``path`` and into the index by its tinker path."""
    write_json(os.path.join(path, CHECKPOINT_FILE), record)
    write_json(index_file(index_dir, str(record["tinker_path"])), {**record, "checkpoint_dir": os.path.abspath(path)})


def read_record(path: str, index_dir: str, base_model: str) -> dict[str, Any]:
    """The record of a checkpoint folder or of a ``tinker://`` state path (without an index
    entry: weights and optimizer only, with a warning), checked against this backend's model."""
    if path.startswith("tinker://"):
        index = index_file(index_dir, path)
        if os.path.exists(index):
            record = read_json(index)
        else:
            warnings.warn(
                f"no local record of {path} in {index_dir}: restoring weights and optimizer "
                "only (step 0, no snapshots, no extra)",
                UserWarning,
                stacklevel=3,
            )
            record = {"format": CHECKPOINT_FORMAT, "tinker_path": path, "step": 0, "snapshots": {}, "extra": {}}
    else:
        file = os.path.join(path, CHECKPOINT_FILE)
        if not os.path.isfile(file):
            other = " (it holds a local-backend checkpoint)" if os.path.isfile(os.path.join(path, "meta.json")) else ""
            raise FileNotFoundError(
                f"TinkerBackend.load: no Tinker checkpoint at '{path}' (missing {CHECKPOINT_FILE}){other}"
            )
        record = read_json(file)
    if record.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(
            f"TinkerBackend.load: '{path}' has format {record.get('format')}, expected {CHECKPOINT_FORMAT}"
        )
    if record.get("base_model") not in (None, base_model):
        raise ValueError(
            f"TinkerBackend.load: '{path}' was trained from {record['base_model']!r}; set backend.base_model to it "
            f"(configured: {base_model!r})"
        )
    return record


def download_files(urls: Mapping[str, str], dest: str, timeout: float) -> None:
    """Fetch each ``relative path -> signed URL`` into ``dest`` (a path that would leave
    ``dest`` is refused: the names come from the service)."""
    import urllib.error
    import urllib.request

    if not urls:
        raise TinkerServiceError("download_weights: Tinker listed no files for the exported weights")
    root = os.path.realpath(dest)
    for name, url in sorted(urls.items()):
        target = os.path.realpath(os.path.join(root, name))
        if os.path.commonpath([root, target]) != root:
            raise TinkerServiceError(
                f"download_weights: refusing the file name {name!r}, which leaves the folder {dest}"
            )
        os.makedirs(os.path.dirname(target), exist_ok=True)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(target, "wb") as fh:
                shutil.copyfileobj(response, fh)
        except (urllib.error.URLError, OSError) as err:
            raise TinkerServiceError(
                f"download_weights: could not download {name} of the exported weights ({one_line(err)})"
            ) from err


def read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as fh:
        data: dict[str, Any] = json.load(fh)
    return data
