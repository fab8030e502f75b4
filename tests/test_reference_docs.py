"""docs/reference.md is generated from the schemas the validator checks recipes against, and
fails here when it is stale: adding, renaming or re-defaulting a built-in key without
regenerating it (``python -m tempering.apps.reference_docs --write``) is a test failure. Also
``tempering show``, the other way to read what a recipe says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tempering.apps import reference_docs
from tempering.errors import ConfigError
from tempering.registry import BUILTIN_DIST, Registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


@pytest.fixture(scope="module")
def builtins() -> Registry:
    reg = Registry(entry_points=False)
    reg.load_entry_points(external=False)
    return reg


def test_the_checked_in_reference_is_what_the_schemas_say(builtins: Registry) -> None:
    assert DOC.read_text(encoding="utf-8") == reference_docs.render(builtins), (
        "docs/reference.md is stale: run `python -m tempering.apps.reference_docs --write` and commit it"
    )


def documented(text: str) -> dict[tuple[str, str], list[str]]:
    """(kind, name) -> the keys its table lists, read back from the Markdown."""
    out: dict[tuple[str, str], list[str]] = {}
    kind = name = ""
    for line in text.splitlines():
        if line.startswith("## "):
            kind = line[3:].strip()
        elif line.startswith("### `") and kind in reference_docs.ORDER:
            name = line[5:].rstrip("`")
            out[(kind, name)] = []
        elif line.startswith("| `") and (kind, name) in out:
            out[(kind, name)].append(line.split("`")[1])
    return out


def test_every_documented_key_is_what_the_validator_accepts(builtins: Registry) -> None:
    """Cross-check with the validator's own error: an unknown key lists the valid ones."""
    tables = documented(DOC.read_text(encoding="utf-8"))
    comps = [
        c
        for k in reference_docs.ORDER
        if k != "recipe"
        for c in builtins.components(k)
        if c.plugin.dist == BUILTIN_DIST
    ]
    assert {(c.kind, c.name) for c in comps} == set(tables)  # every built-in component has a section
    for comp in comps:
        context = reference_docs.RUNTIME.get(comp.kind, ())
        try:
            builtins.check(comp.kind, {"name": comp.name, "no_such_key_here": 1}, "x", context=context)
        except ConfigError as exc:
            valid = re.search(r"Valid keys: (.*)$", str(exc)).group(1)
            accepted = set() if valid == "(none)" else set(valid.split(", "))
        else:  # takes **kwargs: documented as such, with no table
            assert tables[(comp.kind, comp.name)] == [], comp.name
            continue
        hidden = {name for kind, name in reference_docs.NOT_CONFIG if kind == comp.kind}
        assert set(tables[(comp.kind, comp.name)]) == accepted - hidden, (comp.kind, comp.name)


def test_check_mode_fails_on_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "reference.md"
    stale.write_text(
        DOC.read_text(encoding="utf-8").replace("| `group_size` | int | `8` |", "| `group_size` | int | `4` |")
    )
    monkeypatch.setattr(reference_docs, "DOC", stale)
    assert reference_docs.main(["--check"]) == 1
    stale.write_text(DOC.read_text(encoding="utf-8"))
    assert reference_docs.main(["--check"]) == 0


def test_show_prints_a_bundled_recipe_as_shipped_or_resolved(capsys: pytest.CaptureFixture[str]) -> None:
    import yaml

    from tempering.apps import cli
    from tempering.training.recipe import find_recipe

    shipped = (Path(__file__).resolve().parents[1] / "core" / "recipes" / "tool_use.yaml").read_text(encoding="utf-8")
    assert cli.main(["show", "tool_use"]) == 0
    assert capsys.readouterr().out == shipped  # comments and all
    assert cli.main(["show", "tool_use", "stages.rl.steps=3", "seed=2"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved == find_recipe("tool_use", ["stages.rl.steps=3", "seed=2"]).to_dict()
    assert resolved["stages"][1]["steps"] == 3 and resolved["output_dir"] == "runs/tool_use"  # ${name} resolved
    assert cli.main(["show", "tool_uze"]) == 2
    assert "tempering: error: unknown recipe 'tool_uze'. Did you mean 'tool_use'?" in capsys.readouterr().err
