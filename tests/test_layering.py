"""The layering the code keeps, read from the source (every import, function-level ones included).

Three folders, three layers: ``core/`` (``tempering``) imports neither ``tempering.plugins`` nor
``tempering.algorithms``; plugins and algorithms do not import each other, and no algorithm
imports another (they compose the core's parts). Inside the core,
subpackages by purpose, each importing only those below it:

    tempering (types, interfaces, errors, registry, schema, loss_contract, hookspecs, testing)
      < rlmath < runs < rollouts < training < apps

with ``tempering.api`` (the public import surface, re-exports) above them all,

and no import cycle anywhere (a cycle hidden behind a function-level import counts).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The core's subpackages, lowest first; the top-level modules of ``tempering`` sit below them all.
CORE_ORDER = ["rlmath", "runs", "rollouts", "training", "apps"]
#: Top-level modules that may import upward, and why: ``python -m tempering`` runs the CLI; the
#: package root re-exports :mod:`tempering.api` lazily (``from tempering import Recipe``).
CORE_ENTRY = {"tempering.__main__", "tempering"}


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports, top-level or inside functions (TYPE_CHECKING blocks aside)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                out.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = ".".join(package[: len(package) - child.level + 1] + ([base] if base else []))
                out.update([base] + [f"{base}.{a.name}" for a in child.names])
            visit(child)

    visit(tree)
    return out


def _modules() -> dict[str, Path]:
    found = {}
    for top, prefix in (
        ("core", "tempering"),
        ("algorithms", "tempering.algorithms"),
        ("plugins", "tempering.plugins"),
    ):
        for path in (ROOT / top).rglob("*.py"):
            parts = list(path.relative_to(ROOT / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([prefix, *parts])] = path
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for target in _imports(path, name):
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.add(target)
        graph[name] = edges
    return graph


def _layer(module: str) -> str:
    return (
        "algorithms"
        if module.startswith("tempering.algorithms")
        else "plugins"
        if module.startswith("tempering.plugins")
        else "core"
    )


def test_no_upward_imports():
    """core imports neither plugins nor algorithms; plugins and algorithms not each other."""
    allowed = {"core": {"core"}, "algorithms": {"core", "algorithms"}, "plugins": {"core", "plugins"}}
    wrong = sorted(
        f"{a} -> {b}" for a, targets in _graph().items() for b in targets if _layer(b) not in allowed[_layer(a)]
    )
    assert wrong == []


def _algorithm(module: str) -> str:
    """The algorithm package a module belongs to (``tempering.algorithms.sdpo.loss`` -> ``sdpo``)."""
    return module.split(".")[2] if module.count(".") >= 2 else ""


def test_no_algorithm_imports_another():
    """Algorithms are composed from the core's parts (the RL engine, the policy-gradient stage,
    the stale-rollout component, teacher weights), never from one another: an algorithm's
    package imports only itself and the core."""
    wrong = sorted(
        f"{a} -> {b}"
        for a, targets in _graph().items()
        if _layer(a) == "algorithms"
        for b in targets
        if _layer(b) == "algorithms" and _algorithm(b) != _algorithm(a)
    )
    assert wrong == []


def test_no_import_cycles():
    """Counting function-level imports too: a cycle hidden behind a lazy import is one."""
    graph, index, low, stack, on, cycles = _graph(), {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    assert cycles == []


def _core_rank(module: str) -> int:
    """0 for ``tempering``'s own top-level modules, else 1 + the subpackage's place in CORE_ORDER;
    ``tempering.recipes`` (bundled YAML and its plugin) ranks with the apps, ``tempering.api``
    (which only re-exports) above everything."""
    parts = module.split(".")
    if len(parts) >= 2 and parts[1] == "api":
        return len(CORE_ORDER) + 1
    if len(parts) < 2 or parts[1] not in CORE_ORDER + ["recipes"]:
        return 0
    return len(CORE_ORDER) if parts[1] == "recipes" else 1 + CORE_ORDER.index(parts[1])


def test_core_subpackages_import_only_downward():
    graph = _graph()
    wrong = sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        if _layer(a) == "core" and a not in CORE_ENTRY
        for b in targets
        if _layer(b) == "core" and _core_rank(b) > _core_rank(a)
    )
    assert wrong == []


def test_the_core_is_in_subpackages_by_purpose():
    """A newcomer finds a module by its purpose: the top level holds only the public contracts."""
    top = sorted(p.stem for p in (ROOT / "core").glob("*.py"))
    assert top == [
        "__init__",
        "__main__",
        "api",
        "errors",
        "hookspecs",
        "interfaces",
        "loss_contract",
        "registry",
        "schema",
        "testing",
        "types",
    ]
    assert {p.name for p in (ROOT / "core").iterdir() if (p / "__init__.py").exists()} == {*CORE_ORDER, "recipes"}


def test_plugins_and_algorithms_do_not_import_the_apps():
    """The apps (CLI, export, eval, viewer) call backends and stages; a backend or stage that
    imported an app would make that a round trip (the local backend's export once imported
    ``tempering.apps.export``, which calls the backend: issue 38)."""
    wrong = sorted(
        f"{a} -> {b}"
        for a, targets in _graph().items()
        if _layer(a) != "core"
        for b in targets
        if b.startswith("tempering.apps")
    )
    assert wrong == []
