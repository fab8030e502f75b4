"""Registers the bundled recipes."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_recipes(register):
    register(
        "arithmetic", "tempering.recipes:arithmetic", description="main CPU demo: SFT warmup then GRPO on addition"
    )
    register(
        "tool_use",
        "tempering.recipes:tool_use",
        description="CPU demo: SFT on tool-use transcripts, then GRPO through the calculator environment",
    )
    register(
        "agentic_search_dpo",
        "tempering.recipes:agentic_search_dpo",
        description="CPU demo: DPO on preferred vs rejected tool calls, then GRPO through the search environment",
    )
    register(
        "agentic_search_sft",
        "tempering.recipes:agentic_search_sft",
        description="CPU demo: SFT on search trajectories that prune their context, then GRPO on recall and tokens",
    )
    register(
        "smollm2_math",
        "tempering.recipes:smollm2_math",
        description="real-model CPU demo: GRPO with LoRA teaches SmolLM2-135M-Instruct arithmetic in words",
    )
    register(
        "smollm2_forecast",
        "tempering.recipes:smollm2_forecast",
        description="real-model CPU demo: GRPO on the brier reward teaches SmolLM2-135M-Instruct calibrated forecasts",
    )
    register(
        "sdpo_feedback",
        "tempering.recipes:sdpo_feedback",
        description="CPU demo: SDPO from exact_match's feedback where most rollouts fail (tiny Llama, addition)",
    )
