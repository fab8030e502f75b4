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
        "smollm2_specialists",
        "tempering.recipes:smollm2_specialists",
        description="real-model CPU demo: SmolLM2 domain specialists in parallel vs one generalist, with a router",
    )
    register(
        "smollm2_forecast",
        "tempering.recipes:smollm2_forecast",
        description="real-model CPU demo: GRPO on brier; SmolLM2-135M learns the answer format, not calibration",
    )
    register(
        "sdpo_feedback",
        "tempering.recipes:sdpo_feedback",
        description="CPU demo: SDPO from exact_match's feedback where most rollouts fail (tiny Llama, addition)",
    )
    register(
        "smollm2_sdft",
        "tempering.recipes:smollm2_sdft",
        description="real-model CPU demo: SDFT teaches SmolLM2-135M-Instruct a tool-call format (vs smollm2_sft_skill)",
    )
    register(
        "smollm2_sft_skill",
        "tempering.recipes:smollm2_sft_skill",
        description="real-model CPU demo: the SFT arm of smollm2_sdft (same tool-call skill, same data and steps)",
    )
    register(
        "smollm2_monitor",
        "tempering.recipes:smollm2_monitor",
        description="real-model CPU demo: GRPO + a monitor predicting a planted cue's sway on SmolLM2 (monitor reward)",
    )
    register(
        "smollm2_code",
        "tempering.recipes:smollm2_code",
        description="real-model CPU demo: GRPO on sandboxed unit tests teaches SmolLM2-135M-Instruct Python functions",
    )
    register(
        "smollm2_search",
        "tempering.recipes:smollm2_search",
        description="real-model CPU demo: a search agent on SmolLM2-135M (SFT on tool-call traces, GRPO on recall)",
    )
    register(
        "smollm2_stale_sdpo",
        "tempering.recipes:smollm2_stale_sdpo",
        description="real-model CPU demo: stale SDPO (clipped IS, capped |A|) vs on-policy vs naive IS, slow checker",
    )
