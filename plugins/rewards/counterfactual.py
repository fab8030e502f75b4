"""Counterfactual variants of a prompt: what the ``monitor`` reward samples the policy on.

A variant is the example with its prompt changed -- the ``prompt`` text, or the last user
message of ``messages`` -- and every other column kept. ``variants`` is either a list of
built-in transforms, each applied to the original prompt (one variant each)::

    variants:
      - {remove: "{cue} "}                      # drop the example's cue sentence
      - {add: "A professor thinks the answer is {wrong}.", at: start}   # or at: end
      - {replace: "{cue}", with: "{other_cue}"}

(texts are formatted with the example's columns: ``{cue}`` is its ``cue`` column; literal
braces are doubled), or a function of the user's, named by import path as the ``python``
reward's is (:func:`tempering.plugins.rewards.python.load_function`)::

    variants: my_variants:no_cue        # def no_cue(example) -> list[str | dict]

returning the variants of one example: a string is a new prompt text, a mapping a whole
variant example. A variant whose prompt is the original's is dropped (it tells nothing); an
example left with no variant at all is an error for that sample, counted, never skipped.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tempering.errors import ConfigError

#: One counterfactual maker: the variants of one example.
VariantMaker = Callable[[Mapping[str, Any]], list[dict[str, Any]]]

#: Built-in transforms: the key naming each, and the other keys it takes.
TRANSFORMS: dict[str, tuple[str, ...]] = {"remove": (), "add": ("at",), "replace": ("with",)}
_USAGE = "give 'module:function' or a list of {remove: TEXT}, {add: TEXT, at: start|end}, {replace: OLD, with: NEW}"


def prompt_text(example: Mapping[str, Any], key: str = "prompt") -> str:
    """The text a variant changes: ``example[key]``, else the last user message's content."""
    if key in example:
        return str(example[key])
    for message in reversed(list(example.get("messages") or [])):
        if isinstance(message, Mapping) and message.get("role") == "user":
            return str(message.get("content", ""))
    raise ValueError(f"the example has no '{key}' nor a user message to vary (columns: {sorted(example)})")


def with_prompt(example: Mapping[str, Any], text: str, key: str = "prompt") -> dict[str, Any]:
    """A copy of ``example`` whose prompt (as :func:`prompt_text` finds it) is ``text``."""
    out = dict(example)
    if key in example or "messages" not in example:
        out[key] = text
        return out
    messages = [dict(m) for m in example["messages"]]
    last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
    messages[last]["content"] = text
    out["messages"] = messages
    return out


def _fill(template: str, example: Mapping[str, Any], where: str) -> str:
    try:
        return template.format_map({str(k): v for k, v in example.items()})
    except KeyError as exc:
        raise ValueError(
            f"{where}: '{template}' names the column {exc}, which the example lacks (columns: {sorted(example)})"
        ) from None


def _transform(spec: Mapping[str, Any], path: str) -> Callable[[str, Mapping[str, Any]], str]:
    """One built-in transform: ``(prompt, example) -> new prompt``. Raises :class:`ConfigError`."""
    kinds = [k for k in TRANSFORMS if k in spec]
    if len(kinds) != 1:
        raise ConfigError(f"expected exactly one of remove, add, replace, got keys {sorted(spec)}: {_USAGE}", path)
    kind = kinds[0]
    extra = set(spec) - {kind, *TRANSFORMS[kind]}
    if extra:
        raise ConfigError(f"'{kind}' takes {[kind, *TRANSFORMS[kind]]}, not {sorted(extra)}", path)
    text = spec[kind]
    if not isinstance(text, str) or not text:
        raise ConfigError(f"'{kind}' needs a non-empty text, got {text!r}", f"{path}.{kind}")
    try:
        list(string.Formatter().parse(text))
    except ValueError as exc:
        raise ConfigError(f"{exc} in {text!r} (double literal braces: {{{{ }}}})", f"{path}.{kind}") from None
    where = f"{path}.{kind}"
    if kind == "remove":
        return lambda prompt, ex: prompt.replace(_fill(text, ex, where), "")
    if kind == "add":
        at = spec.get("at", "start")
        if at not in ("start", "end"):
            raise ConfigError(f"use start or end (got {at!r})", f"{path}.at")
        if at == "start":
            return lambda prompt, ex: f"{_fill(text, ex, where)}{prompt}"
        return lambda prompt, ex: f"{prompt}{_fill(text, ex, where)}"
    new = spec.get("with")
    if not isinstance(new, str):
        raise ConfigError(f"'replace' needs 'with: NEW' (a text), got {new!r}", f"{path}.with")
    return lambda prompt, ex: prompt.replace(_fill(text, ex, where), _fill(new, ex, f"{path}.with"))


def _from_function(func: Callable[..., Any], key: str, where: str) -> VariantMaker:
    def make(example: Mapping[str, Any]) -> list[dict[str, Any]]:
        out = func(dict(example))
        if isinstance(out, (str, Mapping)) or not isinstance(out, Sequence):
            raise TypeError(f"{where} returned a {type(out).__name__}; return a list of prompt texts or examples")
        variants = []
        for v in out:
            if isinstance(v, str):
                variants.append(with_prompt(example, v, key))
            elif isinstance(v, Mapping):
                variants.append(dict(v))
            else:
                raise TypeError(f"{where} returned a variant of type {type(v).__name__}; use a text or a mapping")
        return variants

    return make


def variant_maker(spec: object, key: str = "prompt", path: str = "monitor.variants") -> VariantMaker:
    """The maker ``spec`` describes (see the module docstring); any mistake in ``spec`` is one
    :class:`ConfigError` at its key path."""
    if isinstance(spec, str):
        from tempering.plugins.rewards.python import load_function

        func = load_function(spec, path)
        if not callable(func):
            raise ConfigError(f"'{spec}' is a {type(func).__name__}, not a function of an example", path)
        return _from_function(func, key, spec)
    if callable(spec):
        return _from_function(spec, key, getattr(spec, "__name__", "variants"))
    if not isinstance(spec, Sequence) or not spec:
        raise ConfigError(f"no variants given: {_USAGE}", path)
    transforms = []
    for i, entry in enumerate(spec):
        if not isinstance(entry, Mapping):
            raise ConfigError(f"expected a mapping, got {entry!r}: {_USAGE}", f"{path}[{i}]")
        transforms.append(_transform(entry, f"{path}[{i}]"))

    def make(example: Mapping[str, Any]) -> list[dict[str, Any]]:
        prompt = prompt_text(example, key)
        return [with_prompt(example, t(prompt, example), key) for t in transforms]

    return make


def distinct_variants(make: VariantMaker, example: Mapping[str, Any], key: str = "prompt") -> list[dict[str, Any]]:
    """``make(example)`` without the variants whose prompt is the original's or an earlier
    variant's; raises :class:`ValueError` when none is left."""
    seen = {prompt_text(example, key)}
    out = []
    for v in make(example):
        text = prompt_text(v, key)
        if text not in seen:
            seen.add(text)
            out.append(v)
    if not out:
        raise ValueError(
            f"no counterfactual variant of this example differs from its prompt {prompt_text(example, key)[:80]!r}: "
            "check the monitor's 'variants' (a text to remove that the prompt does not hold?)"
        )
    return out
