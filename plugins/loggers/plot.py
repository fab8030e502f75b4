"""Reward curve PNG written when the run ends (and re-read from metrics.jsonl, so a resumed
run plots its whole history, not only the part since the restart)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
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
        self.metrics = metrics or ["reward/mean", "eval/accuracy"]
        self.source = os.path.join(output_dir, source)
        self._rows: list[dict[str, Any]] = []

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self._rows.append(dict(metrics))

    def close(self) -> None:
        rows = read_jsonl(self.source) if os.path.exists(self.source) else self._rows
        plot_metrics(rows, self.metrics, self.path)


def plot_metrics(
    rows: Sequence[Mapping[str, Any]], metrics: list[str], path: str, secondary: str = "loss"
) -> str | None:
    """One panel per stage (stages differ in length by 10x or more: a shared axis would
    squeeze the RL stage into a sliver). Each panel plots ``metrics`` against the global step;
    a stage that logs none of them (an SFT warmup) shows ``secondary`` on a second axis."""
    stages: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if "step" in r:
            stages.setdefault(str(r.get("stage", "")), []).append(r)
    if not stages:
        return None

    def series(stage_rows: list[Mapping[str, Any]], name: str) -> list[tuple[float, float]]:
        return [(r["step"], r[name]) for r in stage_rows if isinstance(r.get(name), (int, float))]

    if not any(series(rs, m) for rs in stages.values() for m in [*metrics, secondary]):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(stages), figsize=(4.2 * len(stages) + 1, 4), dpi=100, squeeze=False, sharey=True)
    colours = {m: f"C{i}" for i, m in enumerate(metrics)}
    for ax, (stage, stage_rows) in zip(axes[0], stages.items()):
        drawn = False
        for name in metrics:
            pts = series(stage_rows, name)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=colours[name], marker="o" if len(pts) < 60 else None, markersize=3, label=name)
                drawn = True
        if not any(series(stage_rows, m) for m in metrics if not m.startswith("eval/")) and series(
            stage_rows, secondary
        ):
            twin = ax.twinx()
            xs, ys = zip(*series(stage_rows, secondary))
            twin.plot(xs, ys, color="grey", alpha=0.6, linewidth=0.8, label=secondary)
            twin.set_ylabel(secondary, color="grey")
            twin.legend(loc="upper right", fontsize=8)
        ax.set_title(stage or "run", fontsize=10)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="lower right", fontsize=8)
    axes[0][0].set_ylabel("reward / accuracy")
    with warnings.catch_warnings():  # tiny figures in tests cannot fit every label
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
