"""What every backend does alike, written once (issue 22: the backends shared copies).

:func:`float_metrics`: a loss's metrics as the plain floats a backend returns from
``forward_backward`` -- the local backend and Tinker's custom-loss path both call a loss and
must refuse the same way a metric that is not a number.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["float_metrics"]


def float_metrics(metrics: Mapping[str, Any], who: str) -> dict[str, float]:
    """``metrics`` (a loss's, ``who`` its class name) with every value as a float; a value that
    is not a number is a ``TypeError`` naming the metric and the loss."""
    out = {}
    for key, value in metrics.items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(f"forward_backward: metric '{key}' from {who} is not a number ({value!r})") from err
    return out
