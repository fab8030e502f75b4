"""Registers the local (torch + transformers + peft) backend."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    register(
        "local",
        "tempering.plugins.backends.local.backend:LocalBackend",
        description="torch/transformers/peft on this machine",
    )
