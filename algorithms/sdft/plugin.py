"""Registers SDFT, its losses and the two-skill toy datasets."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register(
        "sdft",
        "tempering.algorithms.sdft.algorithm:SDFT",
        description="self-distillation from a demonstration-conditioned teacher",
    )


@hookimpl
def register_losses(register):
    register(
        "sdft",
        "tempering.algorithms.sdft.loss:SDFTLoss",
        description="SDFT: top-k / full-logit divergence or sampled-token IS",
    )
    register(
        "importance_sampling",
        "tempering.algorithms.sdft.loss:ImportanceSamplingLoss",
        description="-sum(exp(lp - q) * A), Tinker's importance_sampling",
    )


@hookimpl
def register_datasets(register):
    register(
        "toy_skills",
        "tempering.algorithms.sdft.toy:toy_skills",
        description="reverse / shift / in-context hint strings",
    )
    register(
        "toy_mixture", "tempering.algorithms.sdft.toy:toy_mixture", description="several toy_skills shuffled together"
    )
