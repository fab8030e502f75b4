"""Shared fixtures: a fresh registry, and hand-made distributions with real entry points."""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ["TEMPERING_PROGRESS"] = "0"  # no progress bars in test output

import pytest

from tempering import registry as registry_module
from tempering.registry import ENV_LOAD, ENV_STRICT, Registry
from tempering.testing import empty_registry  # noqa: F401 - the plugin authors' fixture, used here too

REPO = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files with slow (learning) tests first, each file's own order kept: ``.ci/run`` runs the
    suite on two workers a file at a time (``-n 2 --dist loadfile``), and a file that takes
    minutes must start at once, not be dealt out last while the other worker idles."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


#: Tests that may be skipped under CI=1: those of the optional extras, which ``.ci/run`` runs in
#: venvs of their own (and skips here, where the extras are not installed).
SKIP_MARKERS_RUN_ELSEWHERE = ("extras", "vllm")
_unexpected_skips: list[str] = []


def unexpected_skip(report: pytest.TestReport) -> str | None:
    """``"<test id>: <reason>"`` for a skip CI must not accept, else None: under ``CI=1`` a
    skip hides a test that did not run (a missing dependency, a broken import), unless the test
    belongs to an extra run elsewhere or its id contains one of the comma-separated
    ``TEMPERING_CI_ALLOW_SKIPS`` (the explicit opt-out)."""
    if not report.skipped or os.environ.get("CI", "").lower() not in ("1", "true"):
        return None
    if any(marker in report.keywords for marker in SKIP_MARKERS_RUN_ELSEWHERE):
        return None
    allowed = [a for a in os.environ.get("TEMPERING_CI_ALLOW_SKIPS", "").split(",") if a.strip()]
    if any(a.strip() in report.nodeid for a in allowed):
        return None
    reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return f"{report.nodeid}: {reason}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if (line := unexpected_skip(report)) is not None:
        _unexpected_skips.append(line)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if _unexpected_skips:
        terminalreporter.section("skipped under CI=1 (a test that did not run)", red=True)
        for line in _unexpected_skips:
            terminalreporter.line(line)
        terminalreporter.line("fix the cause, or name the test in TEMPERING_CI_ALLOW_SKIPS to accept the skip")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if hasattr(session.config, "workerinput"):  # an xdist worker: the controller sees every report
        return
    if _unexpected_skips and exitstatus == 0:
        session.exitstatus = 1


