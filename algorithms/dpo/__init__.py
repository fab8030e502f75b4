"""Direct preference optimisation: a warmup stage on (prompt, chosen, rejected) pairs."""
