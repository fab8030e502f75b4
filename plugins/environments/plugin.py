"""Registers the built-in environments."""

from tempering.hookspecs import hookimpl

_E = "tempering.plugins.environments"


@hookimpl
def register_environments(register):
    pass
