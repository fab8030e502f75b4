"""``tempering show`` (issue 24 items 16 and 24): ``--resolved`` prints the recipe with every
component's defaults, and a recipe shown with overrides has passed the checks ``tempering run``
makes before it starts (a key ``run`` rejects is the same one-line error here)."""

from __future__ import annotations

import pytest
import yaml

from tempering.apps import cli
from tempering.registry import get_registry
from tempering.training.recipe import Recipe, check_recipe
from tempering.training.stage import EvalConfig, OptimizerConfig


def show(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["show", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_resolved_shows_every_components_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = show(capsys, "tool_use", "--resolved")
    assert rc == 0
    cfg = yaml.safe_load(out)
    reg = get_registry()
    rl = cfg["stages"][1]
    assert rl["name"] == "grpo" and rl["id"] == "rl"
    # the algorithm's own keys the recipe leaves out
    assert rl["reward_timeout"] == 60.0 and rl["drop_zero_variance"] is False and rl["kl_every"] == 10
    # nested components, written as {name: ..., <their keys>}
    loss_default = reg.get("loss", "grpo").load()
    assert rl["loss"]["name"] == "grpo" and set(rl["loss"]) >= {"epsilon_low", "epsilon_high", "beta"}
    assert rl["advantage"]["name"] == "group_norm" and "eps" in rl["advantage"]
    assert rl["sampler"]["name"] == "environment"
    assert rl["sampler"]["tool_timeout"] == 30.0 and rl["sampler"]["environment"]["name"] == "calculator"
    assert loss_default is not None
    # the stage blocks: every OptimizerConfig / EvalConfig key
    assert set(rl["optimizer"]) == {f for f in OptimizerConfig.__dataclass_fields__}
    assert set(rl["eval"]) == {f for f in EvalConfig.__dataclass_fields__}
    assert rl["optimizer"]["beta2"] == 0.95
    assert isinstance(rl["eval"]["reward"], dict) and "name" in rl["eval"]["reward"]
    # the backend and the loggers
    assert cfg["backend"]["device"] == "cpu" and cfg["backend"]["engine"] == "generate"
    assert all(isinstance(lg, dict) and "output_dir" not in lg for lg in cfg["loggers"])
    assert cfg["loggers"][0] == {"name": "jsonl", "filename": "metrics.jsonl"}


@pytest.mark.parametrize(
    "name",
    [
        "arithmetic",
        "tool_use",
        "agentic_search_dpo",
        "smollm2_math",
        "smollm2_forecast",
        "smollm2_monitor",
        "smollm2_code",
        "smollm2_search",
    ],
)
def test_resolved_recipe_is_one_run_accepts(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """Every key --resolved writes is one the validator accepts, with the value the run used anyway."""
    rc, out, _ = show(capsys, name, "--resolved")
    assert rc == 0
    resolved = yaml.safe_load(out)
    check_recipe(Recipe.from_dict(resolved).to_dict())
    rc, again, _ = show(capsys, name, "--resolved", "seed=0")  # idempotent: resolving it twice adds nothing
    assert rc == 0 and yaml.safe_load(again) == resolved


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("stages.rl.stepz=3", "stages[1].stepz: unknown key 'stepz'. Did you mean 'steps'?"),
        ("stages.rl.reward.case_sensitiv=true", "stages[1].reward.case_sensitiv: unknown key 'case_sensitiv'."),
        ("stages.warmup.optimizer.learning_rate=-1", "stages[0].optimizer.learning_rate: must be > 0"),
        ("checkpoint_every=-1", "checkpoint_every: must be a whole number of steps >= 0"),
        ("backend.devise=cpu", "backend.devise: unknown key 'devise'."),
    ],
)
def test_show_with_overrides_rejects_what_run_rejects(
    capsys: pytest.CaptureFixture[str], override: str, error: str
) -> None:
    for extra in ((), ("--resolved",)):
        rc, out, err = show(capsys, "arithmetic", override, *extra)
        assert rc == 2 and out == ""
        assert err.startswith("tempering: error: " + error) and err.count("\n") == 1, err


def test_resolved_writes_renderer_auto_as_the_models_format(capsys, tmp_path) -> None:
    """Issue 35 item 14: ``renderer: auto`` was shown unresolved. A model declaring its chat
    format shows that renderer with its keys; a model without one keeps ``auto`` (naming
    ``tiny_chat`` there would render its text prompts, which ``auto`` sends raw)."""
    path = tmp_path / "r.yaml"
    stage = "{name: grpo, steps: 1, dataset: {name: arithmetic}}"
    for chat, expected in ((True, {"name": "tiny_chat"}), (False, "auto")):
        path.write_text(
            f"name: r\nbackend: {{name: local, model: tiny_llama, model_kwargs: {{chat: {str(chat).lower()}, "
            f"hidden_size: 32, num_layers: 1}}}}\nstages:\n  - {stage}\n"
        )
        rc, out, err = show(capsys, str(path), "--resolved")
        assert rc == 0, err
        assert yaml.safe_load(out)["stages"][0]["renderer"] == expected


def test_eval_json_records_the_renderer_auto_stood_for(tmp_path, monkeypatch, capsys) -> None:
    import json

    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    path, run = tmp_path / "r.yaml", tmp_path / "run"
    path.write_text(
        "name: r\nbackend: {name: local, model: tiny_llama,\n"
        "  model_kwargs: {chat: true, hidden_size: 32, num_layers: 1}}\n"
        "loggers: [jsonl]\nstages:\n  - {name: sft, steps: 1, batch_size: 2, dataset: {name: arithmetic, size: 4},\n"
        "     eval: {dataset: {name: arithmetic, split: test, size: 2}, max_tokens: 2}}\n"
    )
    assert cli.main(["run", str(path), f"--output-dir={run}"]) == 0
    assert cli.main(["eval", str(run), "--out", str(tmp_path / "ev")]) == 0
    assert json.loads((tmp_path / "ev" / "eval.json").read_text())["spec"]["renderer"] == "tiny_chat"
