"""Registers the bundled recipes."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_recipes(register):
    register("arithmetic", "tempering.recipes:arithmetic", description="main CPU demo: SFT warmup then GRPO on addition")
    register("tool_use", "tempering.recipes:tool_use",
             description="CPU demo: SFT on tool-use transcripts, then GRPO through the calculator environment")
