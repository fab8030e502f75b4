"""Registers the built-in renderers (lazy targets: tml-renderers and transformers are imported
only when a renderer is built)."""

from tempering.hookspecs import hookimpl

_R = "tempering.plugins.renderers"


@hookimpl
def register_renderers(register):
    register("tiny_chat", f"{_R}.tiny_chat:TinyChat",
             description="compact chat format of the tiny in-code models (tiny_llama(chat=True))")
