"""``mlflow``: metrics, the resolved config (as ``run.json`` and flat parameters) and rollout
tables to MLflow.

``tracking_uri`` defaults to ``MLFLOW_TRACKING_URI``, else a file store in the run folder,
``<output_dir>/mlruns`` (``mlflow ui --backend-store-uri <output_dir>/mlruns`` shows it).
MLflow 3 keeps the file store in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``; this
logger turns that on for a file store it is given (unless the variable is already set). Each
step's rollouts are a table artifact, ``rollouts/stepNNNNNN.json``. Install with
``pip install 'tempering[mlflow]'``.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from tempering.plugins.loggers.tracker import TrackerLogger, flatten, package_check

MAX_PARAM = 6000  # MLflow's limit on a parameter value's length
BATCH = 100  # parameters per log_batch call (MLflow's limit)


class MlflowLogger(TrackerLogger):
    """Keys: ``experiment`` (default ``tempering``), ``run_name`` (default: the recipe's name),
    ``tracking_uri`` (see the module docs)."""

    check_config = staticmethod(package_check("mlflow", "mlflow", "mlflow"))

    def __init__(
        self,
        output_dir: str,
        experiment: str = "tempering",
        run_name: str | None = None,
        tracking_uri: str | None = None,
    ) -> None:
        super().__init__(output_dir)
        self.experiment, self.name = experiment, run_name
        uri = (
            tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or os.path.abspath(os.path.join(output_dir, "mlruns"))
        )
        if "://" not in uri and not uri.startswith("file:"):
            uri = "file://" + os.path.abspath(uri)
        self.tracking_uri = uri
        self.client: Any = None
        self.run_id = ""

    def start(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        if self.tracking_uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=self.display_name(self.name)).info.run_id
        if config:
            self.client.log_dict(self.run_id, config, "run.json")
            params = [Param(_key(k), str(v)[:MAX_PARAM]) for k, v in flatten(config.get("recipe", {})).items()]
            for i in range(0, len(params), BATCH):
                self.client.log_batch(self.run_id, params=params[i : i + BATCH])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(_key(k), v, now, step) for k, v in metrics.items()])

    def log_table(self, columns: list[str], rows: list[list[Any]], step: int) -> None:
        data = {c: [row[i] for row in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"rollouts/step{step:06d}.json")

    def finish(self) -> None:
        self.client.set_terminated(self.run_id)


def _key(name: str) -> str:
    """MLflow names allow letters, digits and ``_-. :/``; anything else becomes ``_``."""
    return re.sub(r"[^\w\-. :/]", "_", name)
