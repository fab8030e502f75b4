"""Registers the built-in samplers (and the ``verifiers`` dataset, which only the ``verifiers``
sampler plays)."""

from tempering.hookspecs import hookimpl

_S = "tempering.plugins.samplers"


@hookimpl
def register_samplers(register):
    register(
        "completion",
        f"{_S}.completion:CompletionSampler",
        description="one completion per sample, scored by the stage's reward (the default)",
    )
    register(
        "environment",
        f"{_S}.environment:EnvironmentSampler",
        description="multi-turn episodes of a registered environment: tools, limits, token-exact rows",
    )
    register(
        "agent",
        f"{_S}.agent:AgentSampler",
        description="episodes of your own harness (openai SDK) through the policy's OpenAI-compatible endpoint",
    )
    register(
        "verifiers",
        f"{_S}.verifiers_env:VerifiersSampler",
        description="episodes of an installed verifiers 0.4 environment through the policy's endpoint",
    )


@hookimpl
def register_datasets(register):
    register(
        "verifiers",
        f"{_S}.verifiers_env:verifiers_tasks",
        description="the tasks of an installed verifiers environment (for the verifiers sampler)",
    )
