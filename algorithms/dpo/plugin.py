"""Registers DPO and its loss (its toy dataset, ``synthetic_preferences``, is a built-in dataset)."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register(
        "dpo",
        "tempering.algorithms.dpo.algorithm:DPO",
        description="direct preference optimisation on (prompt, chosen, rejected)",
    )


@hookimpl
def register_losses(register):
    register(
        "dpo",
        "tempering.algorithms.dpo.loss:DPOLoss",
        description="DPO sigmoid / IPO / robust / sigmoid+SFT (RPO) on interleaved pairs",
    )
