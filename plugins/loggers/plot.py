"""Reward curve PNG written when the run ends (and re-read from metrics.jsonl, so a resumed
run plots its whole history, not only the part since the restart)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from tempering.plugins.loggers.jsonl import read_jsonl


class PlotLogger:
    def __init__(
        self,
        output_dir: str,
        filename: str = "reward_curve.png",
        metrics: list[str] | None = None,
        source: str = "metrics.jsonl",
    ) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, filename)
        self.metrics = metrics or ["reward/mean", "eval/accuracy", "accuracy"]
        self.source = os.path.join(output_dir, source)
        self._rows: list[dict[str, Any]] = []

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._rows.append(dict(metrics))

    def close(self) -> None:
        rows = read_jsonl(self.source) if os.path.exists(self.source) else self._rows
        plot_metrics(rows, self.metrics, self.path)


def plot_metrics(rows: list[Mapping[str, Any]], metrics: list[str], path: str) -> str | None:
    """Plot each metric against the global step, one colour per stage boundary shaded."""
    series = {m: [(r["step"], r[m]) for r in rows if isinstance(r.get(m), (int, float))] for m in metrics}
    series = {m: pts for m, pts in series.items() if pts}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for name, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, markersize=3, label=name)
    stages: dict[str, list[int]] = {}
    for r in rows:
        if "stage" in r and "step" in r:
            stages.setdefault(str(r["stage"]), []).append(int(r["step"]))
    for i, (stage, steps) in enumerate(stages.items()):
        if i % 2 == 1:
            ax.axvspan(min(steps), max(steps), color="grey", alpha=0.08)
        ax.text(min(steps), 1.0, f" {stage}", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("value")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    with warnings.catch_warnings():  # tiny figures in tests cannot fit every label
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
