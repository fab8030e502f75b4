"""The ``specialists`` stage and the ``smollm2_specialists`` recipe (docs/systems.md#specialists):
its datasets, routing helpers and config checks; the whole system end to end on a tiny model;
and (slow) learning on SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tempering.algorithms.specialists import routing
from tempering.apps import cli
from tempering.errors import ConfigError
from tempering.plugins.datasets.domain_questions import capital_questions, read_countries, unit_conversions
from tempering.training.recipe import Recipe, find_recipe

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_DATA = REPO / "examples" / "domain_specialists" / "data"


# --------------------------------------------------------------------------- datasets
def test_unit_conversions_are_right_and_test_is_held_out() -> None:
    train, test = unit_conversions("train"), unit_conversions("test")
    assert len(train) + len(test) == 6 * 40 * 2 and 0.1 < len(test) / (len(train) + len(test)) < 0.3
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    factors = {"millimeters/centimeters": 10, "centimeters/meters": 100}
    row = next(r for r in train + test if r["prompt"].startswith("How many millimeters are in 3 centimeters?"))
    assert row["answer"] == "30" and factors
    row = next(r for r in train + test if r["prompt"].startswith("How many kilograms are 7000 grams?"))
    assert row["answer"] == "7"
    assert (
        unit_conversions("test", size=5, seed=1)
        == unit_conversions("test", size=5, seed=1)
        != unit_conversions("test")[:5]
    )


def test_capital_questions_hold_out_countries() -> None:
    train, test = capital_questions("train"), capital_questions("test")
    capitals = dict(read_countries())
    assert len(test) == 40 and len(train) == 60 * 3
    held_out = {c for c in capitals if any(f" {c}?" in r["prompt"] or f" {c}." in r["prompt"] for r in test)}
    assert len(held_out) == 40
    assert not any(f" {c}?" in r["prompt"] or f" {c}." in r["prompt"] for r in train for c in held_out)
    assert all(r["answer"] in capitals.values() for r in train + test)
    with pytest.raises(ValueError, match="split must be"):
        capital_questions("val")


def test_first_domain_named() -> None:
    domains = ("arithmetic", "units", "capitals")
    assert routing.first_domain_named("Units.", domains) == "units"
    assert routing.first_domain_named("This is about a capital, not arithmetic", domains) == "capitals"
    assert routing.first_domain_named("Geography", domains) is None
    assert routing.parse_domain(" Capitals\n", domains) == "capitals"
    assert routing.parse_domain("capital", domains) is None


# --------------------------------------------------------------------------- the recipe and its checks
def test_the_bundled_recipe_is_listed_and_valid() -> None:
    recipe = find_recipe("smollm2_specialists")
    stage = recipe.stages[0]
    assert stage["name"] == "specialists" and list(stage["domains"]) == ["arithmetic", "units", "capitals"]
    assert recipe.backend["model"] == "smollm2" and recipe.backend["num_threads"] == 1


def _tiny_recipe(out: Path, **stage: Any) -> dict[str, Any]:
    chars = json.loads((EXAMPLE_DATA / "meta.json").read_text())["chars"] + "?,"
    spec: dict[str, Any] = {
        "id": "system",
        "name": "specialists",
        "domains": {
            d: {
                "train": {"name": "jsonl", "path": str(EXAMPLE_DATA / d / "train.jsonl")},
                "test": {"name": "jsonl", "path": str(EXAMPLE_DATA / d / "test.jsonl"), "size": 6},
            }
            for d in ("arithmetic", "units", "capitals")
        },
        "train": [{"name": "sft", "steps": 2, "batch_size": 4, "optimizer": {"learning_rate": 1e-3}}],
        "router": {"steps": 2, "batch_size": 4, "prefix": "domain of: "},
        "zero_shot_router": "{domains}? {question}",
        "reward": "exact_match",
        "max_tokens": 4,
        "time_serial": True,
    }
    spec.update(stage)
    return {
        "name": "tiny_specialists",
        "output_dir": str(out),
        "backend": {
            "name": "local",
            "model": "tiny_llama",
            "num_threads": 1,
            "model_kwargs": {
                "hidden_size": 16,
                "num_layers": 1,
                "num_heads": 2,
                "intermediate_size": 32,
                "chars": chars,
            },
        },
        "loggers": ["jsonl"],
        "stages": [spec],
    }


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"domains": {"a": {"train": "arithmetic", "test": "arithmetic"}}}, "stages[0].domains: needs at least two"),
        ({"train": []}, "stages[0].train: a list of stage specs"),
        ({"router": {"stepz": 3}}, "stages[0].router: unknown keys ['stepz']"),
        ({"train": [{"name": "sft", "batch_size": 0}]}, "stages[0].train: the generalist run"),
        ({"router": {"steps": 0}}, "stages[0].router: the router run"),
        ({"router": "yes"}, "stages[0].router: a mapping"),
    ],
)
def test_bad_config_fails_before_anything_runs(tmp_path: Path, change: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        Recipe.from_dict(_tiny_recipe(tmp_path / "r", **change)).run()
    assert message in str(err.value)
    assert not (tmp_path / "r" / "generalist").exists()


def test_the_system_end_to_end_on_a_tiny_model(tmp_path: Path) -> None:
    """Every run trains in its own process and answers the test set; the systems are scored;
    the generalist sees as many samples as the specialists together."""
    out = tmp_path / "run"
    result = Recipe.from_dict(_tiny_recipe(out)).run()
    res = json.loads((out / "results.json").read_text())
    assert set(res["systems"]) == {
        "base model",
        "generalist",
        "oracle + specialists",
        "trained router + specialists",
        "zero-shot base model + specialists",
    }
    assert res["test_counts"] == {"arithmetic": 6, "units": 6, "capitals": 6}
    seen = res["samples_seen"]
    assert seen["generalist"]["total"] == sum(seen[d]["total"] for d in ("arithmetic", "units", "capitals")) == 3 * 8
    for role in ("generalist", "arithmetic", "units", "capitals", "router"):
        assert json.loads((out / role / "progress.json").read_text())["completed"] == (
            ["route"] if role == "router" else ["sft0"]
        )
    t = res["timing"]
    assert t["specialists_parallel_wall_s"] > 0 and t["generalist_wall_s"] > 0 and "router_wall_s" in t
    assert t["specialists_serial_wall_s"] > 0 and (out / "units_serial" / "progress.json").exists()
    assert set(t["specialists_cpu_s"]) == {"arithmetic", "units", "capitals"}
    # the oracle row is the diagonal of the cross-domain table
    for d in ("arithmetic", "units", "capitals"):
        assert res["systems"]["oracle + specialists"][d] == res["cross_domain"][d][d]
    summary = result.stages["system"]
    assert {"eval/base/accuracy", "eval/routed/accuracy", "time/specialists_parallel_s"} <= set(summary)
    assert "| trained router + specialists |" in (out / "results.md").read_text()
    union = [json.loads(line) for line in (out / "data" / "generalist_train.jsonl").read_text().splitlines()]
    counts = {d: sum(r["domain"] == d for r in union) for d in ("arithmetic", "units", "capitals")}
    assert len(set(counts.values())) == 1, counts


# --------------------------------------------------------------------------- learning on SmolLM2
@pytest.mark.systems
@pytest.mark.slow
def test_smollm2_specialists_learn(tmp_path: Path) -> None:
    """The bundled recipe, short: 6 SFT steps per specialist (the generalist 18), 15 test
    questions per domain, a 4-step router. Measured once (seed 0, a loaded 2-core machine,
    403 s): base model 0.0 overall (it answers in sentences, never the bare answer), generalist
    0.40, each specialist on its own domain 0.07 / 0.27 / 0.47 (oracle routing 0.27). With the
    learning rate at 1e-12 (the config refuses 0), run once: every model stays at 0.0 (224 s),
    so both bounds below fail. The router is not asserted: at 4 steps it names one domain."""
    out = tmp_path / "run"
    short = [
        "stages.0.train.0.steps=6",
        "stages.0.router.steps=4",
        "stages.0.domains.arithmetic.test.size=15",
        "stages.0.domains.units.test.size=15",
        "stages.0.domains.capitals.test.size=15",
        "stages.0.zero_shot_router=null",
        "stages.0.time_serial=false",
    ]
    assert cli.main(["run", "smollm2_specialists", *short, "--output-dir", str(out)]) == 0
    systems = json.loads((out / "results.json").read_text())["systems"]
    base = systems["base model"]["overall"]
    assert base <= 0.1, systems
    assert systems["generalist"]["overall"] >= base + 0.2, systems
    assert systems["oracle + specialists"]["overall"] >= base + 0.1, systems
