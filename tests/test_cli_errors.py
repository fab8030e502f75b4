"""Bad input is one line naming the key's path and the fix -- from the CLI, the YAML loader, the
registry and the local backend -- checked before any model is built; and a user's own
``module:function`` reward can be named from a recipe (the ``python`` reward).

Each test reproduces a report: a 29-line TypeError for a misspelt ``model_kwargs`` key, a
minute of hub retries for ``model=tiny_lama``, a YAML scanner traceback, options after the
recipe refused, ``lora: unknown key(s) ['rnk']`` without path or suggestion, a conflict about a
component the user never wrote, strict plugin mode's doubled prefix.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tempering.apps import cli
from tempering.errors import ConfigError, PluginError, TemperingError
from tempering.hookspecs import hookimpl
from tempering.registry import ENV_STRICT, PluginInfo, Registry

TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64}
RECIPE = """\
name: small
output_dir: {out}
backend:
  name: local
  model: tiny_llama
  model_kwargs: {{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}
  num_threads: 1
loggers: []
stages:
  - id: rl
    name: grpo
    dataset: {{name: arithmetic, split: train}}
    reward: exact_match
    steps: 1
    prompts_per_step: 2
    group_size: 2
    max_tokens: 2
"""


@pytest.fixture
def recipe(tmp_path: Path) -> str:
    path = tmp_path / "small.yaml"
    path.write_text(RECIPE.format(out=tmp_path / "run"), encoding="utf-8")
    return str(path)


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Exit status and stderr of ``tempering ARGV`` (argparse errors exit through SystemExit)."""
    try:
        rc = cli.main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    return rc, capsys.readouterr().err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("tempering: error: "), err
    return lines[0].removeprefix("tempering: error: ")


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """No network in tests: the hub lookup answers 'unreachable' and records each call;
    ``from_pretrained`` must never be reached by a name that fails the check."""
    from huggingface_hub import HfApi
    from transformers import AutoModelForCausalLM

    from tempering.plugins.backends.local import model_source

    calls: list[str] = []

    def unreachable(self: object, name: str, **kw: object) -> None:
        calls.append(name)
        raise ConnectionError("[Errno -2] Name or service not known")

    def never(*a: object, **k: object) -> None:
        raise AssertionError("from_pretrained reached: the name was not checked first")

    monkeypatch.setattr(HfApi, "model_info", unreachable)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", never)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    model_source.hub_lookup.cache_clear()
    yield calls
    model_source.hub_lookup.cache_clear()


# ----------------------------------------------------------------------------- local backend
def test_a_misspelt_model_kwargs_key_is_one_line_with_its_path(recipe, capsys, fresh_registry):
    rc, err = run_cli(capsys, "run", recipe, "backend.model_kwargs.hiden_size=64")
    assert rc == 2
    assert one_error_line(err).startswith(
        "backend.model_kwargs.hiden_size: unknown key 'hiden_size'. Did you mean 'hidden_size'? Valid keys: chars, "
    )


def test_model_kwargs_values_are_type_checked_against_the_builder(fresh_registry):
    # tiny_llama's signature has an annotation only TYPE_CHECKING imports: the others still count
    with pytest.raises(ConfigError, match=r"^backend\.model_kwargs\.hidden_size: .*'abc'"):
        fresh_registry.check("backend", {"name": "local", "model_kwargs": {"hidden_size": "abc"}}, "backend")


def test_an_unknown_model_name_fails_at_once_saying_what_it_is_not(fresh_registry, no_hub):
    from tempering.plugins.backends.local.backend import LocalBackend

    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        fresh_registry.check("backend", {"name": "local", "model": "tiny_lama"}, "backend")
    assert str(info.value) == (
        "backend.model: 'tiny_lama' is not a registered model builder (did you mean 'tiny_llama'?), not an "
        "existing folder, and the Hugging Face hub could not be reached to look it up (ConnectionError: [Errno -2] "
        "Name or service not known); fix the name, or download the model and set HF_HUB_OFFLINE=1. "
        "Model builders: gguf, smollm2, tiny_llama, tiny_qwen, tiny_qwen3"
    )
    # built directly: the same check, and the hub is asked once per name, not once per check
    with pytest.raises(ConfigError, match=r"^backend.model: 'tiny_lama' is not a registered model builder"):
        LocalBackend(model="tiny_lama")
    assert no_hub == ["tiny_lama"] and time.perf_counter() - t0 < 5


def test_an_unknown_model_name_offline_is_not_looked_up(fresh_registry, no_hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ConfigError,
        match=r"^backend\.model: 'org/no-such-model' is not a registered model builder, not "
        r"an existing folder, and not in the Hugging Face cache \(HF_HUB_OFFLINE is "
        r"set, so the hub was not asked\)",
    ):
        fresh_registry.check("backend", {"name": "local", "model": "org/no-such-model"}, "backend")
    with pytest.raises(
        ConfigError,
        match=r"'\./runs/x/final' is not a registered model builder, not an existing "
        r"folder, and not a Hugging Face hub id either",
    ):
        fresh_registry.check("backend", {"name": "local", "model": "./runs/x/final"}, "backend")
    assert no_hub == []


def test_a_model_the_hub_does_not_have_is_named_as_such(fresh_registry, no_hub, monkeypatch):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    def not_found(self: object, name: str, **kw: object) -> None:
        exc = RepositoryNotFoundError.__new__(RepositoryNotFoundError)  # its __init__ wants an HTTP response
        exc.args = ("404 Repository Not Found",)
        raise exc

    monkeypatch.setattr(HfApi, "model_info", not_found)
    with pytest.raises(ConfigError, match="and not a model on the Hugging Face hub"):
        fresh_registry.check("backend", {"name": "local", "model": "org/typo-model"}, "backend")


def test_a_folder_is_a_model_only_with_a_config(fresh_registry, no_hub, tmp_path):
    with pytest.raises(ConfigError, match=r"^backend\.model: the folder '.*' holds no config\.json"):
        fresh_registry.check("backend", {"name": "local", "model": str(tmp_path)}, "backend")
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"holds a model but no tokenizer"):
        fresh_registry.check("backend", {"name": "local", "model": str(tmp_path)}, "backend")
    (tmp_path / "tokenizer.json").write_text("{}", encoding="utf-8")
    fresh_registry.check("backend", {"name": "local", "model": str(tmp_path)}, "backend")
    assert no_hub == []


