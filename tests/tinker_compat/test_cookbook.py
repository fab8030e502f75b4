"""tinker-cookbook 0.6.1's loops run unchanged against ``tempering serve-tinker`` serving the real
SmolLM2-135M-Instruct (issue 26): the math_rl CLI with its default loss, the synchronous and
asynchronous RL loops, the supervised loop then RL from its checkpoint, ``weights.download``
and the REST calls. Each runs in a process of its own, bounded at 60 s (measured: 20-35 s each
on two idle cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import MODEL, run_driver

pytestmark = [pytest.mark.extras, pytest.mark.timeout(300)]

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": f"What is {a} + {b}?"}, {"role": "assistant", "content": str(a + b)}]}
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 2), (9, 3), (4, 4), (6, 1)]
]


def result(out: str):
    """What a driver printed as its result (``RESULT <json>``; logs come around it)."""
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT ")).removeprefix("RESULT "))


def checkpoints(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines() if line.strip()]


def steps(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_math_rl_cli_runs_two_steps_with_its_default_loss(served, tmp_path):
    """``python -m tinker_cookbook.recipes.math_rl.train``: defaults but the model, the renderer
    (the cookbook has none for SmolLM2) and the batch (2 groups of 2, not 100 of 4) -- so its
    loss is the default ``stable_reinforce``."""
    log = tmp_path / "math_rl"
    cmd = [
        sys.executable,
        "-m",
        "tinker_cookbook.recipes.math_rl.train",
        f"model_name={MODEL}",
        "renderer_name=role_colon",
        "groups_per_batch=2",
        "group_size=2",
        "max_steps=2",
        "eval_every=0",
        f"log_path={log}",
        "behavior_if_log_dir_exists=delete",
        "lora_rank=8",
    ]
    out = subprocess.run(cmd, env=served.env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "Training completed successfully" in out.stdout + out.stderr
    assert checkpoints(log)[-1]["state_path"].startswith("tinker://")
    assert any("env/all/reward/total" in s for s in steps(log))


def test_rl_sync_with_kl_penalty_and_ppo(served, tmp_path):
    run_driver(served, f"rl_sync({str(tmp_path / 'rl')!r})", tmp_path)
    logged = steps(tmp_path / "rl")
    assert any("env/all/reward/total" in s for s in logged)
    assert len(checkpoints(tmp_path / "rl")) >= 2  # every step, then the final one


def test_rl_async_with_its_defaults(served, tmp_path):
    run_driver(served, f"rl_async({str(tmp_path / 'rl')!r})", tmp_path)
    assert checkpoints(tmp_path / "rl")[-1]["state_path"].startswith("tinker://")


def test_sft_then_rl_from_its_checkpoint_then_download_and_rest(served, tmp_path):
    data = tmp_path / "conversations.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in CONVERSATIONS))
    run_driver(served, f"sft({str(tmp_path / 'sft')!r}, {str(data)!r})", tmp_path)
    assert any("test/nll" in k for s in steps(tmp_path / "sft") for k in s), steps(tmp_path / "sft")
    final = checkpoints(tmp_path / "sft")[-1]
    state, sampler = final["state_path"], final["sampler_path"]

    run_driver(served, f"rl_from({str(tmp_path / 'rl')!r}, {state!r})", tmp_path)
    assert checkpoints(tmp_path / "rl")[-1]["state_path"].startswith("tinker://")

    out = run_driver(served, f"download({state!r}, {str(tmp_path / 'weights')!r})", tmp_path)
    files = result(out)
    assert "adapter_config.json" in files and "adapter_model.safetensors" in files, files
    with pytest.raises(AssertionError, match="cannot be downloaded"):
        run_driver(served, f"download({sampler!r}, {str(tmp_path / 'no')!r})", tmp_path)

    facts = result(run_driver(served, f"rest({state!r})", tmp_path))
    assert facts["renderer"] == "role_colon" and facts["base_model"] == MODEL and facts["lora_rank"] == 8
    assert ["training", state] in facts["checkpoints"] and ["sampler", sampler] in facts["checkpoints"]


# ---------------------------------------------------------------------- issue 34: what the server refused
def test_rl_loop_with_its_default_stable_reinforce(served, tmp_path):
    """``recipes.rl_loop``'s 0s at prompt positions (advantage 0) were refused ("target_tokens[0:n]
    differ from the prompt ... at offset 1"); provenance is now compared where the loss uses it."""
    out = run_driver(served, f"rl_loop({str(tmp_path / 'rl')!r}, 'stable_reinforce')", tmp_path)
    assert "skipping training step" not in out and "Training completed" in out, out[-3000:]
    assert len(steps(tmp_path / "rl")) == 2


def test_rl_loop_with_gspo_and_no_config(served, tmp_path):
    """``rl_loop loss_fn=gspo`` sends no thresholds (was refused: "no documented default")."""
    out = run_driver(served, f"rl_loop({str(tmp_path / 'rl')!r}, 'gspo', max_steps=1)", tmp_path)
    assert "skipping training step" not in out and "Training completed" in out, out[-3000:]


def test_sdft_with_reverse_kl(served, tmp_path):
    """``recipes.sdft.train reverse=true``: its custom loss's forward sends ``(N, K)``
    ``target_tokens`` (was refused); the step logs the reverse KL it trained on."""
    run_driver(served, f"sdft_reverse({str(tmp_path / 'sdft')!r})", tmp_path)
    logged = steps(tmp_path / "sdft")
    assert any("sdft/reverse_kl_loss" in s for s in logged), logged
