"""The package as pip builds it: every folder listed, and a regular (non-editable) install
importing exactly like the editable one this checkout is installed as.

``package-dir`` remaps three folders (core/ -> tempering, algorithms/ -> tempering.algorithms,
plugins/ -> tempering.plugins), so setuptools cannot find subpackages by itself: they are
listed in pyproject.toml, and a folder missing from that list works in the editable install
but is absent from a wheel. These tests catch that.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
SETUPTOOLS = PYPROJECT["tool"]["setuptools"]


def _source_packages() -> dict[str, Path]:
    """Every folder with an ``__init__.py`` under a package-dir root, by its package name."""
    found = {}
    for package, folder in SETUPTOOLS["package-dir"].items():
        root = REPO / folder
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            rel = init.parent.relative_to(root)
            found[".".join([package, *rel.parts])] = init.parent
    return found


def test_every_package_folder_is_listed_in_pyproject():
    listed = set(SETUPTOOLS["packages"])
    found = _source_packages()
    missing = sorted(set(found) - listed)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
    stale = sorted(listed - set(found))
    assert not stale, f"listed in pyproject.toml but no such folder with an __init__.py: {stale}"
    # folders nest the way the names do: tempering.plugins is not also a folder under core/
    assert not (REPO / "core" / "algorithms").exists() and not (REPO / "core" / "plugins").exists()


# A probe run in each install: what imports, from where, and what the plugins provide.
PROBE = r"""
import importlib, importlib.metadata as md, importlib.resources, json, pkgutil, sys
import tempering

def walk(name):
    pkg = importlib.import_module(name)
    return {name} | {m.name for m in pkgutil.walk_packages(pkg.__path__, name + ".")}

roots = sorted(json.loads(sys.argv[1]))
names = set().union(*(walk(r) for r in roots))
imports = {}
for name in sorted(names - {"tempering.__main__"}):  # importing __main__ runs the CLI
    try:
        importlib.import_module(name)
        imports[name] = "ok"
    except Exception as exc:
        imports[name] = f"{type(exc).__name__}: {exc}"
files = {n: getattr(sys.modules.get(n), "__file__", None) for n in roots}

from tempering.registry import Registry
reg = Registry(strict=True)
components = sorted([c.kind, c.name, c.plugin.dist, c.target] for c in reg.components())
targets = {}
for c in reg.components():
    try:
        c.load()
        targets[f"{c.kind}:{c.name}"] = "ok"
    except Exception as exc:
        targets[f"{c.kind}:{c.name}"] = str(exc)

import tempering.recipes as recipes
dist = md.distribution("tempering")
print(json.dumps({
    "file": tempering.__file__,
    "files": files,
    "names": sorted(names),
    "walk_from_top": sorted(walk("tempering")),
    "imports": imports,
    "entry_points": sorted([e.name, e.value] for e in dist.entry_points if e.group == "tempering"),
    "scripts": sorted([e.name, e.value] for e in dist.entry_points if e.group == "console_scripts"),
    "components": components,
    "targets": targets,
    "recipes": {n: reg.get("recipe", n).load()()["name"] for n in reg.names("recipe")},
    "arithmetic_stages": [s.get("id") for s in recipes.arithmetic()["stages"]],
    "py_typed": (importlib.resources.files("tempering") / "py.typed").is_file(),
}))
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "TEMPERING_LOAD_PLUGINS", "TEMPERING_STRICT_PLUGINS")
    }
    env.update(extra)
    return env


