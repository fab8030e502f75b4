"""Model builders for the local backend: callables returning ``(model, tokenizer)``.

:mod:`tempering.plugins.models.tiny` builds tiny Llama/Qwen2 models in code for tests and the
CPU demo; any Hugging Face path works too (the local backend loads it with ``from_pretrained``).
"""
