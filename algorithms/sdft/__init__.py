"""Self-distillation fine-tuning (SDFT, Shenfeld, Damani, Hübotter et al. 2026, arXiv 2601.19897)."""
