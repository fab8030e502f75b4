"""A recipe with every default written out: what ``tempering show --resolved`` prints.

:meth:`Recipe.to_dict` holds what the recipe says; a run also uses the defaults of every
component it names. :func:`with_defaults` fills them in, from the same schemas the validator
checks keys against (:func:`tempering.registry.params_schema`) and the factories' own default
values (as ``docs/reference.md`` lists them):

- each stage: its algorithm's keys, then, inside it, ``optimizer:`` and ``eval:`` (the
  :class:`~tempering.training.stage.OptimizerConfig` and :class:`~tempering.training.stage.EvalConfig` keys) and
  every key that names a component of a registered kind (``reward``, ``dataset``, ``loss``,
  ``sampler`` and its ``environment``, ...), written as ``{name: ..., <its keys>}``;
- the backend (and the nested blocks its factory declares, such as the local backend's
  ``lora:``: :data:`tempering.registry.BLOCKS_HOOK`) and each logger.

A value the registry cannot expand (a path, a Python object) is left as it is; ``renderer:
auto`` is written as the renderer it stands for once the model's tokenizer is known
(:func:`with_renderers`, :func:`model_tokenizer`); a default that is not plain data (a
function) is left out, as the factory supplies it.
Keys a component receives at run time (a logger's ``output_dir``) are not config and are not
shown.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from tempering.interfaces import LoadedModel, Tokenizer
from tempering.registry import (
    Registry,
    config_blocks,
    factory_defaults,
    get_registry,
    is_plain_data,
    params_schema,
    resolved_values,
)
from tempering.training.stage import EvalConfig, OptimizerConfig

#: Arguments each kind's factory gets at run time, not from the recipe.
RUNTIME: dict[str, tuple[str, ...]] = {
    "logger": ("output_dir",),
    "sampler": ("context",),
    "renderer": ("tokenizer",),
    "backend": ("model_builder",),
}
#: Keys that name a component of their kind wherever they appear (when typed ``any``).
NESTED_KINDS = ("dataset", "reward", "advantage", "loss", "sampler", "environment", "renderer")


def with_defaults(cfg: Mapping[str, Any], registry: Registry | None = None) -> dict[str, Any]:
    """``cfg`` (a :meth:`Recipe.to_dict`) with every component's defaults filled in."""
    registry = registry or get_registry()
    out = dict(cfg)
    out["backend"] = component(registry, "backend", cfg.get("backend"))
    loggers = cfg.get("loggers")
    if isinstance(loggers, (list, tuple)):
        out["loggers"] = [component(registry, "logger", spec) for spec in loggers]
    elif loggers is not None:
        out["loggers"] = component(registry, "logger", loggers)
    out["stages"] = [_stage(registry, spec) for spec in cfg.get("stages") or []]
    return out


def with_renderers(
    cfg: Mapping[str, Any], tokenizer: Tokenizer, declared: str | None, registry: Registry | None = None
) -> dict[str, Any]:
    """``cfg`` (from :func:`with_defaults`) with each stage's ``renderer: auto`` written as the
    renderer it stands for with the model of ``tokenizer`` that declares ``declared``
    (:func:`~tempering.rollouts.renderer.resolved_name`: the model's declared chat format;
    ``auto`` stays for a model without one), with its keys."""
    from tempering.rollouts.renderer import AUTO, resolved_name

    registry = registry or get_registry()
    name = resolved_name(AUTO, tokenizer, declared)
    if name == AUTO:
        return dict(cfg)
    stages = [
        {**s, "renderer": component(registry, "renderer", name)}
        if isinstance(s, Mapping) and s.get("renderer") == AUTO
        else s
        for s in cfg.get("stages") or []
    ]
    return {**cfg, "stages": stages}


