"""``trackio``: metrics, the resolved config and rollout tables to trackio, a local-first
tracker (a SQLite file under ``TRACKIO_DIR``, default ``~/.cache/huggingface/trackio``; see
them with ``trackio show --project PROJECT``). Install with ``pip install 'tempering[trackio]'``.
"""

from __future__ import annotations

from typing import Any

from tempering.plugins.loggers.tracker import TrackerLogger, package_check


class TrackioLogger(TrackerLogger):
    """Keys: ``project`` (default ``tempering``), ``run_name`` (default: the recipe's name),
    ``group``, ``space_id`` (log to a Hugging Face Space instead of locally)."""

    check_config = staticmethod(package_check("trackio", "trackio", "trackio"))

    def __init__(
        self,
        output_dir: str,
        project: str = "tempering",
        run_name: str | None = None,
        group: str | None = None,
        space_id: str | None = None,
    ) -> None:
        super().__init__(output_dir)
        self.settings = {"project": project, "run_name": run_name, "group": group, "space_id": space_id}
        self.run: Any = None

    def start(self, config: dict[str, Any]) -> None:
        import trackio

        s = self.settings
        self.run = trackio.init(
            project=s["project"],
            name=self.display_name(s["run_name"]),
            group=s["group"],
            space_id=s["space_id"],
            config=config,
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, columns: list[str], rows: list[list[Any]], step: int) -> None:
        import trackio

        self.run.log({"rollouts": trackio.Table(columns=columns, data=rows)}, step=step)

    def finish(self) -> None:
        self.run.finish()
