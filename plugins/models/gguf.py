"""Any GGUF file as a Hugging Face model folder, converted once and cached.

transformers reads GGUF (through the ``gguf`` package) but dequantises it on every load (~40 s
for a 135M model on two busy cores) and refuses to ``save_pretrained`` the result. So the first
load converts: the model is rebuilt from its config *without* the quantisation config, the
dequantised state dict is loaded into it (every key must match), and model and tokenizer are
saved as a normal safetensors folder. Later loads read that folder (~1 s).

The folder lives under :func:`cache_root` in a directory named after the file's content hash, so
a changed file converts again and two files never share a folder. It is written in a temporary
sibling and renamed into place: a conversion killed half-way leaves no folder that looks
complete (the leftover temporary is removed by the next conversion).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

from tempering.errors import ConfigError

#: Overrides where converted models are cached (default ``~/.cache/tempering/models``).
CACHE_ENV = "TEMPERING_MODEL_CACHE"
#: Written last into a converted folder: its presence means the conversion finished.
DONE_FILE = "tempering_gguf.json"
#: GGUF files start with these four bytes.
GGUF_MAGIC = b"GGUF"
#: The install line for the reader of GGUF files.
GGUF_INSTALL = 'pip install "gguf>=0.17"'


def cache_root(cache_dir: str | None = None) -> str:
    """Where converted folders go: ``cache_dir``, else ``$TEMPERING_MODEL_CACHE``, else
    ``$XDG_CACHE_HOME/tempering/models`` (``~/.cache/tempering/models``)."""
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir))
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tempering", "models")


def check_gguf_file(path: str, key: str = "model_kwargs.path") -> None:
    """One line under ``key`` unless ``path`` is a readable GGUF file and ``gguf`` is importable."""
    if not os.path.isfile(path):
        raise ConfigError(f"no GGUF file at '{path}'", key)
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ConfigError(
            f"'{path}' is not a GGUF file (it starts with {magic!r}, not b'GGUF'): "
            "the file is corrupt or of another format",
            key,
        )
    # A probe, not an import: transformers imports `gguf` itself when it reads the file, and
    # the package is optional (installed with the model wheels), so type checkers must not need it.
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(f"reading a GGUF file needs the `gguf` package: {GGUF_INSTALL}", key)


def file_digest(path: str) -> str:
    """The first 16 hex digits of the file's SHA-256 (93 MB: ~0.3 s)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def converted_folder(
    path: str, cache_dir: str | None = None, name: str | None = None, announce: Callable[[str], Any] | None = None
) -> str:
    """The cached Hugging Face folder of the GGUF file ``path``, converting it first if needed
    (``announce`` is told, only then, that a conversion starts: a cache hit says nothing)."""
    path = os.path.abspath(path)
    check_gguf_file(path)
    stem = name or re.sub(r"[^A-Za-z0-9_.-]+", "-", os.path.splitext(os.path.basename(path))[0])
    root = cache_root(cache_dir)
    target = os.path.join(root, f"{stem}-{file_digest(path)}")
    if os.path.isfile(os.path.join(target, DONE_FILE)):
        return target
    os.makedirs(root, exist_ok=True)
    _remove_stale_temporaries(root, os.path.basename(target))
    work = tempfile.mkdtemp(prefix=f"{os.path.basename(target)}.tmp-{os.getpid()}-", dir=root)
    try:
        if announce is not None:
            announce(
                f"Converting the GGUF weights into a Hugging Face folder (once, ~40 s for 135M parameters): {target}"
            )
        try:
            convert(path, work)
        except Exception as exc:  # a truncated or unsupported file fails deep in gguf/transformers
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise ConfigError(
                f"could not convert the GGUF file '{path}' ({type(exc).__name__}: {first}); the file may be "
                "truncated or corrupt (reinstall it), or of an architecture transformers cannot read "
                "from GGUF",
                "backend.model",
            ) from exc
        os.chmod(work, 0o755)  # mkdtemp's 0700 would hide the folder from other users of the cache
        with open(os.path.join(work, DONE_FILE), "w") as f:
            json.dump({"source": path, "format": "gguf"}, f)
        try:
            os.rename(work, target)
        except OSError:  # another process finished first: keep its folder
            if not os.path.isfile(os.path.join(target, DONE_FILE)):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(work, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def convert(path: str, folder: str) -> None:
    """Dequantise the GGUF file ``path`` into a float32 safetensors model + tokenizer in ``folder``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, filename = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    quantised = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename, dtype=torch.float32)
    config = AutoConfig.from_pretrained(directory, gguf_file=filename)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = quantised.state_dict()
    missing, unexpected = plain.load_state_dict(state, strict=False, assign=True)
    # Tied embeddings show up as a missing lm_head when the file stores one matrix.
    missing = [k for k in missing if not (k == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))]
    if missing or unexpected:
        raise ValueError(
            f"converting '{path}': the dequantised weights do not fit the model built from its config "
            f"(missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.generation_config = quantised.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _remove_stale_temporaries(root: str, stem: str) -> None:
    """Temporaries of ``stem`` left by a killed conversion (their process is gone)."""
    for entry in os.listdir(root):
        match = re.fullmatch(re.escape(stem) + r"\.tmp-(\d+)-.*", entry)
        if match and not _alive(int(match.group(1))):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
