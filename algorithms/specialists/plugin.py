"""Registers the ``specialists`` stage."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_algorithms(register):
    register(
        "specialists",
        "tempering.algorithms.specialists.system:Specialists",
        description="one specialist per domain (parallel processes) vs one generalist, with a model router",
    )
