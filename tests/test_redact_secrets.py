"""A literal secret in a recipe stays out of everything a run writes (issue 24 item 22).

``llm_judge`` accepts a literal ``api_key`` (``api_key_env`` is the documented way); the resolved
recipe, key included, was written to ``run.json`` (which the tracker loggers and ``tempering
view`` read) and printed by ``tempering show``. The judge must still get the real key.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tempering.apps import cli

SECRET = "sk-test-DO-NOT-WRITE-1234567890"

RECIPE = """\
name: judged
output_dir: {out}
backend:
  name: local
  model: tiny_llama
  model_kwargs: {{hidden_size: 16, num_layers: 1, num_heads: 2, intermediate_size: 32}}
  num_threads: 1
loggers: [jsonl]
stages:
  - id: rl
    name: grpo
    dataset: {{name: arithmetic, split: train}}
    reward:
      name: llm_judge
      mode: binary
      base_url: {url}
      api_key: {secret}   # a literal key: works, and is redacted in what the run writes
    steps: 1
    prompts_per_step: 2
    group_size: 2
    max_tokens: 2
"""


@pytest.fixture
def judge(json_server):
    """An OpenAI-compatible judge on loopback that answers YES and records the keys it got."""
    from tempering.runs.serving import Reply

    seen: list[str] = []

    def answer(call):
        seen.append(call.headers.get("authorization") or "")
        return Reply(200, {"choices": [{"message": {"content": "YES"}}]})

    return json_server(answer) + "/v1", seen


def test_a_literal_api_key_is_used_but_never_written(judge, tmp_path, capsys, fresh_registry):
    url, seen = judge
    out = tmp_path / "run"
    recipe = tmp_path / "judged.yaml"
    recipe.write_text(RECIPE.format(out=out, url=url, secret=SECRET), encoding="utf-8")

    assert cli.main(["run", str(recipe)]) == 0
    assert seen and all(h == f"Bearer {SECRET}" for h in seen)  # the judge got the real key
    printed = capsys.readouterr()
    assert SECRET not in printed.out + printed.err

    written = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "run.json" for p in written)
    leaks = [str(p) for p in written if SECRET.encode() in p.read_bytes()]
    assert not leaks, leaks
    info = json.loads((out / "run.json").read_text(encoding="utf-8"))
    assert info["recipe"]["stages"][0]["reward"]["api_key"] == "<redacted>"

    # tempering export/eval rebuild the backend from run.json: a redacted value is left out (the
    # backend's own default, e.g. TINKER_API_KEY), never sent as "<redacted>" (the local backend
    # would reject the key outright)
    from tempering.training.rundata import RunDir, run_backend

    info["recipe"]["backend"]["api_key"] = "<redacted>"
    (out / "run.json").write_text(json.dumps(info), encoding="utf-8")
    with run_backend(RunDir(str(out)), registry=fresh_registry) as (backend, checkpoint):
        assert checkpoint["path"] and backend is not None

    for argv in (["show", str(recipe)], ["show", str(recipe), "stages.rl.steps=2"]):
        assert cli.main(argv) == 0
        shown = capsys.readouterr().out
        assert SECRET not in shown and "api_key: <redacted>" in shown, shown


def test_redact_keeps_variable_names_and_token_counts():
    from tempering.runs.redact import REDACTED, redact, redact_yaml_text

    cfg = {
        "reward": {"name": "llm_judge", "api_key": SECRET, "api_key_env": "JUDGE_API_KEY", "max_tokens": 8},
        "backend": {"name": "tinker", "api_key": None, "eos_token": "</s>"},
        "loggers": [{"name": "x", "password": "p", "hf_token": "h", "judge_api_key": "k"}],
    }
    assert redact(cfg) == {
        "reward": {"name": "llm_judge", "api_key": REDACTED, "api_key_env": "JUDGE_API_KEY", "max_tokens": 8},
        "backend": {"name": "tinker", "api_key": None, "eos_token": "</s>"},
        "loggers": [{"name": "x", "password": REDACTED, "hf_token": REDACTED, "judge_api_key": REDACTED}],
    }
    text = (
        f"a: 1\nreward:\n  api_key: {SECRET}  # mine\n  api_key_env: X\n"
        f"backend: {{name: tinker, api_key: '{SECRET}'}}\n"
    )
    assert redact_yaml_text(text) == (
        "a: 1\nreward:\n  api_key: <redacted>  # mine\n  api_key_env: X\nbackend: {name: tinker, api_key: <redacted>}\n"
    )


def test_the_docs_say_so():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "rewards.md").read_text(encoding="utf-8")
    assert "api_key_env" in docs and "redacted" in docs
