"""Built-in renderers: ``tiny_chat`` (tiny in-code models), ``hf_chat`` (a tokenizer's chat
template) and the production formats of ``tml-renderers``."""
