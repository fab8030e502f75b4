"""Registers this package's components with tempering.

tempering imports this module (the entry point in pyproject.toml) whenever it loads plugins,
even for ``tempering plugins`` or ``--help``: keep it free of heavy imports. Register each
component as a lazy ``"module:attr"`` string; tempering imports it only when a recipe uses it.
"""

from tempering import hookimpl


@hookimpl
def register_rewards(register):
    register(
        "length_penalty",
        "tempering_plugin_template.rewards:LengthPenalty",
        description="1 up to max_chars characters, minus penalty per extra character",
    )


@hookimpl
def register_advantages(register):
    register(
        "rank",
        "tempering_plugin_template.advantages:RankAdvantage",
        description="centred rank of each reward within its group (ties share a rank)",
    )


@hookimpl
def register_environments(register):
    register(
        "unit_converter",
        "tempering_plugin_template.environments:UnitConverter",
        description="convert lengths between units with a convert tool; 1 for the right number",
    )


@hookimpl
def register_datasets(register):
    register(
        "unit_questions",
        "tempering_plugin_template.datasets:unit_questions",
        description="length conversions as environment tasks, SFT tool-call transcripts or DPO pairs",
    )