def model_tokenizer(spec: Any, registry: Registry | None = None) -> tuple[Any, str | None] | None:
    """The tokenizer of a backend spec's ``model`` and the renderer the model declares -- a
    registered builder's (the builder runs: seconds for a real model) or a saved folder's (no
    declared renderer) -- or None when it cannot be had without the backend itself (a hub id, a
    service's model): then ``renderer: auto`` is shown as it is."""
    import os

    from tempering.registry import registered_builder

    model = spec.get("model") if isinstance(spec, Mapping) else None
    if not isinstance(model, str) or not model:
        return None
    builder = registered_builder(model, registry)
    if builder is not None:
        loaded = LoadedModel.of(builder(**dict(spec.get("model_kwargs") or {})))
        return loaded.tokenizer, loaded.renderer
    if os.path.isdir(model):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(model), None
    return None


def component(registry: Registry, kind: str, spec: object) -> Any:
    """``spec`` as ``{name: ..., **defaults, **spec}``, its nested components expanded too
    (``spec`` unchanged when it is not a registered component's name or mapping)."""
    written = spec
    if isinstance(spec, str):
        spec = {"name": spec}
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        return written
    try:
        factory = registry.get(kind, spec["name"]).load()
    except Exception:  # noqa: BLE001 - not a registered name (``auto``, a path): shown as written
        return written
    schema = params_schema(factory, RUNTIME.get(kind, ()))
    given = {k: v for k, v in spec.items() if k != "name"}
    out: dict[str, Any] = {"name": spec["name"]}
    if schema is None:  # takes **kwargs: no defaults to show
        return {**out, **given}
    defaults = factory_defaults(factory)
    for f in dataclasses.fields(schema):
        if f.name in given:
            value = given[f.name]
        elif f.name in defaults and is_plain_data(defaults[f.name]):
            value = defaults[f.name]
        else:
            continue  # required and missing (the validator says so), or an object default
        if f.name in NESTED_KINDS and f.type not in (str, "str") and typing.get_origin(f.type) is None:
            value = component(registry, f.name, value)
        elif kind == "sampler" and f.name == "environment":
            value = component(registry, "environment", value)
        out[f.name] = value
    for key, block in config_blocks(factory).items():  # e.g. the local backend's lora: block
        if isinstance(out.get(key), Mapping):
            out[key] = _block(block, out[key])
    out.update({k: v for k, v in given.items() if k not in out})  # unknown keys: kept, for the validator to name
    out.update(resolved_values(factory, out))  # e.g. the local backend's engine: auto -> what it picks
    return out


def _stage(registry: Registry, spec: object) -> Any:
    sid = spec.get("id") if isinstance(spec, Mapping) else None
    body = {k: v for k, v in spec.items() if k != "id"} if isinstance(spec, Mapping) else spec
    out = component(registry, "algorithm", body)
    if not isinstance(out, dict):
        return spec
    if isinstance(out.get("optimizer"), Mapping):
        out["optimizer"] = _block(OptimizerConfig, out["optimizer"])
    if isinstance(out.get("eval"), Mapping):
        ev = _block(EvalConfig, out["eval"])
        if ev.get("reward") is None:  # null means the stage's reward (tempering.training.stage.eval_reward): show which
            ev["reward"] = out["reward"] if out.get("reward") is not None else "tempering:exact_match"
        for key in ("dataset", "reward", "sampler"):
            if ev.get(key) is not None:
                ev[key] = component(registry, key, ev[key])
        out["eval"] = ev
    return {
        "name": out["name"],
        **({"id": sid} if sid is not None else {}),
        **{k: v for k, v in out.items() if k != "name"},
    }


def _block(cls: type, given: Mapping[str, Any]) -> dict[str, Any]:
    """A nested config block (a dataclass's fields) with its defaults filled in."""
    defaults = factory_defaults(cls)
    out = {
        f.name: given.get(f.name, defaults.get(f.name))
        for f in dataclasses.fields(cls)
        if f.name in given or (f.name in defaults and is_plain_data(defaults[f.name]))
    }
    out.update({k: v for k, v in given.items() if k not in out})
    return out
