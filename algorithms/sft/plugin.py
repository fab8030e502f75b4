"""Registers SFT and its loss."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register("sft", "tempering.algorithms.sft.algorithm:SFT", description="supervised fine-tuning (warmup stage)")


@hookimpl
def register_losses(register):
    register(
        "cross_entropy",
        "tempering.algorithms.sft.loss:CrossEntropyLoss",
        description="-sum(w*logp), Tinker's cross_entropy",
    )
