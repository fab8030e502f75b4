"""Recipe config: YAML through omegaconf, ``key=value`` overrides, and validation with paths.

A recipe names every component by ``name:`` plus that component's own keys::

    backend: {name: local, model: tiny_llama}
    stages:
      - {name: sft, id: warmup, steps: 100, dataset: {name: arithmetic}}
      - {name: grpo, id: rl, steps: 40, reward: {name: exact_match}}

Only the top level is checked here (:class:`RecipeConfig`); each component's keys are checked
against its own schema when the registry builds it, so switching ``name`` never carries the
old component's keys over and a misspelt key fails with its full path, e.g.
``stages[1].reward.tolerence: unknown key``.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import yaml

from tempering.errors import ConfigError
from tempering.registry import ComponentSpec


@dataclass
class RecipeConfig:
    """The top-level keys of a recipe."""

    name: str = "recipe"
    seed: int = 0
    output_dir: str = "runs/${name}"
    backend: ComponentSpec = field(default_factory=lambda: {"name": "local"})
    loggers: Any = field(default_factory=lambda: ["jsonl", "plot"])
    stages: Any = field(default_factory=list)
    #: Stop after this many optimizer steps in total (handy for smoke tests); null = no cap.
    max_total_steps: Any = None
    #: Checkpoint inside a stage every this many steps (0 = by time only) ...
    checkpoint_every: int = 0
    #: ... or once this many minutes of wall time passed since the last checkpoint (0 = off).
    checkpoint_minutes: float = 5.0
    #: Periodic checkpoints kept besides every stage end (null = keep all); see docs/runs.md.
    keep_checkpoints: Any = 3
    #: Continue an earlier run in output_dir; false (``--fresh``) moves it aside and starts over.
    resume: bool = True


def parse_value(text: str) -> Any:
    """``key=value`` values are YAML scalars/flow collections: ``3``, ``1e-4``, ``[a, b]``."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(cfg: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides in place. Stage lists accept an index or a stage id:
    ``stages.1.steps=10`` and ``stages.rl.steps=10`` are the same."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value (e.g. stages.rl.steps=10)")
        key, _, raw = item.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"override '{item}' has an empty key")
        node: Any = cfg
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            where = ".".join(parts[: i + 1])
            if isinstance(node, list):
                idx = _list_index(node, part, where)
                if last:
                    node[idx] = parse_value(raw)
                else:
                    node = node[idx]
            elif isinstance(node, dict):
                if last:
                    node[part] = parse_value(raw)
                else:
                    child = node.get(part)
                    if isinstance(child, str):  # a component given by name: keep the name
                        node[part] = {"name": child}
                    elif child is None:
                        node[part] = {}
                    elif not isinstance(child, (dict, list)):
                        raise ConfigError(f"cannot set '{key}': '{where}' is a value ({child!r}), not a mapping", key)
                    node = node[part]
            else:
                raise ConfigError(f"cannot set '{key}': '{'.'.join(parts[:i])}' is a value, not a mapping", key)
    return cfg


def _list_index(items: list[Any], part: str, where: str) -> int:
    if part.lstrip("-").isdigit():
        idx = int(part)
        if not -len(items) <= idx < len(items):
            raise ConfigError(f"index {idx} out of range (the list has {len(items)} items)", where)
        return idx
    ids = [stage_id(s, i) for i, s in enumerate(items)]
    if part in ids:
        return ids.index(part)
    raise ConfigError(f"no item '{part}' in this list; use an index or one of: {', '.join(ids)}", where)


def stage_id(stage: object, index: int) -> str:
    if isinstance(stage, Mapping):
        return str(stage.get("id") or stage.get("name") or index)
    return str(index)


def load_yaml(path: str) -> dict[str, Any]:
    """Read a recipe file. Every problem is one line: YAML syntax errors (tabs included) and
    duplicate keys as ``file:line:column: what``, never a scanner traceback."""
    if not os.path.exists(path):
        raise ConfigError(f"recipe file '{path}' does not exist")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.load(fh, Loader=_RecipeLoader) or {}  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        raise ConfigError(_yaml_problem(exc), _yaml_where(path, exc)) from None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read the recipe file ({type(exc).__name__}: {exc})", path) from None
    if not isinstance(data, dict):
        raise ConfigError(f"recipe file '{path}' must hold a mapping at the top level")
    return data


class _RecipeLoader(yaml.SafeLoader):
    """``yaml.safe_load`` keeps the last of two equal keys without a word; a recipe with
    ``steps:`` twice is a mistake to report, not to guess at."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, Any] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged by the base class
                continue
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                first = seen[key].line + 1
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first on line {first}); keep one", key_node.start_mark
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def _yaml_where(path: str, exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    return f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path


def _yaml_problem(exc: yaml.MarkedYAMLError) -> str:
    problem = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
    if "'\\t'" in problem:
        return "a tab character; YAML indents with spaces only (replace the tabs with spaces)"
    if exc.context and exc.problem and "duplicate key" not in problem:
        problem = f"{' '.join(str(exc.context).split())}: {problem}"
    if "<block end>" in problem or "mapping values are not allowed" in problem:
        problem += " (check this line's indentation, and quote values that contain ': ')"
    return problem


def resolve_recipe(data: Mapping[str, Any], overrides: Iterable[str] = ()) -> dict[str, Any]:
    """Validate the top level, apply defaults and overrides, resolve ``${...}``; a plain dict."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    cfg = apply_overrides(_plain(data), overrides)
    known = [f.name for f in dataclasses.fields(RecipeConfig)]
    for key in cfg:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"unknown top-level key '{key}'.{hint} Valid keys: {', '.join(known)}", key)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RecipeConfig), cfg)
        out = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc).splitlines()[0], getattr(exc, "full_key", None)) from exc
    assert isinstance(out, dict)
    if not isinstance(out["stages"], list) or not out["stages"]:
        raise ConfigError("a recipe needs at least one stage, e.g. stages: [{name: grpo, ...}]", "stages")
    ids = [stage_id(s, i) for i, s in enumerate(out["stages"])]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise ConfigError(
            f"stage ids must be unique; give the stages distinct 'id:' values ({', '.join(dupes)})", "stages"
        )
    return cast("dict[str, Any]", out)


def _plain(data: object) -> Any:
    """Deep copy into plain dicts/lists (accepts omegaconf containers and dataclasses)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(data, (DictConfig, ListConfig)):
        return OmegaConf.to_container(data, resolve=False)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        return _plain(dataclasses.asdict(data))
    if isinstance(data, Mapping):
        return {str(k): _plain(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_plain(v) for v in data]
    return data
