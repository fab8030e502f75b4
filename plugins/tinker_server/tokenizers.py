"""Tokenizers a client loads through the SDK, offline: the served model's tokenizer placed in
the Hugging Face hub cache under the name the model is served as.

Why: the SDK's ``TrainingClient.get_tokenizer()`` (and the cookbook's ``get_tokenizer``, and
``SamplingClient.get_tokenizer()``, which ignores ``tokenizer_id``) call
``AutoTokenizer.from_pretrained(<name>)``. With the model served as
``HuggingFaceTB/SmolLM2-135M-Instruct`` and the tokenizer files in the cache's layout
(``models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/<revision>/`` and ``refs/main``),
that call finds them with ``HF_HUB_OFFLINE=1`` and no network -- on the machine the server runs
on (a client elsewhere installs the same files into its own cache: ``python -m
tempering.plugins.tinker_server.tokenizers NAME --from FOLDER``). An entry already in the cache
(a real download) is never overwritten.
"""

from __future__ import annotations

import argparse
import os
import shutil
from typing import Any

from tempering.interfaces import Tokenizer

__all__ = ["hub_cache", "cached_name", "install_tokenizer"]

REVISION = "tempering-served"  # the snapshot folder's name (a real download's is a commit hash)


def hub_cache() -> str:
    """The Hugging Face hub cache folder, found the way ``huggingface_hub`` finds it."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return os.path.join(home, "hub")


def _repo_dir(name: str, cache: str | None) -> str:
    return os.path.join(cache or hub_cache(), "models--" + name.replace("/", "--"))


def cached_name(name: str, cache: str | None = None) -> str | None:
    """``name`` when ``AutoTokenizer.from_pretrained(name)`` finds it in the cache, else None."""
    if name.count("/") != 1:
        return None
    return name if os.path.isfile(os.path.join(_repo_dir(name, cache), "refs", "main")) else None


def install_tokenizer(name: str, tokenizer: Tokenizer, cache: str | None = None, config: Any = None) -> str | None:
    """Write ``tokenizer`` (an HF tokenizer, or a folder holding one) into the hub cache as
    ``name`` (``org/model``) unless the cache has ``name`` already; returns the snapshot folder
    written, or None when nothing was written. ``config`` (the model's ``PretrainedConfig``)
    goes beside it: ``AutoTokenizer`` reads ``config.json`` to pick the tokenizer class."""
    if name.count("/") != 1:
        raise ValueError(f"a Hugging Face name has the form org/model, got {name!r}")
    if cached_name(name, cache):
        return None
    repo = _repo_dir(name, cache)
    snapshot = os.path.join(repo, "snapshots", REVISION)
    if isinstance(tokenizer, str):
        shutil.copytree(tokenizer, snapshot, dirs_exist_ok=True)
    else:
        tokenizer.save_pretrained(snapshot)
    if config is not None:
        config.save_pretrained(snapshot)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as fh:
        fh.write(REVISION)
    return snapshot


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Install a served model's tokenizer into this machine's Hugging "
        "Face cache under the name the server serves it as."
    )
    parser.add_argument("name", help="the served name, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("--from", dest="source", required=True, help="a folder holding the tokenizer files")
    args = parser.parse_args(argv)
    written = install_tokenizer(args.name, args.source)
    print(f"installed into {written}" if written else f"{args.name} is in the cache already; left as it is")


if __name__ == "__main__":
    main()