def _probe(cmd: list[str], cwd: Path, env: dict[str, str]) -> dict:
    roots = json.dumps(sorted(SETUPTOOLS["package-dir"]))
    proc = subprocess.run([*cmd, "-c", PROBE, roots], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def installs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Probe the editable install and a fresh ``pip install .`` into a ``--target`` folder."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"  # pip builds in the source tree: build from a copy, keep the checkout clean
    src.mkdir()
    for name in ["pyproject.toml", "README.md", *sorted(set(SETUPTOOLS["package-dir"].values()))]:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        elif path.exists():
            shutil.copy2(path, src / name)
    target = root / "site"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "--target",
            str(target),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_clean_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    empty = root / "cwd"  # run from an empty folder: nothing of the checkout is importable by accident
    empty.mkdir()

    editable = _probe([sys.executable], empty, _clean_env())
    # -S: no site-packages processing, so the editable install's .pth finder never loads; the
    # dependencies (torch, pluggy, ...) come from the interpreter's site-packages, after the target.
    deps = [p for p in [*site.getsitepackages(), sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    env = _clean_env(PYTHONPATH=os.pathsep.join([str(target), *dict.fromkeys(deps)]))
    regular = _probe([sys.executable, "-S"], empty, env)
    return {"editable": editable, "regular": regular, "target": {"path": str(target)}}


def test_the_regular_install_is_what_was_imported(installs):
    target = Path(installs["target"]["path"])
    for name, file in installs["regular"]["files"].items():
        assert Path(file).is_relative_to(target), f"{name} was imported from {file}, not from {target}"
    for name, file in installs["editable"]["files"].items():
        assert Path(file).is_relative_to(REPO), f"{name} was imported from {file}, not from the checkout"
    assert (target / "bin" / "tempering").exists()  # the console script was installed too


def test_both_installs_have_the_same_modules_and_all_import(installs):
    editable, regular = installs["editable"], installs["regular"]
    expected = set(_source_modules())
    not_installed = sorted(expected - set(regular["names"]))
    assert not not_installed, f"in the source tree but not in the installed package: {not_installed}"
    assert set(regular["names"]) == expected
    assert regular["names"] == editable["names"]
    assert regular["imports"] == editable["imports"]
    broken = {n: e for n, e in regular["imports"].items() if e != "ok"}
    assert not broken
    # installed, the subpackages nest under tempering/ (so a plain walk from the top finds them all)
    assert regular["walk_from_top"] == regular["names"]


def _source_modules() -> list[str]:
    out = []
    for package, folder in SETUPTOOLS["package-dir"].items():
        root = REPO / folder
        for py in root.rglob("*.py"):
            rel = py.relative_to(root)
            if "__pycache__" in rel.parts or not (py.parent / "__init__.py").exists():
                continue
            parts = [package, *rel.parent.parts] + ([] if py.name == "__init__.py" else [py.stem])
            out.append(".".join(parts))
    return out


def test_both_installs_have_the_same_entry_points_and_components(installs):
    editable, regular = installs["editable"], installs["regular"]
    declared = sorted([k, v] for k, v in PYPROJECT["project"]["entry-points"]["tempering"].items())
    assert regular["entry_points"] == editable["entry_points"] == declared
    assert regular["scripts"] == editable["scripts"] == [["tempering", "tempering.apps.cli:main"]]
    assert regular["components"] == editable["components"]
    assert regular["targets"] == editable["targets"]
    assert {k: v for k, v in regular["targets"].items() if v != "ok"} == {}  # every lazy target imports


def test_package_data_is_installed(installs):
    editable, regular = installs["editable"], installs["regular"]
    assert regular["recipes"] == editable["recipes"] and regular["recipes"]["arithmetic"] == "arithmetic"
    assert regular["arithmetic_stages"] == editable["arithmetic_stages"] and regular["arithmetic_stages"]
    assert regular["py_typed"] and editable["py_typed"]
    # every non-Python file of a package folder is in the install
    target = Path(installs["target"]["path"])
    for package, folder in _source_packages().items():
        installed = target.joinpath(*package.split("."))
        for data in folder.iterdir():
            if data.is_file() and data.suffix not in (".py", ".pyc"):
                assert (installed / data.name).is_file(), f"{data.relative_to(REPO)} is not in the installed package"
