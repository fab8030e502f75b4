"""Supervised fine-tuning: the warmup stage of staged recipes."""
