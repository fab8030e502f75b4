"""Registers the built-in samplers."""

from tempering.hookspecs import hookimpl

_S = "tempering.plugins.samplers"


@hookimpl
def register_samplers(register):
    register("completion", f"{_S}.completion:CompletionSampler",
             description="one completion per sample, scored by the stage's reward (the default)")
    register("environment", f"{_S}.environment:EnvironmentSampler",
             description="multi-turn episodes of a registered environment: tools, limits, token-exact rows")
