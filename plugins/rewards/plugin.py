"""Registers the built-in rewards."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_rewards(register):
    register("exact_match", "tempering.plugins.rewards.basic:ExactMatch", description="1 if the answer matches exactly")
