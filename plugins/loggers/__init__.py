"""Built-in loggers: JSONL lines, a reward-curve PNG, and the experiment trackers (wandb,
trackio, mlflow; each an optional extra)."""
