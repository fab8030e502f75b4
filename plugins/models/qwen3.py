"""``tiny_qwen3``: a tiny, randomly initialised Qwen3 with the *real* Qwen3 tokenizer, offline.

The character-level tiny models exercise the training stack; this one exercises a production
chat format end to end -- the real vocabulary (151,669 ids), the real special tokens, the real
``tml-renderers`` Qwen3 renderer -- while staying small enough for CPU tests: the transformer
is a few layers of width 64, so almost all of its ~10M parameters are the (tied) embedding.

The tokenizer is ``tml-renderers``' bundled ``Qwen3Tokenizer`` (no download) behind
:class:`TmlTokenizer`, the part of the Hugging Face tokenizer interface tempering uses.
The builder declares the renderer ``renderer: auto`` picks, ``qwen3_instruct``: the instruct format
(no thinking block) suits a base whose turns are tool calls and answers.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from tempering.interfaces import LoadedModel
from tempering.plugins.models.tiny import _build, _finish, _set_special_ids

#: The file :meth:`TmlTokenizer.save_pretrained` writes.
TOKENIZER_FILE = "tml_tokenizer.json"


class TmlTokenizer:
    """A ``tml_renderers.tokenizers`` tokenizer with the Hugging Face calls tempering makes:
    ``tokenizer(text, add_special_tokens=...)["input_ids"]``, ``encode``, ``decode`` /
    ``batch_decode`` (``skip_special_tokens``), ``convert_tokens_to_ids``, the special ids,
    ``len()`` and ``save_pretrained``.

    Special tokens written in text (``"<|im_end|>"``) encode to their ids, as Hugging Face
    tokenizers do; everything else goes through the family's byte-level BPE. The format has
    no BOS, so ``add_special_tokens`` adds nothing. ``convert_tokens_to_ids`` maps special
    tokens and any text that is one token (not Hugging Face's byte-level ``Ġ`` spellings).
    """

    chat_template = None
    unk_token_id = None

    def __init__(self, lib_tokenizer: Any, eos_token: str, pad_token: str, renderer: str | None = None) -> None:
        self.lib = lib_tokenizer
        self.special_ids = {name: int(lib_tokenizer.encode_special(name)) for name in lib_tokenizer.all_special_tokens}
        self._special_set = set(self.special_ids.values())
        self._split = re.compile(
            "(" + "|".join(re.escape(t) for t in sorted(self.special_ids, key=len, reverse=True)) + ")"
        )
        self.eos_token, self.pad_token, self.bos_token = eos_token, pad_token, None
        self.eos_token_id, self.pad_token_id, self.bos_token_id = (
            self.special_ids[eos_token],
            self.special_ids[pad_token],
            None,
        )
        self.all_special_tokens = list(self.special_ids)
        self.all_special_ids = list(self.special_ids.values())
        self.name_or_path = type(lib_tokenizer).__name__
        #: the chat format recorded with the tokenizer's files (save_pretrained / from_pretrained)
        self.renderer = renderer or None

    def __len__(self) -> int:
        """Ordinary ids come first and the special ones after them, so the last special id
        bounds the vocabulary (151,669 for Qwen3)."""
        return max(self._special_set) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out: list[int] = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:  # the separators the split captured: special tokens
                out.append(self.special_ids[part])
            elif part:
                out += self.lib.encode_ordinary(part)
        return out

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True, **_: object) -> dict[str, Any]:
        if isinstance(text, str):
            ids: Any = self.encode(text)
            mask: Any = [1] * len(ids)
        else:
            ids = [self.encode(t) for t in text]
            mask = [[1] * len(i) for i in ids]
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids: Any, skip_special_tokens: bool = False, **_: object) -> str:
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        ids = [int(ids)] if isinstance(ids, int) else [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_set]
        return self.lib.decode(ids)  # lossy on partial UTF-8 (U+FFFD), like Hugging Face

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False, **kw: object) -> list[str]:
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        if not isinstance(tokens, str):
            return [self.convert_tokens_to_ids(t) for t in tokens]
        if tokens in self.special_ids:
            return self.special_ids[tokens]
        ids = self.lib.encode_ordinary(tokens)
        return int(ids[0]) if len(ids) == 1 else None

    def save_pretrained(self, path: str, **_: object) -> tuple[str]:
        """Write which bundled tokenizer this is (``tml_tokenizer.json``); :meth:`from_pretrained`
        reads it back. Not a Hugging Face tokenizer folder: outside tempering, use the real
        ``Qwen/Qwen3-*`` tokenizer, whose ids these are."""
        os.makedirs(path, exist_ok=True)
        file = os.path.join(path, TOKENIZER_FILE)
        spec = {
            "class": type(self.lib).__name__,
            "package": "tml-renderers",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "renderer": self.renderer,
        }
        with open(file, "w") as f:
            json.dump(spec, f, indent=2)
        return (file,)

    @classmethod
    def from_pretrained(cls, path: str) -> TmlTokenizer:
        from tml_renderers import tokenizers

        with open(os.path.join(path, TOKENIZER_FILE)) as f:
            spec = json.load(f)
        return cls(getattr(tokenizers, spec["class"])(), spec["eos_token"], spec["pad_token"], spec.get("renderer"))


def qwen3_tokenizer(renderer: str = "qwen3_instruct") -> TmlTokenizer:
    """The real Qwen3 tokenizer (tml-renderers' bundled copy): EOS ``<|im_end|>``, pad
    ``<|endoftext|>``, as the Qwen3 instruct checkpoints set them."""
    from tml_renderers import tokenizers

    return TmlTokenizer(
        tokenizers.Qwen3Tokenizer(), eos_token="<|im_end|>", pad_token="<|endoftext|>", renderer=renderer
    )


def tiny_qwen3(
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    renderer: str = "qwen3_instruct",
) -> LoadedModel:
    """A randomly initialised ``Qwen3ForCausalLM`` (tied embeddings, ~9.8M parameters by
    default, 9.7M of them the embedding) and the real Qwen3 tokenizer. The same ``seed`` gives
    identical weights. ``renderer`` is what ``renderer: auto`` picks for it."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = qwen3_tokenizer(renderer)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
    )
    _set_special_ids(config, tokenizer)
    return _finish(_build(Qwen3ForCausalLM, config, seed), tokenizer, renderer)
