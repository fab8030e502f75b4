"""Registers the distill stage."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register(
        "distill",
        "tempering.algorithms.distill.algorithm:Distill",
        description="on-policy distillation: a teacher model scores the student's samples (reverse KL)",
    )
