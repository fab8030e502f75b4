"""Registers the built-in environments."""

from tempering.hookspecs import hookimpl

_E = "tempering.plugins.environments"


@hookimpl
def register_environments(register):
    register("calculator", f"{_E}.calculator:Calculator",
             description="products of two numbers via a mul tool, over two turns (the tool_use demo)")
