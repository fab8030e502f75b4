"""Registers the built-in datasets."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_datasets(register):
    register(
        "arithmetic",
        "tempering.plugins.datasets.arithmetic:arithmetic",
        description="synthetic a+b=c, train/test split",
    )
    register("jsonl", "tempering.plugins.datasets.files:jsonl", description="rows of a local JSON-lines file")
    register("hf", "tempering.plugins.datasets.files:hf", description="datasets.load_dataset (hub name or local files)")
    register(
        "tool_use",
        "tempering.plugins.datasets.tool_use:tool_use",
        description="products a*b for the calculator environment, or SFT tool-use transcripts",
    )
    register(
        "agentic_search",
        "tempering.plugins.datasets.search_traces:agentic_search",
        description="multi-hop questions over a generated corpus: tasks, SFT trajectories or DPO pairs",
    )
    register(
        "math_questions",
        "tempering.plugins.datasets.math_questions:math_questions",
        description="arithmetic questions in natural language (chat messages) for instruct models",
    )
    register(
        "unit_conversions",
        "tempering.plugins.datasets.domain_questions:unit_conversions",
        description="unit conversions in words (grams in 7 kilograms) for instruct models; integer answers",
    )
    register(
        "capital_questions",
        "tempering.plugins.datasets.domain_questions:capital_questions",
        description="capital cities asked in words for instruct models; test holds out countries",
    )
    register(
        "forecast_questions",
        "tempering.plugins.datasets.forecast_questions:forecast_questions",
        description="forecasts from a stated history (it rained on 7 of 10 days), outcomes drawn at that rate",
    )
    register(
        "synthetic_preferences",
        "tempering.plugins.datasets.synthetic_preferences:synthetic_preferences",
        description="addition prompts, chosen = right sum, rejected = near miss or malformed",
    )
    register(
        "math_preferences",
        "tempering.plugins.datasets.math_preferences:math_preferences",
        description="DPO pairs on math_questions: the bare right number over a wrong or verbose answer",
    )
    register(
        "tool_calls",
        "tempering.plugins.datasets.tool_calls:tool_calls",
        description='requests answered by one tool call, weather(city="Oslo"): a new skill for SDFT vs SFT',
    )
    register(
        "next_number",
        "tempering.plugins.datasets.tool_calls:next_number",
        description="the number right after n, for math_answer: a prior skill to measure forgetting on",
    )
    register(
        "cue_questions",
        "tempering.plugins.datasets.cue_questions:cue_questions",
        description='multiple-choice sums behind a planted cue ("A Stanford professor thinks..."): monitor reward',
    )
    register(
        "code_functions",
        "tempering.plugins.datasets.code_functions:code_functions",
        description="80 small Python functions to write (strings, lists, arithmetic), 4 asserts each, for sandbox",
    )
