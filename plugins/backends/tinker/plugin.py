"""Registers the Tinker backend. Lazy target: listing plugins never imports the Tinker SDK."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_backends(register):
    register(
        "tinker",
        "tempering.plugins.backends.tinker.backend:TinkerBackend",
        description='Tinker training API (LoRA) via the official SDK; pip install "tempering[tinker]"',
    )
