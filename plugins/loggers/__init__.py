"""Built-in metric loggers: JSONL lines and a reward-curve PNG."""
