"""docs/reference.md: every built-in component's config keys, types and defaults, generated from
the schemas the validator checks recipes against (:func:`tempering.registry.params_schema`),
so the reference cannot say something the validator does not.

::

    python -m tempering.apps.reference_docs --write      # regenerate docs/reference.md
    python -m tempering.apps.reference_docs --check      # exit 1 if it is stale (tests/test_reference_docs.py)

Each component gets its registered one-line description and a table of its keys. Types are
the schema's (what omegaconf converts and checks: ``int``, ``float``, ``bool``,
``str``, ``... | null``; anything else is ``any``). Defaults are the factory's own -- the schema
keeps list and mapping defaults out of omegaconf's way, but the factory applies them. Keys the
caller passes at run time (a logger's ``output_dir``, a sampler's ``context``) are not config
and are left out, as the validator leaves them out.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml

from tempering.registry import BUILTIN_DIST, Registry, config_blocks, factory_defaults, params_schema
from tempering.training.stage import EvalConfig, OptimizerConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
#: Arguments each kind's factory gets at run time (the ``context`` of ``Registry.build``).
RUNTIME: dict[str, tuple[str, ...]] = {"logger": ("output_dir",), "sampler": ("context",), "renderer": ("tokenizer",)}
#: Runtime-only arguments of particular factories (documented as "not a config key").
NOT_CONFIG = {("backend", "model_builder")}
#: Kinds in the order a recipe meets them; recipes are listed without keys.
ORDER = (
    "algorithm",
    "backend",
    "model",
    "dataset",
    "reward",
    "advantage",
    "loss",
    "sampler",
    "environment",
    "renderer",
    "logger",
    "recipe",
)


@dataclasses.dataclass
class Key:
    name: str
    type: str
    default: str  # "" = required


def keys_of(factory: Callable[..., Any], exclude: Iterable[str] = ()) -> list[Key] | None:
    """The config keys of ``factory`` (None: it accepts any key)."""
    schema = params_schema(factory, exclude)
    if schema is None:
        return None
    defaults = factory_defaults(factory)
    out = []
    for f in dataclasses.fields(schema):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        value = defaults.get(f.name, dataclasses.MISSING if required else f.default)
        out.append(Key(f.name, type_name(f.type), "" if value is dataclasses.MISSING else show(value)))
    return out


def type_name(t: object) -> str:
    if t in (int, float, bool, str):
        return t.__name__
    args = [a for a in typing.get_args(t) if a is not type(None)]
    # typing.Optional[int] (a hand-written schema) or int | None (the schemas registry.py derives)
    optional = typing.get_origin(t) in (typing.Union, types.UnionType)
    if optional and len(args) == 1 and args[0] in (int, float, bool, str):
        return f"{args[0].__name__} \\| null"
    return "any"


def show(value: object) -> str:
    """A default as YAML would write it (a callable or object default: its name)."""
    if callable(value) and not isinstance(value, type):
        return f"({getattr(value, '__name__', type(value).__name__)})"
    if value is None or isinstance(value, (bool, int, float, str, list, dict, tuple)):
        # a string with line breaks (SDPO's templates) double-quoted, "\n" escaped: one table row
        style = '"' if isinstance(value, str) and "\n" in value else None
        text = yaml.safe_dump(
            list(value) if isinstance(value, tuple) else value, default_flow_style=True, width=1000, default_style=style
        )
        text = text.strip().removesuffix("...").strip()
        return "`" + text.replace("|", "\\|") + "`"
    return f"({type(value).__name__})"


def summary(factory: Callable[..., Any]) -> str:
    """The first paragraph of the factory's docstring, on one line, in Markdown (a dataclass's
    generated ``Name(field=...)`` docstring says nothing: none)."""
    doc = inspect.getdoc(factory) or ""
    if dataclasses.is_dataclass(factory) and doc.startswith(f"{getattr(factory, '__name__', '')}("):
        return ""
    text = " ".join(doc.split("\n\n")[0].split())
    return re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")


def table(keys: list[Key] | None, skip: Iterable[str] = ()) -> list[str]:
    if keys is None:
        return ["Accepts any keys (its factory takes `**kwargs`)."]
    rows = [k for k in keys if k.name not in set(skip)]
    if not rows:
        return ["No keys."]
    lines = ["| key | type | default |", "| --- | --- | --- |"]
    lines += [f"| `{k.name}` | {k.type} | {k.default or '**required**'} |" for k in rows]
    return lines


def render(registry: Registry | None = None) -> str:
    """The whole page, for the built-in components of ``registry`` (default: tempering's own)."""

    if registry is None:
        registry = Registry(entry_points=False)
        registry.load_entry_points(external=False)
    out = [
        "# Reference: the built-in components and their keys",
        "",
        "<!-- Generated by `python -m tempering.apps.reference_docs --write` from the schemas the recipe validator",
        "uses; tests/test_reference_docs.py fails when this file is stale. Do not edit by hand. -->",
        "",
        "A component is written as its name, or as a mapping with `name:` plus the keys below (see",
        "[architecture](architecture.md#config-validation-with-paths)). A key left out takes the default;",
        "**required** keys have none. Types are what the validator converts and checks (`any`: not",
        "checked by type). `tempering plugins` lists every installed component, third-party ones included.",
        "",
        "Kinds: " + ", ".join(f"[{k}](#{k})" for k in ORDER) + ", [stage blocks](#stage-blocks).",
    ]
    for kind in ORDER:
        comps = [c for c in registry.components(kind) if c.plugin.dist == BUILTIN_DIST]
        out += ["", f"## {kind}", ""]
        if kind == "recipe":
            out += ["Bundled recipes (`tempering show NAME` prints one, `tempering run NAME` runs it):", ""]
            out += [f"- `{c.name}`: {c.description}" for c in comps]
            continue
        for comp in comps:
            factory = comp.load()
            out += [f"### `{comp.name}`", ""]
            if comp.description:  # the registered one-liner (`tempering plugins` shows it too)
                out += [comp.description[0].upper() + comp.description[1:].rstrip(".") + ".", ""]
            skip = [name for k, name in NOT_CONFIG if k == kind]
            out += table(keys_of(factory, RUNTIME.get(kind, ())), skip)
            out.append("")
    out += [
        "",
        "## stage blocks",
        "",
        "Every training stage has these nested blocks (checked key by key like a component):",
        "",
    ]
    blocks = [
        (f"`{kind}.{key}:` ({comp.name})", cls)
        for kind in ORDER
        for comp in registry.components(kind)
        if comp.plugin.dist == BUILTIN_DIST and kind != "recipe"
        for key, cls in config_blocks(comp.load()).items()
    ]
    for title, cls in (("`optimizer:`", OptimizerConfig), ("`eval:`", EvalConfig), *blocks):
        out += [f"### {title}", ""]
        if summary(cls):
            out += [summary(cls), ""]
        out += table(keys_of(cls))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tempering.apps.reference_docs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--write", action="store_true", help=f"write {DOC}")
    parser.add_argument("--check", action="store_true", help="exit 1 if the file differs from what would be written")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        DOC.write_text(text, encoding="utf-8")
        print(f"wrote {DOC}")
    elif args.check:
        if not DOC.exists() or DOC.read_text(encoding="utf-8") != text:
            print(f"{DOC} is stale: run python -m tempering.apps.reference_docs --write", file=sys.stderr)
            return 1
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
