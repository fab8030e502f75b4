"""The plugin system as a user meets it: a third-party package found through its entry point,
name conflicts between packages, broken plugins, misspelt hooks, and the CLI's errors.

The template plugin (examples/plugin_template) is pip-installed once into a temporary
``--target`` folder; the checks that need it run in subprocesses with ``PYTHONPATH`` set to
that folder, so it is discovered through ``importlib.metadata`` exactly as after
``pip install``. The other cases write hand-made distributions (a ``*.dist-info`` with an
``entry_points.txt``) into a folder on ``sys.path``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tempering.apps import cli
from tempering.errors import ConfigError, PluginError, UnknownComponentError
from tempering.registry import ENV_LOAD, ENV_STRICT, Registry

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "examples" / "plugin_template"
DIST = "tempering-plugin-template"
TEMPLATE_COMPONENTS = {
    ("reward", "length_penalty"),
    ("advantage", "rank"),
    ("environment", "unit_converter"),
    ("dataset", "unit_questions"),
}


# --------------------------------------------------------------------------- the template package
@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Install a copy of the template (pip builds in the source tree: keep the checkout clean)."""
    root = tmp_path_factory.mktemp("template")
    src = root / "src"
    shutil.copytree(TEMPLATE, src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build", ".pytest_cache"))
    site = root / "site"
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
            str(site),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (site / "tempering_plugin_template" / "plugin.py").exists()
    work = root / "work"
    work.mkdir()
    return {"site": site, "src": src, "work": work}


def run_with_template(
    template: dict[str, Path], args: list[str], load: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with the installed template importable, from a scratch folder."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV_LOAD, ENV_STRICT)}
    env["PYTHONPATH"] = str(template["site"])
    env["TEMPERING_PROGRESS"] = "0"
    if load is not None:
        env[ENV_LOAD] = load
    return subprocess.run(
        [sys.executable, *args], cwd=template["work"], env=env, capture_output=True, text=True, timeout=timeout
    )


def run_script(template: dict[str, Path], code: str, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = run_with_template(template, ["-c", textwrap.dedent(code)], **kw)  # type: ignore[arg-type]
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_plugins_command_lists_the_template_with_its_package(template):
    # The real command, as a user types it; plugin modules must not import torch to list themselves.
    proc = run_script(
        template,
        """
        import sys
        from tempering.apps.cli import main
        rc = main(["plugins"])
        print("torch imported:", "torch" in sys.modules)
        sys.exit(rc)
    """,
    )
    out = proc.stdout
    assert re.search(rf"^template\s+{DIST}\s+0\.1\.0\s+ok$", out, re.M), out
    assert re.search(rf"^reward\s+length_penalty\s+{DIST} 0\.1\.0\s+1 up to max_chars", out, re.M), out
    assert re.search(rf"^advantage\s+rank\s+{DIST} 0\.1\.0\s+centred rank", out, re.M), out
    assert re.search(rf"^environment\s+unit_converter\s+{DIST} 0\.1\.0\s+convert lengths", out, re.M), out
    assert re.search(r"^reward\s+exact_match\s+tempering 0\.1\.0", out, re.M), out  # built-ins are listed too
    assert "CONFLICT" not in out and "FAILED" not in out
    assert "torch imported: False" in out

    proc = run_with_template(template, ["-m", "tempering", "plugins", "--json"])
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    ours = {(c["kind"], c["name"]) for c in data["components"] if c["package"] == DIST}
    assert ours == TEMPLATE_COMPONENTS
    assert all(
        c["plugin"] == "template" and c["version"] == "0.1.0" and not c["conflict"]
        for c in data["components"]
        if c["package"] == DIST
    )
    [plugin] = [p for p in data["plugins"] if p["dist"] == DIST]
    assert (
        plugin["name"] == "template"
        and plugin["module"] == "tempering_plugin_template.plugin"
        and plugin["error"] is None
    )


def test_load_plugins_env_selects_external_plugins(template):
    proc = run_script(
        template,
        """
        import json, os
        from tempering.registry import Registry
        out = {}
        for value in ["", "template", "tempering-plugin-template", "tempering_plugin_template", "someone-else", None]:
            if value is None:
                os.environ.pop("TEMPERING_LOAD_PLUGINS", None)
            else:
                os.environ["TEMPERING_LOAD_PLUGINS"] = value
            reg = Registry()
            out[repr(value)] = {
                "ours": sorted(c.kind + ":" + c.name for c in reg.components()
                               if c.plugin.dist == "tempering-plugin-template"),
                "builtins": sorted(c.kind + ":" + c.name for c in reg.components() if c.plugin.dist == "tempering"),
            }
        print(json.dumps(out))
    """,
    )
    out = json.loads(proc.stdout)
    loaded = ["advantage:rank", "dataset:unit_questions", "environment:unit_converter", "reward:length_penalty"]
    assert {k: v["ours"] for k, v in out.items()} == {
        "''": [],
        "'template'": loaded,
        "'tempering-plugin-template'": loaded,
        "'tempering_plugin_template'": loaded,
        "'someone-else'": [],
        "None": loaded,
    }
    builtins = out["None"]["builtins"]
    assert {"reward:exact_match", "algorithm:grpo", "algorithm:sft", "advantage:group_norm", "backend:local"} <= set(
        builtins
    )
    assert all(v["builtins"] == builtins for v in out.values())  # the selection never hides built-ins

    # and through the CLI
    proc = run_with_template(template, ["-m", "tempering", "plugins", "--json"], load="")
    data = json.loads(proc.stdout)
    assert DIST not in {c["package"] for c in data["components"]}
    assert {"exact_match", "grpo"} <= {c["name"] for c in data["components"]}


# One subprocess runs the checks that need torch (importing it, transformers and building a
# model cost most of this file's time): the components inside recipes on tempering.testing's
# FakeBackend, the environment in a YAML recipe on a tiny chat model, the slow local-backend
# run when selected, then the template's own test suite. Each part records its result or its
# traceback; the tests below assert on them.
PROBE = """
import json, sys, time, traceback
t0 = time.perf_counter()
import torch
from tempering.training.recipe import Recipe
from tempering.registry import Registry

out_dir, results_path, template_src, with_local = sys.argv[1:5]
results = {"seconds": {"imports": time.perf_counter() - t0}}

def part(name):
    def wrap(fn):
        t = time.perf_counter()
        try:
            results[name] = fn()
        except BaseException:  # noqa: BLE001 - report, and let the other parts run
            results[name] = {"error": traceback.format_exc()}
        results["seconds"][name] = time.perf_counter() - t
        return fn
    return wrap

@part("fake")
def _():
    from tempering.testing import FakeBackend

    reg = Registry()
    pairs = [("reward", "length_penalty"), ("advantage", "rank")]
    out = {"providers": {k: reg.get(k, n).plugin.dist for k, n in pairs}}
    reward = reg.build("reward", {"name": "length_penalty", "max_chars": 2, "penalty": 0.25}, "reward")
    out["rewards"] = [reward(t, {}) for t in ["ab", "abc", "abcdef"]]
    rank = reg.build("advantage", "rank", "advantage")
    out["ranks"] = rank(torch.tensor([1.0, 3.0, 2.0, 5.0, 5.0]), torch.tensor([0, 0, 0, 1, 1])).tolist()
    recipe = Recipe.from_dict({
        "name": "template_fake", "output_dir": out_dir + "/fake", "loggers": ["jsonl"],
        "stages": [{"name": "grpo", "id": "rl", "steps": 2, "prompts_per_step": 2, "group_size": 4,
                    "max_tokens": 8, "dataset": {"name": "arithmetic", "size": 8},
                    "reward": {"name": "length_penalty", "max_chars": 1, "penalty": 0.25},
                    "advantage": {"name": "rank", "scale": 2.0}}],
    })
    backend = FakeBackend(complete=lambda prompt, i: "9" * (i + 1))  # lengths 1..4 in every group
    result = recipe.run(registry=reg, backend=backend)
    out.update(stage=result.stages["rl"], components=result.metadata["components"], steps=backend.step,
               advantages=[[d.advantages[-1] for d in b.data] for b in backend.batches])
    return out

ENV_RECIPE = '''
name: template_env
output_dir: {out}
loggers: [jsonl]
backend:
  name: local
  model: tiny_llama
  model_kwargs: {{chat: true, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64,
                  max_position_embeddings: 128}}
  num_threads: 1
stages:
  - id: rl
    name: grpo
    steps: 2
    prompts_per_step: 2
    group_size: 2
    max_tokens: 6
    optimizer: {{learning_rate: 1.0e-2}}
    dataset:
      - {{question: "how many m is 3 km?", answer: 3000}}
      - {{question: "how many cm is 2 m?", answer: 200}}
    sampler: {{name: environment, environment: unit_converter, max_turns: 2}}
'''

@part("environment")
def _():
    path = out_dir + "/template_env.yaml"
    with open(path, "w") as fh:
        fh.write(ENV_RECIPE.format(out=out_dir + "/env"))
    result = Recipe.from_yaml(path).run()
    rows = [json.loads(line) for line in open(out_dir + "/env/metrics.jsonl")]
    return {"components": result.metadata["components"], "steps": [r for r in rows if "env/turns_mean" in r]}

@part("local")
def _():
    if with_local != "1":
        return {"missing": "not selected"}
    import tempering.plugins.backends.local.backend  # noqa: F401 - an import error is this part's error
    recipe = Recipe.from_dict({
        "name": "template_local", "output_dir": out_dir + "/local", "loggers": ["jsonl"], "max_total_steps": 2,
        "backend": {"name": "local", "model": "tiny_llama"},
        "stages": [{"name": "grpo", "id": "rl", "steps": 5, "prompts_per_step": 2, "group_size": 4,
                    "max_tokens": 4, "dataset": {"name": "arithmetic", "size": 8},
                    "reward": {"name": "length_penalty", "max_chars": 2}, "advantage": "rank"}],
    })
    result = recipe.run()
    return {"components": result.metadata["components"], "stages": list(result.stages)}

@part("own_tests")
def _():
    import pytest
    return {"exit": int(pytest.main(["-q", "-p", "no:cacheprovider", template_src]))}

with open(results_path, "w") as fh:
    json.dump(results, fh)
"""


@pytest.fixture(scope="module")
def probe(template: dict[str, Path], request: pytest.FixtureRequest) -> dict[str, dict]:
    out = template["work"] / "probe"
    # train on the local backend only when its (slow) test is selected
    local = any(item.name == "test_template_components_train_on_the_local_backend" for item in request.session.items)
    proc = run_with_template(
        template,
        ["-c", PROBE, str(out), str(template["work"] / "probe.json"), str(template["src"]), "1" if local else "0"],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((template["work"] / "probe.json").read_text())
    results["own_tests"]["stdout"] = proc.stdout
    results["out"] = {"dir": str(out)}
    return results


def _ok(part: dict) -> dict:
    assert "error" not in part, part["error"]
    return part


def _step_rows(path: Path) -> list[int]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["step"] for r in rows if "reward/mean" in r]


def test_template_components_resolve_by_name_and_train_in_a_recipe(probe):
    """Both components found through the registry by name, built from config, and used by a real
    GRPO stage (on tempering.testing's FakeBackend, which needs no model)."""
    out = _ok(probe["fake"])
    assert out["providers"] == {"reward": DIST, "advantage": DIST}
    assert out["rewards"] == [1.0, 0.75, 0.0]
    assert out["ranks"] == pytest.approx([-0.5, 0.5, 0.0, 0.0, 0.0])
    assert out["steps"] == 2
    # rewards 1, .75, .5, .25 in each group -> ranks 3..0 -> 2 * (rank/3 - 1/2)
    assert out["advantages"] == [pytest.approx([1.0, 1 / 3, -1 / 3, -1.0] * 2)] * 2
    assert out["stage"]["reward/mean"] == pytest.approx(0.625)
    assert out["components"]["reward:length_penalty"] == f"{DIST} 0.1.0"
    assert out["components"]["advantage:rank"] == f"{DIST} 0.1.0"
    assert _step_rows(Path(probe["out"]["dir"]) / "fake" / "metrics.jsonl") == [1, 2]


@pytest.mark.slow
def test_template_components_train_on_the_local_backend(probe):
    out = _ok(probe["local"])  # the local backend is a core dependency: failing to import it fails here
    assert out["stages"] == ["rl"]
    assert out["components"]["reward:length_penalty"] == f"{DIST} 0.1.0"
    assert out["components"]["advantage:rank"] == f"{DIST} 0.1.0"
    assert _step_rows(Path(probe["out"]["dir"]) / "local" / "metrics.jsonl") == [1, 2]  # max_total_steps = 2


def test_template_environment_runs_from_yaml_by_its_registered_name(probe):
    """``sampler: {name: environment, environment: unit_converter}`` in a YAML recipe: the
    environment is found through the installed entry point and GRPO trains on its episodes."""
    out = _ok(probe["environment"])
    assert out["components"]["environment:unit_converter"] == f"{DIST} 0.1.0"
    assert out["components"]["sampler:environment"].startswith("tempering ")
    steps = out["steps"]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["reward/failed"] == 0.0
        assert 1.0 <= r["env/turns_mean"] <= 2.0 and r["env/model_calls"] >= 1.0
        assert sum(v for k, v in r.items() if k.startswith("env/stop/")) == pytest.approx(1.0)


def test_template_own_tests_pass_against_the_installed_package(probe):
    out = _ok(probe["own_tests"])
    assert out["exit"] == 0, out["stdout"]
    assert re.search(r"\b7 passed\b", out["stdout"]) and "skipped" not in out["stdout"], out["stdout"]


# --------------------------------------------------------------------------- unknown names
def test_unknown_component_lists_known_names_and_suggests(fresh_registry):
    with pytest.raises(UnknownComponentError) as err:
        fresh_registry.get("reward", "exact_mach")
    msg = str(err.value)
    assert msg.startswith("unknown reward 'exact_mach'. Did you mean 'exact_match'?")
    assert re.search(r"^Known rewards: .*\bexact_match \(tempering\)", msg, re.M)
    assert "pip install" in msg and "tempering plugins" in msg

    with pytest.raises(UnknownComponentError) as err:
        fresh_registry.get("advantage", "zzz")
    msg = str(err.value)
    assert "Did you mean" not in msg
    for name in ("group_norm", "dr_grpo", "rloo"):
        assert f"{name} (tempering)" in msg
    assert "exact_match" not in msg  # only names of the kind asked for

    # built through a recipe path, the error says where the name was written
    with pytest.raises(UnknownComponentError, match=r"^stages\[1\]\.reward\.name: unknown reward 'exact_mach'"):
        fresh_registry.build("reward", {"name": "exact_mach"}, "stages[1].reward")
    with pytest.raises(PluginError, match=r"unknown component kind 'rewards'; kinds are: backend, sampler, reward"):
        fresh_registry.get("rewards", "exact_match")


# --------------------------------------------------------------------------- conflicts
TWO_REWARDS = """
    from tempering import hookimpl

    def score_{tag}(completion, example):
        return {value}

    @hookimpl
    def register_rewards(register):  # targets are factories: called with the config keys
        register("shared", lambda: score_{tag}, description="{tag}'s shared reward")
        register("only_{tag}", lambda: score_{tag})
"""


def test_same_name_from_two_packages_is_an_error_naming_both(fake_dist, capsys, monkeypatch):
    fake_dist("fake-a", TWO_REWARDS.format(tag="a", value=1.0), version="1.0")
    fake_dist("fake-b", TWO_REWARDS.format(tag="b", value=2.0), version="2.5")
    reg = Registry()
    assert {"only_a", "only_b", "shared", "exact_match"} <= set(reg.names("reward"))
    with pytest.raises(PluginError) as err:
        reg.get("reward", "shared")
    assert str(err.value) == (
        "reward 'shared' is registered by two packages: 'fake-a' (1.0) and 'fake-b' (2.5). Pin one with "
        "'fake-a:shared' or 'fake-b:shared', uninstall one of them, or have the replacement register with "
        "override=True."
    )
    assert [[c.plugin.dist for c in comps] for comps in reg.conflicts()] == [["fake-a", "fake-b"]]

    # dist:name pins a provider (names compare like pip's: fake_b is fake-b)
    assert reg.get("reward", "fake-a:shared").plugin.dist == "fake-a"
    assert reg.build("reward", {"name": "fake-b:shared"}, "reward")("x", {}) == 2.0
    assert reg.build("reward", "fake_b:shared", "reward")("x", {}) == 2.0
    assert reg.build("reward", "only_a", "reward")("x", {}) == 1.0  # unique names need no pin
    with pytest.raises(UnknownComponentError, match="unknown reward 'fake-c:shared'"):
        reg.get("reward", "fake-c:shared")

    monkeypatch.setattr("tempering.registry._default", reg)
    assert cli.main(["plugins", "--kind", "reward"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^reward\s+shared \(CONFLICT\)\s+fake-a 1\.0\s+a's shared reward$", out, re.M), out
    assert re.search(r"^reward\s+shared \(CONFLICT\)\s+fake-b 2\.5\s+b's shared reward$", out, re.M), out
    assert not re.search(r"only_a \(CONFLICT\)", out)


def test_override_replaces_a_builtin_and_pinning_still_reaches_it(fake_dist):
    fake_dist(
        "fake-override",
        """
        from tempering import hookimpl

        def always_one(completion, example):
            return 1.0

        @hookimpl
        def register_rewards(register):
            register("exact_match", lambda: always_one, override=True)
    """,
    )
    reg = Registry()
    assert reg.conflicts() == []
    assert reg.get("reward", "exact_match").plugin.dist == "fake-override"
    assert reg.build("reward", "exact_match")("wrong", {"answer": "right"}) == 1.0
    assert reg.build("reward", "tempering:exact_match")("wrong", {"answer": "right"}) == 0.0


def test_shadowing_a_builtin_without_override_is_a_conflict(fake_dist):
    fake_dist(
        "fake-shadow",
        """
        from tempering import hookimpl

        @hookimpl
        def register_rewards(register):
            register("exact_match", lambda completion, example: 1.0)
    """,
    )
    reg = Registry()
    with pytest.raises(
        PluginError, match=r"registered by two packages: 'fake-shadow' \(1\.0\) and 'tempering' \(0\.1\.0\)"
    ):
        reg.get("reward", "exact_match")


# --------------------------------------------------------------------------- broken plugins
GOOD = """
    from tempering import hookimpl

    @hookimpl
    def register_rewards(register):
        register("good", lambda: (lambda completion, example: 0.5))
"""


def test_a_plugin_that_fails_to_import_warns_and_the_rest_keep_working(fake_dist, capsys, monkeypatch):
    fake_dist("fake-broken", "import not_a_real_module_xyz\n", ep_name="broken", version="0.3")
    fake_dist("fake-good", GOOD)
    with pytest.warns(RuntimeWarning) as record:
        reg = Registry()
    [warning] = [str(w.message) for w in record if "fake-broken" in str(w.message)]
    assert warning.startswith(
        "tempering: plugin 'broken' (fake-broken 0.3, entry point 'fake_broken_plugin') failed to load: "
        "ModuleNotFoundError: No module named 'not_a_real_module_xyz'."
    )
    assert f"exclude it with {ENV_LOAD}" in warning
    assert reg.build("reward", "good")("x", {}) == 0.5  # the other plugin works
    assert reg.get("reward", "exact_match").plugin.dist == "tempering"  # and the built-ins
    [failed] = [p for p in reg.plugins if p.error]
    assert (failed.name, failed.dist, failed.version) == ("broken", "fake-broken", "0.3")

    with pytest.raises(
        UnknownComponentError,
        match=r"Note: these plugins failed to load and may provide it: "
        r"fake-broken:broken \(ModuleNotFoundError",
    ):
        reg.get("reward", "from_the_broken_one")

    monkeypatch.setattr("tempering.registry._default", reg)
    assert cli.main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert re.search(
        r"^broken\s+fake-broken\s+0\.3\s+FAILED: ModuleNotFoundError: No module named "
        r"'not_a_real_module_xyz'$",
        out,
        re.M,
    ), out


def test_strict_mode_makes_a_broken_plugin_an_error(fake_dist, monkeypatch):
    fake_dist("fake-broken", "raise RuntimeError('plugin exploded at import')\n", ep_name="broken")
    monkeypatch.setenv(ENV_STRICT, "1")
    with pytest.raises(
        PluginError, match=r"plugin 'broken' \(fake-broken 1\.0, .*RuntimeError: plugin exploded at import"
    ):
        Registry()
    monkeypatch.delenv(ENV_STRICT)
    with pytest.raises(PluginError, match="plugin exploded at import"):
        Registry(strict=True)
    with pytest.warns(RuntimeWarning, match="plugin exploded at import"):
        Registry()


def test_a_hook_that_raises_is_reported_once(fake_dist):
    fake_dist(
        "fake-raising",
        """
        from tempering import hookimpl

        @hookimpl
        def register_rewards(register):
            register("before_the_error", lambda completion, example: 0.0)
            raise RuntimeError("boom")
    """,
        ep_name="raising",
    )
    with pytest.warns(
        RuntimeWarning, match=r"plugin 'raising' .*failed to load: register_rewards raised RuntimeError: boom"
    ):
        reg = Registry()
    assert [p.error for p in reg.plugins if p.dist == "fake-raising"] == ["register_rewards raised RuntimeError: boom"]


def test_a_misspelt_hook_is_a_failure_not_silence(fake_dist, monkeypatch):
    fake_dist(
        "fake-typo",
        """
        from tempering import hookimpl

        @hookimpl
        def register_reward(register):  # missing "s"
            register("typo_reward", lambda completion, example: 0.0)

        @hookimpl
        def register_advantages(register):
            register("typo_advantage", lambda rewards, group_ids: rewards)
    """,
        ep_name="typo",
    )
    fake_dist("fake-good", GOOD)
    with pytest.warns(RuntimeWarning) as record:
        reg = Registry()
    [warning] = [str(w.message) for w in record if "fake-typo" in str(w.message)]
    assert "plugin 'typo' (fake-typo 1.0" in warning and "invalid hook: " in warning
    assert "unknown hook 'register_reward'" in warning
    # the plugin is not half-registered, the others are unaffected
    assert "typo_advantage" not in reg.names("advantage") and "typo_reward" not in reg.names("reward")
    assert "good" in reg.names("reward")
    assert [p.name for p in reg.plugins if p.error] == ["typo"]

    monkeypatch.setenv(ENV_STRICT, "1")
    with pytest.raises(PluginError, match="unknown hook 'register_reward'"):
        Registry()


def test_a_hook_with_the_wrong_argument_name_is_a_failure(fake_dist):
    fake_dist(
        "fake-args",
        """
        from tempering import hookimpl

        @hookimpl
        def register_rewards(reg):
            reg("x", lambda completion, example: 0.0)
    """,
        ep_name="args",
    )
    with pytest.warns(RuntimeWarning, match=r"plugin 'args' .*invalid hook: .*register_rewards"):
        reg = Registry()
    assert "x" not in reg.names("reward")


def test_registering_the_same_plugin_twice_is_reported(fresh_registry):
    from tempering.algorithms.grpo import plugin as grpo_plugin

    with pytest.warns(RuntimeWarning, match=r"plugin 'grpo' .*failed to load: already registered"):
        info = fresh_registry.add_plugin(grpo_plugin, next(p for p in fresh_registry.plugins if p.name == "grpo"))
    assert info.name == "grpo"
    assert fresh_registry.get("loss", "grpo").plugin.dist == "tempering"  # the first registration is untouched
    with pytest.raises(PluginError, match="already registered"):
        Registry(strict=True).add_plugin(grpo_plugin)  # already loaded from its entry point


# --------------------------------------------------------------------------- the CLI's errors
def _yaml_recipe(tmp_path: Path) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(
        textwrap.dedent(f"""
        name: cli_demo
        output_dir: {tmp_path / "out"}
        stages:
          - {{id: warmup, name: sft, steps: 10}}
          - {{id: rl, name: grpo, steps: 10, reward: exact_match}}
    """),
        encoding="utf-8",
    )
    return path


@pytest.mark.parametrize(
    "override, message",
    [
        ("stages.rl.steps", "override 'stages.rl.steps' is not of the form key=value (e.g. stages.rl.steps=10)"),
        ("=3", "override '=3' has an empty key"),
        ("stages.nope.steps=3", "stages.nope: no item 'nope' in this list; use an index or one of: warmup, rl"),
        ("stages.7.steps=3", "stages.7: index 7 out of range (the list has 2 items)"),
        ("seed.x=1", "seed.x: cannot set 'seed.x': 'seed' is a value (0), not a mapping"),
        ("sed=1", "sed: unknown top-level key 'sed'. Did you mean 'seed'?"),
        ("seed=abc", "seed: Value 'abc' of type 'str' could not be converted to Integer"),
    ],
)
def test_cli_bad_overrides_print_one_line_and_exit_2(fresh_registry, tmp_path, capsys, override, message):
    path = _yaml_recipe(tmp_path)
    path.write_text(path.read_text().replace("name: cli_demo", "name: cli_demo\nseed: 0"), encoding="utf-8")
    assert cli.main(["run", str(path), override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tempering: error: {message}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_cli_overrides_reach_the_recipe(fresh_registry, tmp_path, monkeypatch, capsys):
    from tempering.training import recipe as recipe_module

    ran = []

    def fake_run(self, registry=None, backend=None):
        ran.append(self)
        return recipe_module.RunResult(str(self.output_dir), {"rl": {"reward/mean": 0.5}}, [], {})

    monkeypatch.setattr(recipe_module.Recipe, "run", fake_run)
    path = _yaml_recipe(tmp_path)
    args = [
        "run",
        str(path),
        "stages.rl.steps=3",
        "stages.0.steps=4",
        "stages.1.reward.answer_key=sum",
        "seed=7",
        "--output-dir",
        str(tmp_path / "elsewhere"),
        "--fresh",
    ]
    assert cli.main(args) == 0
    [recipe] = ran
    assert [s["steps"] for s in recipe.stages] == [4, 3]
    # a component given by name keeps its name when a key is set on it
    assert recipe.stages[1]["reward"] == {"name": "exact_match", "answer_key": "sum"}
    assert (recipe.seed, recipe.output_dir, recipe.resume) == (7, str(tmp_path / "elsewhere"), False)
    assert "rl: reward/mean=0.5" in capsys.readouterr().out


def test_cli_unknown_recipe_is_one_line_listing_known_ones(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (ENV_LOAD, ENV_STRICT)}
    proc = subprocess.run(
        [sys.executable, "-m", "tempering", "run", "nonexistent"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("tempering: error: unknown recipe 'nonexistent'. Known recipes: ")
    assert "arithmetic (tempering)" in lines[0]


def test_cli_misspelt_recipe_name_and_missing_file(fresh_registry, tmp_path, capsys):
    assert cli.main(["run", "arithmtic"]) == 2
    assert "Did you mean 'arithmetic'" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"tempering: error: recipe file '{tmp_path / 'missing.yaml'}' does not exist\n"


# --------------------------------------------------------------------------- unknown config keys
def _run_until_config_error(registry: Registry, tmp_path: Path, stages: list[dict], **top: object) -> ConfigError:
    from tempering.testing import FakeBackend
    from tempering.training.recipe import Recipe

    backend = FakeBackend()
    recipe = Recipe.from_dict({"name": "t", "output_dir": str(tmp_path), "loggers": [], "stages": stages, **top})
    with pytest.raises(ConfigError) as err:
        recipe.run(registry=registry, backend=backend)
    assert backend.step == 0, "the error must come before any training step"
    return err.value


def test_unknown_config_keys_fail_with_their_path(fresh_registry, tmp_path):
    from tempering.training.recipe import Recipe

    with pytest.raises(ConfigError) as err:
        Recipe.from_dict({"stages": [{"name": "grpo"}], "sed": 3})
    assert err.value.path == "sed" and str(err.value).startswith(
        "sed: unknown top-level key 'sed'. Did you mean 'seed'?"
    )

    # inside a stage -- and in a later stage, before the earlier one trains
    err = _run_until_config_error(fresh_registry, tmp_path, [{"name": "sft", "steps": 1}, {"name": "grpo", "stepz": 3}])
    assert err.path == "stages[1].stepz"
    assert str(err).startswith("stages[1].stepz: unknown key 'stepz'. Did you mean 'steps'? Valid keys: ")
    assert "reward" in str(err).partition("Valid keys: ")[2].split(", ")

    # inside a component nested in a stage
    err = _run_until_config_error(
        fresh_registry, tmp_path, [{"name": "grpo", "id": "rl", "reward": {"name": "exact_match", "answr_key": "sum"}}]
    )
    assert err.path == "stages[0].reward.answr_key"
    assert str(err).startswith(
        "stages[0].reward.answr_key: unknown key 'answr_key'. Did you mean 'answer_key'? Valid keys: answer_key, "
    )

    # inside a stage's optimizer block
    err = _run_until_config_error(fresh_registry, tmp_path, [{"name": "grpo", "optimizer": {"learnig_rate": 1e-3}}])
    assert err.path == "stages[0].optimizer.learnig_rate"
    assert "unknown key 'learnig_rate'. Did you mean 'learning_rate'?" in str(err)

    # a wrong type names its path too
    err = _run_until_config_error(fresh_registry, tmp_path, [{"name": "grpo", "steps": "many"}])
    assert err.path == "stages[0].steps" and "could not be converted to Integer" in str(err)


# --------------------------------------------------------------------------- docs
def test_every_hook_and_env_var_is_documented():
    from tempering import hookspecs

    docs = {
        name: (REPO / "docs" / name).read_text(encoding="utf-8") for name in ("architecture.md", "writing-a-plugin.md")
    }
    for kind, hook in hookspecs.KINDS.items():
        assert callable(getattr(hookspecs, hook)) and getattr(hookspecs, hook).__doc__
        for name, text in docs.items():
            assert f"`{hook}`" in text, f"docs/{name} does not mention the hook {hook}"
        assert f"| `{kind}` | `{hook}` |" in docs["architecture.md"]
    for var in (ENV_LOAD, ENV_STRICT):
        assert var in docs["writing-a-plugin.md"] and var in docs["architecture.md"]


def test_a_default_never_conflicts_with_a_plugin_the_user_did_not_name(fake_dist, tmp_path, monkeypatch):
    """A plugin shadowing ``exact_match`` (without override) must not break a recipe that never
    wrote ``exact_match``: the eval's and RL stages' default reward is the built-in, pinned.
    Naming it is still a conflict to resolve."""
    fake_dist(
        "fake-shadow-em",
        """
        from tempering import hookimpl

        @hookimpl
        def register_rewards(register):
            register("exact_match", lambda: (lambda completion, example: 0.5))
    """,
    )
    from tempering.registry import get_registry
    from tempering.training.recipe import Recipe

    monkeypatch.setattr("tempering.registry._default", Registry())
    tiny = {
        "name": "local",
        "model": "tiny_llama",
        "num_threads": 1,
        "model_kwargs": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32},
    }
    ev = {"dataset": {"name": "arithmetic", "split": "test", "size": 4}, "max_tokens": 3}
    stage = {"name": "sft", "steps": 1, "batch_size": 4, "dataset": {"name": "arithmetic", "size": 8}, "eval": ev}
    result = Recipe(name="d", output_dir=str(tmp_path / "a"), loggers=[], backend=tiny, stages=[stage]).run()
    assert "eval/accuracy" in result.stages["sft"]
    named = {**stage, "eval": {**ev, "reward": "exact_match"}}
    with pytest.raises(
        PluginError, match=r"^stages\[0\]\.eval\.reward\.name: reward 'exact_match' is registered by two"
    ):
        Recipe(name="d", output_dir=str(tmp_path / "b"), loggers=[], backend=tiny, stages=[named]).run(get_registry())
