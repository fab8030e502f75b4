"""What a run prints about warnings and plugin overrides (issue 24 items 9 and 10).

9: a component's Python warning printed as two lines naming our registry's file
(``.../core/registry.py:300: UserWarning: ...`` and the source line); the CLI prints every
warning as one ``tempering: warning: ...`` line. 10: a third-party plugin registering with
``override=True`` replaced the built-in ``exact_match`` silently; a run now says so at its start,
in one line naming the plugin, the component and how to reach the replaced one.
"""

from __future__ import annotations

import warnings

import pytest

from tempering.apps import cli
from tempering.registry import Registry

PLUGIN = """
    import warnings
    from tempering import hookimpl
    from tempering.plugins.datasets.arithmetic import arithmetic

    def chatty_arithmetic(**kw):
        warnings.warn("chatty: the answers are   sums\\nof two numbers", UserWarning, stacklevel=2)
        warnings.warn("chatty: this dataset is old", DeprecationWarning, stacklevel=2)
        return arithmetic(**kw)

    def always_one(completion, example):
        return 1.0

    @hookimpl
    def register_datasets(register):
        register("chatty_arithmetic", chatty_arithmetic)

    @hookimpl
    def register_rewards(register):
        register("exact_match", lambda: always_one, override=True)
"""

RECIPE = """\
name: w
output_dir: {out}
loggers: []
backend: {{name: local, model: tiny_llama, num_threads: 1,
  model_kwargs: {{hidden_size: 16, num_layers: 1, num_heads: 2, intermediate_size: 32}}}}
stages: [{{id: s, name: sft, steps: 1, batch_size: 4, dataset: {{name: chatty_arithmetic, size: 8}}}}]
"""


@pytest.fixture
def chatty(fake_dist, tmp_path, monkeypatch):
    fake_dist("fake-chatty", PLUGIN, version="2.1")
    reg = Registry()
    monkeypatch.setattr("tempering.registry._default", reg)
    recipe = tmp_path / "w.yaml"
    recipe.write_text(RECIPE.format(out=tmp_path / "out"), encoding="utf-8")
    return reg, recipe


def test_component_warnings_and_the_override_print_one_line_each(chatty, capsys):
    _, recipe = chatty
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # what a fresh CLI process does with each new warning
        assert cli.main(["run", str(recipe)]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert ".py:" not in err and "warnings.warn(" not in err, err
    assert "tempering: warning: chatty: the answers are sums of two numbers" in lines, err
    assert "tempering: warning: DeprecationWarning: chatty: this dataset is old" in lines, err
    [override] = [line for line in lines if "override" in line]
    assert override == (
        "tempering: plugin fake-chatty 2.1 overrides reward 'exact_match' of tempering "
        f"{__import__('tempering').__version__} (override=True); name 'tempering:exact_match' to use the replaced one"
    )


def test_run_recipe_warns_of_the_override_in_python(chatty):
    reg, recipe = chatty
    from tempering.registry import PluginOverrideWarning
    from tempering.training.recipe import find_recipe

    with pytest.warns(PluginOverrideWarning, match=r"fake-chatty 2\.1 overrides reward 'exact_match'"):
        find_recipe(str(recipe), registry=reg).run(registry=reg)


def test_no_override_no_line(fresh_registry):
    assert fresh_registry.overrides() == []


def test_an_empty_warning_still_says_something(capsys):
    """A warning with no text (TinkerBackend.close once raised one) names at least its category."""
    import argparse

    parser_func = lambda args: warnings.warn("", RuntimeWarning, stacklevel=1)
    parser = cli.build_parser()
    original = cli.build_parser
    try:
        cli.build_parser = lambda: parser
        args_ns = argparse.Namespace(func=parser_func)
        cli.parse_args, saved = (lambda p, a: args_ns), cli.parse_args
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            assert cli.main([]) == 0
    finally:
        cli.build_parser, cli.parse_args = original, saved
    assert capsys.readouterr().err.strip() == "tempering: warning: RuntimeWarning: (no message)"
