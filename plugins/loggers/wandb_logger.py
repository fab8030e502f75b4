"""``wandb``: metrics, the resolved config and rollout tables to Weights & Biases.

``mode: offline`` writes the run under ``<output_dir>/wandb/`` with no network (``wandb sync``
uploads it later); by default wandb decides (``WANDB_MODE``, else online when logged in).
Rollouts go to one incremental table, ``rollouts``, that grows by each step's records.
Install with ``pip install 'tempering[wandb]'``.
"""

from __future__ import annotations

from typing import Any

from tempering.plugins.loggers.tracker import TrackerLogger, package_check


class WandbLogger(TrackerLogger):
    """Keys: ``project`` (default ``tempering``), ``run_name`` (default: the recipe's name),
    ``entity``, ``group``, ``tags``, ``mode`` (``online``/``offline``/``disabled``; null = wandb's
    default)."""

    check_config = staticmethod(package_check("wandb", "wandb", "wandb"))

    def __init__(
        self,
        output_dir: str,
        project: str = "tempering",
        run_name: str | None = None,
        entity: str | None = None,
        group: str | None = None,
        tags: list | None = None,
        mode: str | None = None,
    ) -> None:
        super().__init__(output_dir)
        self.settings: dict[str, Any] = {
            "project": project,
            "run_name": run_name,
            "entity": entity,
            "group": group,
            "tags": tags,
            "mode": mode,
        }
        self.run: Any = None
        self.table: Any = None

    def start(self, config: dict[str, Any]) -> None:
        import wandb

        s = self.settings
        self.run = wandb.init(
            project=s["project"],
            name=self.display_name(s["run_name"]),
            entity=s["entity"],
            group=s["group"],
            tags=s["tags"],
            mode=s["mode"],
            dir=self.output_dir,
            config=config,
        )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, columns: list[str], rows: list[list[Any]], step: int) -> None:
        import wandb

        if self.table is None:
            self.table = wandb.Table(columns=columns, log_mode="INCREMENTAL")
        for row in rows:
            self.table.add_data(*row)
        self.run.log({"rollouts": self.table}, step=step)

    def finish(self) -> None:
        self.run.finish()