@pytest.fixture
def clean_plugin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the caller's TEMPERING_LOAD_PLUGINS / TEMPERING_STRICT_PLUGINS and the cached
    process-wide registry, so every test sees exactly the plugins it sets up."""
    monkeypatch.delenv(ENV_LOAD, raising=False)
    monkeypatch.delenv(ENV_STRICT, raising=False)
    monkeypatch.setattr(registry_module, "_default", None)


@pytest.fixture
def fresh_registry(clean_plugin_env: None, monkeypatch: pytest.MonkeyPatch) -> Registry:
    """A registry loaded from the installed entry points, also used as the process-wide one
    (``get_registry()``, the CLI, ``run_recipe``) for the duration of the test."""
    reg = Registry()
    monkeypatch.setattr(registry_module, "_default", reg)
    return reg


@pytest.fixture
def reward_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[str, Any]]]:
    """Start reward servers (``tempering serve-reward``'s server) on loopback:
    ``start(target, port=0, **server_options) -> (url, stop)``; every one is stopped at teardown.
    A caller's $TEMPERING_REWARD_TOKEN is forgotten, so a server asks for a token only when the
    test gives one."""
    from tempering.plugins.rewards.remote import TOKEN_ENV
    from tempering.plugins.rewards.server import start_server

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    stops: list[Any] = []

    def start(target: str, port: int = 0, **kw: Any) -> tuple[str, Any]:
        url, stop = start_server(target, "127.0.0.1", port, **kw)
        stops.append(stop)
        return url, stop

    yield start
    for stop in stops:
        stop()


@pytest.fixture
def rejects_before_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Callable[[str, str, str], None]:
    """``check(recipe_yaml, override, message)``: ``tempering run`` on the recipe (``{out}`` in it
    is the run folder) with one ``key=value`` override exits 2 with exactly one line starting
    ``tempering: error: <message>``, and nothing was trained or written."""
    from tempering.apps import cli

    def check(recipe: str, override: str, message: str) -> None:
        path = tmp_path / "bad.yaml"
        path.write_text(recipe.format(out=tmp_path / "run"), encoding="utf-8")
        try:
            rc = cli.main(["run", str(path), override])
        except SystemExit as exc:
            rc = int(exc.code or 0)
        err = capsys.readouterr().err.strip()
        assert rc == 2
        assert err.count("\n") == 0 and err.startswith(f"tempering: error: {message}"), err
        assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()

    return check


FakeDist = Callable[..., str]


@pytest.fixture
def fake_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_plugin_env: None) -> Iterator[FakeDist]:
    """``fake_dist(dist, source, ep_name=None, version="1.0")`` writes a plugin module and a
    ``<dist>-<version>.dist-info`` (METADATA + entry_points.txt) into a folder on sys.path:
    a real distribution with a real ``tempering`` entry point, as importlib.metadata sees an
    installed package. Returns the module name."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    made: list[str] = []

    def make(dist: str, source: str, ep_name: str | None = None, version: str = "1.0") -> str:
        module = dist.replace("-", "_") + "_plugin"
        (site / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n", encoding="utf-8")
        (info / "entry_points.txt").write_text(f"[tempering]\n{ep_name or module} = {module}\n", encoding="utf-8")
        made.append(module)
        importlib.invalidate_caches()
        return module

    yield make
    for module in made:
        sys.modules.pop(module, None)


@pytest.fixture(scope="session")
def arithmetic_warmup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The bundled ``arithmetic`` recipe's SFT stage, run once per test session (until 40%
    held-out accuracy: 400-900 steps, 0.5-1 minute on 2 cores) and shared by the slow learning
    tests that start RL from it.

    Returns ``output_dir`` (a finished-warmup run that resumes into the RL stage),
    ``checkpoint`` (the backend state after SFT), ``backend`` (the recipe's backend spec) and
    ``accuracy`` (held-out greedy accuracy after SFT).
    """
    from tempering.training.recipe import find_recipe, read_progress

    out = tmp_path_factory.mktemp("arithmetic_warmup")
    recipe = find_recipe("arithmetic", [f"output_dir={out}", "loggers=[jsonl]"])
    recipe.stages = [s for s in recipe.stages if s.get("id") == "warmup"]  # the full recipe resumes into "rl"
    result = recipe.run()
    progress = read_progress(str(out))
    assert progress is not None and progress["completed"] == ["warmup"]
    return {
        "output_dir": str(out),
        "checkpoint": progress["checkpoint"],
        "backend": dict(recipe.backend),
        "accuracy": result.stages["warmup"]["eval/accuracy"],
    }


@pytest.fixture
def json_server() -> Iterator[Callable[[Callable[..., Any]], str]]:
    """Fake HTTP services for tests (an OpenAI-compatible judge, a scripted reward server), on
    the project's one server stack: ``start(answer) -> base URL``, where ``answer(call)`` gets a
    :class:`~tempering.runs.serving.Call` (``.json`` decoded) and returns a
    :class:`~tempering.runs.serving.Reply`; every server is closed at teardown."""
    from tempering.runs.serving import BackgroundServer, Policy, guarded_app

    servers: list[Any] = []

    def start(answer: Callable[..., Any]) -> str:
        rules = Policy(error_body=lambda status, message: {"error": message}, is_json=lambda *_: True)
        server = BackgroundServer(guarded_app(rules, answer), rules).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.close()
