"""Registers the bundled recipes."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_recipes(register):
    register("arithmetic", "tempering.recipes:arithmetic", description="main CPU demo: SFT warmup then GRPO on addition")
    register("arithmetic_ci", "tempering.recipes:arithmetic_ci", description="CI-sized arithmetic SFT -> GRPO")