def test_lora_and_dtype_errors_name_the_key_and_suggest(recipe, capsys, fresh_registry):
    rc, err = run_cli(capsys, "run", recipe, "backend.lora.rnk=8")
    assert rc == 2 and one_error_line(err) == (
        "backend.lora.rnk: unknown key 'rnk'. Did you mean 'rank'? Valid keys: alpha, dropout, rank, target_modules"
    )
    with pytest.raises(ConfigError, match=r"^backend\.lora: expected a mapping such as \{rank: 8\}"):
        fresh_registry.check("backend", {"name": "local", "lora": 8}, "backend")
    with pytest.raises(ConfigError, match=r"^backend\.dtype: unknown dtype 'fp8'; choose one of bfloat16, float16"):
        fresh_registry.check("backend", {"name": "local", "dtype": "fp8"}, "backend")


def test_an_unknown_backend_name_has_its_path(fresh_registry):
    with pytest.raises(TemperingError, match=r"^backend\.name: unknown backend 'lcoal'\. Did you mean 'local'\?"):
        fresh_registry.check("backend", {"name": "lcoal"}, "backend")


def test_an_unknown_backend_name_from_the_cli_has_its_path(recipe, capsys, fresh_registry):
    rc, err = run_cli(capsys, "run", recipe, "backend.name=lcoal")
    assert rc == 2 and one_error_line(err).startswith("backend.name: unknown backend 'lcoal'. Did you mean 'local'?")


# ----------------------------------------------------------------------------- YAML and the command line
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "name: x\nstages:\n\t- {name: grpo}\n",
            "bad.yaml:3:1: a tab character; YAML indents with spaces only (replace the tabs with spaces)",
        ),
        (
            "name: x\nstages: [\n",
            "bad.yaml:3:1: while parsing a flow node: expected the node content, but found '<stream end>'",
        ),
        (
            "name: x\nstages:\n  - name: grpo\n   steps: 3\n",
            (
                "bad.yaml:4:4: while parsing a block collection: expected <block end>, but found "
                "'<block mapping start>' (check this line's indentation, and quote values that contain ': ')"
            ),
        ),
        (
            "name: x\nstages: [{name: grpo, steps: 2, steps: 3}]\n",
            "bad.yaml:2:33: duplicate key 'steps' (first on line 2); keep one",
        ),
    ],
)
def test_yaml_errors_are_one_line_with_file_line_and_column(tmp_path, capsys, monkeypatch, text, expected):
    monkeypatch.chdir(tmp_path)
    Path("bad.yaml").write_text(text, encoding="utf-8")
    rc, err = run_cli(capsys, "run", "bad.yaml")
    assert rc == 2 and one_error_line(err) == expected


