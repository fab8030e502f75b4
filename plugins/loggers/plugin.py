"""Registers the built-in loggers. The tracker loggers need their package (an extra:
``pip install 'tempering[wandb]'``); registering them imports nothing."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_loggers(register):
    register("jsonl", "tempering.plugins.loggers.jsonl:JsonlLogger", description="metrics.jsonl, one line per step")
    register("plot", "tempering.plugins.loggers.plot:PlotLogger", description="reward-curve PNG at the end of the run")
    register(
        "wandb",
        "tempering.plugins.loggers.wandb_logger:WandbLogger",
        description="Weights & Biases: metrics, config, rollout table (extra: wandb)",
    )
    register(
        "trackio",
        "tempering.plugins.loggers.trackio_logger:TrackioLogger",
        description="trackio, local-first: metrics, config, rollout tables (extra: trackio)",
    )
    register(
        "mlflow",
        "tempering.plugins.loggers.mlflow_logger:MlflowLogger",
        description=(
            "MLflow (a file store in the run folder by default): metrics, config, rollout tables (extra: mlflow)"
        ),
    )
