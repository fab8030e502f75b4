"""Interop: tempering's components used from other trainers (TRL's ``GRPOTrainer``: :mod:`.trl`)."""
