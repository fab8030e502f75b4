"""Tiny causal LMs built in code, so tests and the CPU demo need no downloads.

A character-level tokenizer (``<pad>``, ``<bos>``, ``<eos>`` plus one token per character) and a
few-hundred-thousand-parameter Llama or Qwen2 are enough to learn 2-digit addition on a laptop
CPU in about a minute. torch and transformers are imported inside the functions, so importing
this module (e.g. while listing plugins) stays fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tempering.interfaces import LoadedModel, Tokenizer

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
SPECIAL_TOKENS = (PAD, BOS, EOS)
DEFAULT_CHARS = "0123456789+= "
#: The role and tool-call markers of the ``tiny_chat`` renderer, one token each.
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|call|>")
#: Characters of a chat-capable tiny model: enough for short questions, tool calls and answers.
CHAT_CHARS = "0123456789abcdefghijklmnopqrstuvwxyz +-*/=()[]{}<>?!.,:;_'\"\n"


def build_char_tokenizer(chars: str = DEFAULT_CHARS, extra_special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A tokenizer with one token per character of ``chars`` and ids 0, 1, 2 for pad/bos/eos.

    Encoding prepends ``<bos>`` (with ``add_special_tokens=True``, the default) so every prompt
    has at least one token to condition on; decoding joins characters without separators.
    There is no unknown token on purpose: a character outside ``chars`` is an error rather than
    a silent ``<unk>`` that the model can never learn to read. ``extra_special`` adds special
    tokens after the characters (the ``tiny_chat`` markers, :data:`CHAT_TOKENS`).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    unique = list(dict.fromkeys(chars))  # keep order, drop repeats
    clash = [c for c in unique if c in SPECIAL_TOKENS]
    if clash or not unique:
        raise ValueError(f"build_char_tokenizer: chars must be non-empty single characters, got {chars!r}")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *unique, *extra_special])}

    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # One pre-token per character (any character, newlines included), each looked up whole.
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    core.add_special_tokens([*SPECIAL_TOKENS, *extra_special])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    return tokenizer


def _tokenizer(chars: str, chat: bool) -> PreTrainedTokenizerFast:
    if not chat:
        return build_char_tokenizer(chars)
    return build_char_tokenizer(CHAT_CHARS if chars == DEFAULT_CHARS else chars, extra_special=CHAT_TOKENS)


def _set_special_ids(config: Any, tokenizer: Tokenizer) -> None:  # a Hugging Face tokenizer or a TmlTokenizer
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id


def _finish(model: PreTrainedModel, tokenizer: Tokenizer, renderer: str | None = None) -> LoadedModel:
    """Put the special ids on the generation config too: ``generate`` reads them from there.
    ``renderer``: the chat format the model declares (``renderer: auto`` picks it)."""
    gen = model.generation_config
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = tokenizer.bos_token_id
    gen.eos_token_id = tokenizer.eos_token_id
    model.eval()
    return LoadedModel(model, tokenizer, renderer)


def _build(model_cls: Any, config: Any, seed: int) -> Any:
    """Initialise ``model_cls(config)`` from ``seed`` without touching the global RNG state."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_cls(config)


def check_shape(**sizes: int) -> None:
    """Every size must be a positive whole number and ``hidden_size`` a multiple of
    ``num_heads``: a one-line error at ``backend.model_kwargs.<key>`` (where the recipe sets
    them) instead of torch's traceback from deep inside the model's constructor."""
    from tempering.errors import ConfigError

    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"must be a whole number >= 1, got {value!r}", f"backend.model_kwargs.{key}")
    if sizes["hidden_size"] % sizes["num_heads"]:
        raise ConfigError(
            f"must be a multiple of num_heads ({sizes['num_heads']}), got {sizes['hidden_size']}",
            "backend.model_kwargs.hidden_size",
        )


def _tiny(
    config_cls: Any,
    model_cls: Any,
    chars: str,
    chat: bool,
    seed: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
) -> LoadedModel:
    """The one tiny shape both architectures share: full attention heads, untied embeddings."""
    check_shape(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    tokenizer = _tokenizer(chars, chat)
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
    )
    _set_special_ids(config, tokenizer)
    return _finish(_build(model_cls, config, seed), tokenizer, "tiny_chat" if chat else None)


def tiny_llama(
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    chars: str = DEFAULT_CHARS,
    max_position_embeddings: int = 64,
    seed: int = 0,
    chat: bool = False,
) -> LoadedModel:
    """A randomly initialised ``LlamaForCausalLM`` (about 660k parameters by default) and its
    character tokenizer. The same ``seed`` gives bit-identical weights, which the local backend
    relies on for data-parallel ranks and for rebuilding the frozen reference model.

    ``chat=True`` gives a chat-capable tokenizer: the :data:`CHAT_TOKENS` markers of the
    ``tiny_chat`` renderer, and :data:`CHAT_CHARS` unless ``chars`` is given."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _tiny(
        LlamaConfig,
        LlamaForCausalLM,
        chars,
        chat,
        seed,
        hidden_size,
        num_layers,
        num_heads,
        intermediate_size,
        max_position_embeddings,
    )


def tiny_qwen(
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 256,
    chars: str = DEFAULT_CHARS,
    max_position_embeddings: int = 64,
    seed: int = 0,
    chat: bool = False,
) -> LoadedModel:
    """Like :func:`tiny_llama` but a ``Qwen2ForCausalLM`` (q/k/v biases), to check that nothing
    in the stack is Llama-specific."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _tiny(
        Qwen2Config,
        Qwen2ForCausalLM,
        chars,
        chat,
        seed,
        hidden_size,
        num_layers,
        num_heads,
        intermediate_size,
        max_position_embeddings,
    )
