"""Registers the built-in renderers (lazy targets: tml-renderers and transformers are imported
only when a renderer is built)."""

from tempering.hookspecs import hookimpl

_R = "tempering.plugins.renderers"

#: tml-renderers families: registered name -> description (the factory of the same name in tml.py).
TML_FAMILIES = {
    "qwen3": "Qwen3 with thinking",
    "qwen3_instruct": "Qwen3 instruct, no thinking block",
    "qwen3_disable_thinking": "Qwen3 hybrid with thinking off",
    "qwen3_5": "Qwen3.5",
    "qwen3_8": "Qwen3.8",
    "deepseek_v3": "DeepSeek V3 (no tools)",
    "deepseek_v3_1": "DeepSeek V3.1 (no tools)",
    "deepseek_r1": "DeepSeek R1 (no tools)",
    "deepseek_v4": "DeepSeek V4",
    "deepseek_v4_1": "DeepSeek V4.1",
    "kimi_k2": "Kimi K2 thinking",
    "kimi_k2_5": "Kimi K2.5",
    "glm_5": "GLM-5 (the GLM-5.2 format)",
    "glm_5_3": "GLM-5.3",
    "glm_5_3_flash": "GLM-5.3 Flash",
    "gpt_oss": "GPT-OSS (harmony)",
    "nemotron3": "Nemotron 3",
}


@hookimpl
def register_renderers(register):
    register(
        "tiny_chat",
        f"{_R}.tiny_chat:TinyChat",
        description="compact chat format of the tiny in-code models (tiny_llama(chat=True))",
    )
    register(
        "hf_chat",
        f"{_R}.hf_chat:HfChat",
        description="the tokenizer's own chat template; Hermes-style or response_template tool-call parsing",
    )
    register(
        "chatml",
        f"{_R}.chatml:ChatML",
        description="ChatML (SmolLM2, Qwen2.5, ...) with Hermes-style tool calls, token by token",
    )
    for name, what in TML_FAMILIES.items():
        register(name, f"{_R}.tml:{name}", description=f"{what} chat format (tml-renderers)")
