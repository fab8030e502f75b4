"""Training backends: ``local`` (transformers in this process) and ``tinker`` (the Tinker API)."""
