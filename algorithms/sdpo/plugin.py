"""Registers SDPO."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register(
        "sdpo",
        "tempering.algorithms.sdpo.algorithm:SDPO",
        description="GRPO + self-distillation from the model re-prompted with a successful sibling or feedback",
    )
