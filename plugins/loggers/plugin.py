"""Registers the built-in loggers."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_loggers(register):
    register("jsonl", "tempering.plugins.loggers.jsonl:JsonlLogger", description="metrics.jsonl, one line per step")
    register("plot", "tempering.plugins.loggers.plot:PlotLogger", description="reward-curve PNG at the end of the run")
