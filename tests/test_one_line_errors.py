"""Bad input is one line, not a traceback (issue 35 item 13): a negative model size (48 lines
before), a jsonl line that is a list (a cryptic TypeError), an unbounded ``prompts_per_step``
(1e12 was accepted and hung), and ``tempering eval`` of a run whose recipe names its data by a
relative path, from another folder (31 lines; now the path resolves against the folder the run
resolved it from, recorded in ``run.json``). SDPO's templates: tests/test_sdpo.py's
``BAD_INPUT``."""

from __future__ import annotations

import json

import pytest

from tempering.apps import cli

RECIPE = """\
name: bad
output_dir: {out}
backend: {{name: local, model: tiny_llama, model_kwargs: {{hidden_size: 32, num_layers: 1, num_heads: 2}}}}
loggers: [jsonl]
stages:
  - {{id: rl, name: grpo, dataset: {{name: arithmetic}}, steps: 1, prompts_per_step: 2, group_size: 2, max_tokens: 2}}
"""


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "backend.model_kwargs.hidden_size=-32",
            "backend.model_kwargs.hidden_size: must be a whole number >= 1, got -32",
        ),
        ("backend.model_kwargs.num_heads=3", "backend.model_kwargs.hidden_size: must be a multiple of num_heads (3)"),
        (
            "stages.rl.prompts_per_step=1000000000000",
            "stages[0].prompts_per_step: 1000000000000 prompts x group_size 2 = 2000000000000 samples a step; "
            "at most 1048576 are allowed",
        ),
    ],
)
def test_bad_values_are_one_line(rejects_before_training, override, message):
    rejects_before_training(RECIPE, override, message)


def test_a_jsonl_line_that_is_a_list_is_one_line(rejects_before_training, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n["1+2=", "3"]\n')
    rejects_before_training(
        RECIPE,
        f"stages.rl.dataset={{name: jsonl, path: {data}}}",
        f"stages[0].dataset: the dataset does not load: ValueError: {data}:2: expected a JSON object of "
        'columns per line, such as {"prompt": "...", "answer": "..."}, got a list',
    )


def test_eval_finds_a_runs_relative_dataset_from_another_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "data").mkdir(parents=True)
    elsewhere.mkdir()
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(6)]
    (project / "data" / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (project / "r.yaml").write_text(
        "name: rel\nbackend: {name: local, model: tiny_llama, model_kwargs: {hidden_size: 32, num_layers: 1}}\n"
        "loggers: [jsonl]\nstages:\n"
        "  - {name: sft, steps: 1, batch_size: 2, dataset: {name: jsonl, path: data/sums.jsonl},\n"
        "     eval: {dataset: {name: jsonl, path: data/sums.jsonl}, max_tokens: 2}}\n"
    )
    monkeypatch.chdir(project)
    assert cli.main(["run", "r.yaml"]) == 0
    assert json.loads((project / "runs" / "rel" / "run.json").read_text())["cwd"] == str(project)
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert cli.main(["eval", str(project / "runs" / "rel")]) == 0, capsys.readouterr().err
    report = json.loads(next((project / "runs" / "rel" / "evals").glob("step*/eval.json")).read_text())
    assert report["metrics"]["examples"] == 6.0
    assert report["spec"]["dataset"]["path"] == str(project / "data" / "sums.jsonl")


def test_eval_of_a_missing_or_bad_dataset_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TEMPERING_PROGRESS", "0")
    model = tmp_path / "model"
    from tempering.plugins.models.tiny import tiny_llama

    m, tok = tiny_llama(hidden_size=32, num_layers=1)
    m.save_pretrained(model)
    tok.save_pretrained(model)
    capsys.readouterr()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("[1, 2]\n")
    for dataset, message in (
        (str(tmp_path / "none.jsonl"), "FileNotFoundError: jsonl dataset: no file at"),
        (str(bad), "got a list"),
    ):
        assert cli.main(["eval", str(model), "--dataset", dataset]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("tempering: error: --dataset: the dataset does not load")
        assert message in err
