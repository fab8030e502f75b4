"""The local backend: Tinker-like training primitives on a transformers model in-process.

``LocalBackend`` lives in :mod:`tempering.plugins.backends.local.backend`; it is resolved here
lazily so that importing this package (e.g. to register plugins) does not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LocalBackend"]


def __getattr__(name: str) -> Any:
    if name == "LocalBackend":
        from tempering.plugins.backends.local.backend import LocalBackend

        return LocalBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
