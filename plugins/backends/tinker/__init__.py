"""The Tinker backend: the same training primitives as the local backend, run on Tinker's
service through the official SDK (``pip install "tempering[tinker]"``).

``TinkerBackend`` lives in :mod:`tempering.plugins.backends.tinker.backend`; it is resolved here
lazily, so that importing this package (e.g. to register plugins) imports neither torch nor the
Tinker SDK.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TinkerBackend"]


def __getattr__(name: str) -> Any:
    if name == "TinkerBackend":
        from tempering.plugins.backends.tinker.backend import TinkerBackend

        return TinkerBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
