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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


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


def reliability_diagram(cal: Calibration, path: str, title: str = "") -> str:
    """Observed frequency against mean forecast per bin (the diagonal is perfect calibration),
    with the forecasts' histogram underneath; written as a PNG at ``path``."""
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
    ax.set_title(title or f"Brier {cal.brier:.3f}, skill {skill}, ECE {cal.ece:.3f} (n={cal.n})", fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    width = cal.bins[0].high - cal.bins[0].low
    hist.bar([b.low for b in cal.bins], [b.count for b in cal.bins], width=width, align="edge", color="C0", alpha=0.6)
    hist.set_xlabel("forecast probability")
    hist.set_ylabel("forecasts")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