def test_options_may_follow_the_recipe_and_overrides(recipe, capsys, fresh_registry):
    # overrides after --fresh used to be refused ('unrecognized arguments'): here they reach validation
    rc, err = run_cli(capsys, "run", recipe, "--fresh", "seed=1", "stages.rl.stepz=3")
    assert rc == 2 and one_error_line(err).startswith("stages[0].stepz: unknown key 'stepz'. Did you mean 'steps'?")
    args = cli.parse_args(cli.build_parser(), ["run", recipe, "a=1", "--fresh", "b=2", "--output-dir", "o", "c=3"])
    assert (args.overrides, args.fresh, args.output_dir) == (["a=1", "b=2", "c=3"], True, "o")
    rc, err = run_cli(capsys, "run", recipe, "--fersh")
    assert rc == 2 and err.strip().endswith(
        "tempering run: error: unrecognized arguments: --fersh (did you mean --fresh?)"
    )


# ----------------------------------------------------------------------------- registry errors
def _conflicting_exact_match() -> Registry:
    reg = Registry()

    class Other:
        @hookimpl
        def register_rewards(self, register):
            register("exact_match", lambda: lambda completion, example: 0.0)

    reg.add_plugin(Other(), PluginInfo("other", "other-pkg", "1.0", "other"))
    return reg


def test_a_conflict_names_the_key_that_asked_for_it(clean_plugin_env):
    # an SFT stage's eval names no reward; its default (exact_match) hit a shadowing plugin and the
    # error named no key at all
    with pytest.raises(
        PluginError,
        match=r"^stages\[0\]\.eval\.reward\.name: reward 'exact_match' is registered by "
        r"two packages: 'tempering' .* and 'other-pkg' \(1\.0\)\. Pin one with "
        r"'tempering:exact_match'",
    ):
        _conflicting_exact_match().check("reward", "exact_match", "stages[0].eval.reward")


def test_strict_plugin_mode_is_one_line_without_a_false_promise(fake_dist, monkeypatch, capsys):
    fake_dist("fake-broken", "raise RuntimeError('plugin exploded at import')\n", ep_name="broken")
    monkeypatch.setenv(ENV_STRICT, "1")
    rc, err = run_cli(capsys, "plugins")
    line = one_error_line(err)
    assert rc == 2 and line.startswith(
        "plugin 'broken' (fake-broken 1.0, entry point 'fake_broken_plugin') failed to "
        "load: RuntimeError: plugin exploded at import. Strict mode"
    )
    assert "keep working" not in line and "unset TEMPERING_STRICT_PLUGINS" in line
    monkeypatch.delenv(ENV_STRICT)
    with pytest.warns(RuntimeWarning, match="^tempering: plugin 'broken' .* The other plugins keep working"):
        Registry()


