"""How good are stated probabilities: Brier score, Brier skill, expected calibration error and
a reliability diagram.

A forecaster that says "70%" should be right 70% of the time it says so. Accuracy cannot see
that; these can. Given forecasts ``p`` in [0, 1] and outcomes ``y`` in {0, 1} (or soft labels):

* **Brier** = mean (p - y)^2 -- lower is better, 0 is perfect, 0.25 is always saying 50%;
* **Brier skill** = 1 - Brier / Brier_ref, the reference forecasting the evaluation set's base
  rate for every example (climatology): 1 is perfect, 0 is no better than the base rate,
  negative is worse. Undefined (None) when every outcome is the same;
* **ECE** (expected calibration error) = sum over ``bins`` equal-width bins of
  (share of forecasts in the bin) * |mean forecast - observed frequency| -- how far the
  reliability diagram is from its diagonal, weighted by where forecasts fall.

The forecasts come from scored samples (:func:`forecasts_of`: a ``brier``/``brier_skill``
reward reports ``p`` and ``y`` in its parts). Both ``tempering eval`` and a stage's held-out
evaluation report them; the stage also draws a reliability diagram per evaluation into the
run folder (:func:`reliability_path`), which ``tempering view`` shows. Here, below rollouts and
training, so that both can.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tempering.registry import Registry, get_registry

if TYPE_CHECKING:  # pragma: no cover
    from tempering.types import Group

#: The run folder's subfolder of a stage's reliability diagrams, one PNG per evaluation.
RELIABILITY_DIR = "reliability"


@dataclass
class ReliabilityBin:
    """Forecasts in [low, high): how many, their mean, and how often the outcome happened."""

    low: float
    high: float
    count: int
    mean_forecast: float | None
    frequency: float | None


@dataclass
class Calibration:
    n: int
    brier: float
    brier_ref: float
    brier_skill: float | None
    ece: float
    base_rate: float
    bins: list[ReliabilityBin] = field(default_factory=list)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        out = {
            f"{prefix}brier": self.brier,
            f"{prefix}ece": self.ece,
            f"{prefix}base_rate": self.base_rate,
            f"{prefix}forecasts": float(self.n),
        }
        if self.brier_skill is not None:
            out[f"{prefix}brier_skill"] = self.brier_skill
        return out


def calibration(forecasts: Sequence[float], outcomes: Sequence[float], bins: int = 10) -> Calibration:
    """Brier, Brier skill against the base rate, ECE and the reliability bins (``bins`` of equal
    width; a forecast of exactly 1 falls in the last)."""
    if len(forecasts) != len(outcomes):
        raise ValueError(f"calibration: {len(forecasts)} forecasts but {len(outcomes)} outcomes")
    if not forecasts:
        raise ValueError("calibration: no forecasts")
    if bins < 1:
        raise ValueError(f"calibration: bins must be >= 1, got {bins}")
    for p in (*forecasts, *outcomes):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"calibration: probabilities and outcomes must be in [0, 1], got {p}")
    n = len(forecasts)
    base = sum(outcomes) / n
    brier = sum((p - y) ** 2 for p, y in zip(forecasts, outcomes)) / n
    ref = sum((base - y) ** 2 for y in outcomes) / n
    groups: list[list[tuple[float, float]]] = [[] for _ in range(bins)]
    for p, y in zip(forecasts, outcomes):
        groups[min(int(p * bins), bins - 1)].append((p, y))
    table, ece = [], 0.0
    for i, members in enumerate(groups):
        if members:
            mean_p = sum(p for p, _ in members) / len(members)
            freq = sum(y for _, y in members) / len(members)
            ece += len(members) / n * abs(mean_p - freq)
            table.append(ReliabilityBin(i / bins, (i + 1) / bins, len(members), mean_p, freq))
        else:
            table.append(ReliabilityBin(i / bins, (i + 1) / bins, 0, None, None))
    skill = None if ref == 0 else 1.0 - brier / ref
    return Calibration(n, brier, ref, skill, ece, base, table)


def reliability_path(output_dir: str, stage_id: str, step: int) -> str:
    """Where a stage's evaluation at global ``step`` draws its reliability diagram."""
    return os.path.join(output_dir, RELIABILITY_DIR, f"{stage_id}-step{int(step):06d}.png")


def reliability_diagram(cal: Calibration, path: str, title: str = "") -> str:
    """Observed frequency against mean forecast per bin (the diagonal is perfect calibration),
    with the forecasts' histogram underneath; written as a PNG at ``path`` (its folder made).
    The title gives Brier, skill, ECE and n, under ``title`` when one is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, hist) = plt.subplots(
        2, 1, figsize=(4.6, 5.4), dpi=100, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    ax.plot([0, 1], [0, 1], color="grey", linestyle="--", linewidth=1, label="perfectly calibrated")
    full = [b for b in cal.bins if b.count]
    ax.plot([b.mean_forecast for b in full], [b.frequency for b in full], marker="o", color="C0", label="forecasts")
    ax.set_ylabel("observed frequency")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    skill = "n/a" if cal.brier_skill is None else f"{cal.brier_skill:.3f}"
    numbers = f"Brier {cal.brier:.3f}, skill {skill}, ECE {cal.ece:.3f} (n={cal.n})"
    ax.set_title(f"{title}\n{numbers}" if title else numbers, fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    width = cal.bins[0].high - cal.bins[0].low
    hist.bar([b.low for b in cal.bins], [b.count for b in cal.bins], width=width, align="edge", color="C0", alpha=0.6)
    hist.set_xlabel("forecast probability")
    hist.set_ylabel("forecasts")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def forecasts_of(
    groups: Sequence[Group], outcome_key: str | None = None, registry: Registry | None = None
) -> list[tuple[float, float]]:
    """(forecast, outcome) pairs: from the reward's parts (``p``, ``y``: the ``brier`` rewards),
    else -- with ``outcome_key`` -- the probability read from the completion and the example's
    outcome column, as the built-in ``brier`` reward reads them (built through ``registry``, the
    process-wide one by default). Samples with neither (failed, unreadable) are left out."""
    reader = None
    if outcome_key is not None:
        reader = (registry or get_registry()).build(
            "reward", {"name": "tempering:brier", "outcome_key": outcome_key}, "outcome_key"
        )
    pairs = []
    for g in groups:
        for s in g.samples:
            given = _forecast(s.reward_info or {})
            if not s.failed and given is not None:
                pairs.append(given)
            elif reader is not None and outcome_key in s.example:
                try:  # an unreadable probability or outcome is a ValueError (ForecastParseError is one)
                    read = _forecast(reader(s.completion.text, s.example).info)
                except ValueError:
                    continue
                if read is not None:
                    pairs.append(read)
    return pairs


def _forecast(info: Mapping[str, Any]) -> tuple[float, float] | None:
    """The ``(p, y)`` a forecast reward reports in its info, if it reports both."""
    p, y = info.get("p"), info.get("y")
    return (float(p), float(y)) if isinstance(p, (int, float)) and isinstance(y, (int, float)) else None
