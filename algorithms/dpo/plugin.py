"""Registers DPO, its loss and the synthetic preference dataset."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register("dpo", "tempering.algorithms.dpo.algorithm:DPO", description="direct preference optimisation on (prompt, chosen, rejected)")


@hookimpl
def register_losses(register):
    register("dpo", "tempering.algorithms.dpo.loss:DPOLoss", description="DPO sigmoid / IPO / robust / sigmoid+SFT (RPO) on interleaved pairs")


@hookimpl
def register_datasets(register):
    register(
        "synthetic_preferences",
        "tempering.algorithms.dpo.synthetic:synthetic_preferences",
        description="addition prompts, chosen = right sum, rejected = near miss or malformed",
    )