# ----------------------------------------------------------------------------- the python reward
USER_REWARDS = """\
def length(completion, example, scale=1.0):
    return scale * len(completion)

class Judge:
    def __init__(self, strict: bool = False):
        self.strict = strict

    def __call__(self, completion, example):
        return 1.0 if self.strict else 0.5

QUARTER = 0.25
"""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``user_rewards_mod.py`` in the working folder, which is *not* on sys.path (as for the
    ``tempering`` console script)."""
    name = "user_rewards_mod"
    (tmp_path / f"{name}.py").write_text(USER_REWARDS, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p and os.path.abspath(p) != str(tmp_path)])
    monkeypatch.delitem(sys.modules, name, raising=False)
    return name


def test_a_recipe_names_a_users_reward_explicitly(user_module, fresh_registry):
    fn = fresh_registry.build("reward", {"name": "python", "function": f"{user_module}:length"}, "stages[0].reward")
    assert fn("abcd", {}) == 4.0
    bound = fresh_registry.build(
        "reward", {"name": "python", "function": f"{user_module}:length", "params": {"scale": 0.5}}, "stages[0].reward"
    )
    assert bound("abcd", {}) == 2.0 and bound.__name__ == "length"
    judge = fresh_registry.build(
        "reward", {"name": "python", "function": f"{user_module}:Judge", "params": {"strict": True}}, "stages[0].reward"
    )
    assert judge("x", {}) == 1.0


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"function": "no_such_mod_xyz:f"},
            (
                r"^stages\[1\]\.reward\.function: cannot import 'no_such_mod_xyz:f': No "
                r"module named 'no_such_mod_xyz' \(looked in the working folder .* and the"
            ),
        ),
        ({"function": "{mod}:lenght"}, r"^stages\[1\]\.reward\.function: module '{mod}' has no 'lenght'$"),
        (
            {"function": "{mod}"},
            r"^stages\[1\]\.reward\.function: expected 'module:function' \(e\.g\. my_rewards:score\)",
        ),
        ({"function": "{mod}:QUARTER"}, r"^stages\[1\]\.reward\.function: expected a function or class, got a float$"),
        (
            {"function": "{mod}:Judge", "params": {"strct": True}},
            r"^stages\[1\]\.reward\.params\.strct: unknown key 'strct'\. Did you mean 'strict'\?",
        ),
        (
            {"function": "{mod}:length", "params": {"scal": 2}},
            r"^stages\[1\]\.reward\.params: the reward function does not take these params",
        ),
        ({}, r"^stages\[1\]\.reward\.function: missing required key 'function'$"),
    ],
)
def test_python_reward_errors_are_checked_before_building(user_module, fresh_registry, spec, expected):
    spec = {k: v.format(mod=user_module) if isinstance(v, str) else v for k, v in spec.items()}
    with pytest.raises(ConfigError, match=expected.format(mod=user_module)):
        fresh_registry.check("reward", {"name": "python", **spec}, "stages[1].reward")


def test_a_python_reward_trains_from_yaml(user_module, tmp_path, fresh_registry):
    from tempering.training.recipe import Recipe

    path = tmp_path / "r.yaml"
    path.write_text(
        RECIPE.format(out=tmp_path / "run").replace(
            "reward: exact_match", f"reward: {{name: python, function: '{user_module}:Judge'}}"
        ),
        encoding="utf-8",
    )
    result = Recipe.from_yaml(str(path)).run()
    [row] = [r for r in result.history if r["stage"] == "rl"]
    assert row["reward/mean"] == pytest.approx(0.5)


def test_serve_reward_imports_from_the_working_folder(user_module):
    from tempering.plugins.rewards.server import make_server

    server = make_server(f"{user_module}:length")
    try:
        assert server.runner.reward("abc", {}) == 3.0
    finally:
        server.server_close()


def test_the_python_reward_is_documented_and_listed(fresh_registry):
    comp = fresh_registry.get("reward", "python")
    assert "function: my_module:score" in comp.description
    docs = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text(encoding="utf-8")
    assert "name: python" in docs and "TEMPERING_REWARD_TOKEN" in docs


def test_a_config_error_under_fresh_leaves_the_earlier_run_in_place(tmp_path, capsys, fresh_registry):
    """A typo must not move an earlier run aside: every stage's config is checked before the
    run folder is touched. tempering's own warnings print as one line."""
    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: r\noutput_dir: {out}\nloggers: [jsonl]\n"
        "backend: {name: local, model: tiny_llama, num_threads: 1, "
        "model_kwargs: {hidden_size: 16, num_layers: 1, num_heads: 2, intermediate_size: 32}}\n"
        "stages: [{id: s, name: sft, steps: 1, batch_size: 4, dataset: {name: arithmetic, size: 8}}]\n",
        encoding="utf-8",
    )
    rc, _ = run_cli(capsys, "run", str(recipe))
    assert rc == 0 and (out / "metrics.jsonl").exists()
    rc, err = run_cli(capsys, "run", str(recipe), "--fresh", "stages.s.optimizer.learning_rate=-1")
    assert rc == 2 and one_error_line(err).startswith("stages[0].optimizer.learning_rate: must be > 0")
    assert (out / "metrics.jsonl").exists() and not list(tmp_path.glob("out.prev-*"))
    rc, err = run_cli(capsys, "run", str(recipe), "--fresh")
    assert rc == 0 and len(list(tmp_path.glob("out.prev-*"))) == 1
    [warning] = [line for line in err.splitlines() if "starting fresh" in line]
    assert warning.startswith("tempering: starting fresh in ") and ".py:" not in err
