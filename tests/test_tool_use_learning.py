"""The tool-use demo (``tempering run tool_use``): its task, its environment, and that it learns.

Fast tests check the pieces with a scripted "model" (a sampling client that says what the test
wrote, rendered by ``tiny_chat``) playing real episodes of the registered ``calculator``
environment through the real ``environment`` sampler: the reference solution scores 1 and is
tokenized exactly like its SFT transcript; a miscopied call or answer scores 0 and shows in the
tool-use counts.

The slow tests run the bundled recipe itself: its SFT warmup once per module
(:func:`tool_use_warmup`), then its RL stage shortened to 20 steps, resumed from that warmup --
once as written (``grpo``) and once as the asynchronous ``offpolicy`` stage with rollouts up to
2 steps stale. Both must raise held-out greedy accuracy (300 held-out tasks, whole episodes)
clearly above where SFT left it. Measured numbers and how the bound was chosen are in
docs/tool_use.md.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from tempering.plugins.datasets.tool_use import calculator_tools, tool_use
from tempering.registry import get_registry
from tempering.rollouts.rollout import SamplerContext, collect
from tempering.training.recipe import find_recipe, read_progress
from tempering.types import Completion, SamplingParams

#: Held-out accuracy GRPO / off-policy RL must add to the SFT warmup's in 20 steps. Measured
#: gains over seeds 0-2 were +0.21 to +0.31 (docs/tool_use.md); training that does not change
#: the weights (learning rate 0, a reward that is always 0) gains exactly 0.
MIN_GAIN = 0.10
RL_STEPS = 20


# --------------------------------------------------------------------------- fast: the pieces
def test_splits_are_deterministic_disjoint_and_correct() -> None:
    train, test = tool_use("train"), tool_use("test")
    assert (len(train), len(test)) == (5000, 500)
    assert tool_use("test", size=20) == test[:20]  # same seed, same rows
    assert not {t["question"] for t in train} & {t["question"] for t in test}
    for t in test[:50]:
        a, b = map(int, t["question"].split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert t["answer"] == str(a * b) and t["calls"] == [["mul", {"a": a, "b": b}]]
    with pytest.raises(ValueError, match="split must be"):
        tool_use("validation")
    with pytest.raises(ValueError, match="exceeds"):
        tool_use(low=10, high=20, test_size=100, train_size=100)


def test_transcripts_offer_exactly_the_environments_tools() -> None:
    from tempering.plugins.environments.calculator import Calculator

    [row] = tool_use("train", size=1, transcripts=True)
    assert row["tools"] == [t.spec() for t in Calculator().tools()] == calculator_tools()
    roles = [m["role"] for m in row["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    assert row["messages"][2]["content"] == row["messages"][3]["content"]  # the answer is the tool's result


@pytest.fixture(scope="module")
def renderer() -> Any:
    from tempering.plugins.models.tiny import tiny_llama

    _, tokenizer = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    return get_registry().build("renderer", "tiny_chat", "renderer", tokenizer=tokenizer)


class Scripted:
    """A sampling client whose model answers the episode asking ``question`` with
    ``turns[question][k]`` at its ``k``-th turn (an assistant message, rendered as the model
    would emit it)."""

    def __init__(self, renderer: Any, turns: dict[str, list[dict[str, Any]]]) -> None:
        self.renderer, self.turns = renderer, turns

    def sample(self, prompts: list[list[int]], num_samples: int, params: SamplingParams) -> Future:
        out = []
        for prompt in prompts:
            question = self.renderer.decode(prompt).split("<|user|>")[1].split("<|assistant|>")[0]
            turn = prompt.count(self.renderer.role_ids["assistant"]) - 1
            tokens = self.renderer.render_response(self.turns[question][turn])
            out.append([Completion(list(prompt), tokens, [-0.1] * len(tokens), "stop")])
        done: Future = Future()
        done.set_result(out)
        return done


def play(renderer: Any, tasks: list[dict[str, Any]], turns: dict[str, list[dict[str, Any]]]) -> list[Any]:
    """One episode per task through the registered ``environment`` sampler; the samples."""
    reg = get_registry()
    context = SamplerContext(
        renderer.tokenizer,
        lambda: renderer,
        None,
        build=lambda kind, spec, key: reg.build(kind, spec, key),
        factory=lambda kind, spec, key: reg.factory(kind, spec, key),
    )
    spec = {"name": "environment", "environment": "calculator", "max_turns": 3}
    sampler = reg.build("sampler", spec, "sampler", context=context)
    rollout = collect(sampler, Scripted(renderer, turns), tasks, 1, SamplingParams(max_tokens=20, temperature=0.0))
    return [g.samples[0] for g in rollout.groups]


def call(a: Any, b: Any) -> dict[str, Any]:
    calls = [{"type": "function", "function": {"name": "mul", "arguments": {"a": a, "b": b}}}]
    return {"role": "assistant", "content": "", "tool_calls": calls}


def say(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def test_the_reference_solution_scores_1_and_tokenizes_like_its_sft_transcript(renderer: Any) -> None:
    tasks = tool_use("test", size=4)
    transcripts = tool_use("test", size=4, transcripts=True)
    turns = {
        t["question"]: [m for m in tr["messages"] if m["role"] == "assistant"] for t, tr in zip(tasks, transcripts)
    }
    for sample, tr in zip(play(renderer, tasks, turns), transcripts):
        traj = sample.trajectory
        assert (sample.reward, traj.stop, len(traj.turns)) == (1.0, "done", 2)
        assert traj.metrics["right_calls"] == traj.metrics["copied_result"] == traj.metrics["tool_calls"] == 1.0
        [row] = renderer.render_training(tr["messages"], tr["tools"])
        [segment] = traj.segments
        assert segment.tokens == row.tokens  # SFT and RL see the very same tokens ...
        assert segment.weights == row.weights  # ... and train the same ones (the model's turns)


def test_a_miscopied_call_or_answer_scores_0_and_is_counted(renderer: Any) -> None:
    tasks = tool_use("test", size=3)
    (p, q), (r, s), (u, v) = ((c["calls"][0][1]["a"], c["calls"][0][1]["b"]) for c in tasks)
    turns = {
        tasks[0]["question"]: [call(p, q + 1), say(str(p * (q + 1)))],  # wrong operand, result copied
        tasks[1]["question"]: [call(r, s), say(str(r * s + 10))],  # right call, answer miscopied
        tasks[2]["question"]: [say(str(u * v + 1))],  # no tool: a guess
    }
    wrong_call, wrong_copy, no_tool = play(renderer, tasks, turns)
    assert [x.reward for x in (wrong_call, wrong_copy, no_tool)] == [0.0, 0.0, 0.0]
    assert (wrong_call.trajectory.metrics["right_calls"], wrong_call.trajectory.metrics["copied_result"]) == (0.0, 1.0)
    assert (wrong_copy.trajectory.metrics["right_calls"], wrong_copy.trajectory.metrics["copied_result"]) == (1.0, 0.0)
    assert "tool_calls" not in no_tool.trajectory.metrics and no_tool.trajectory.metrics["copied_result"] == 0.0


# --------------------------------------------------------------------------- slow: it learns
@pytest.fixture(scope="module")
def tool_use_warmup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The bundled recipe's SFT warmup alone (it stops at 30% held-out accuracy: 60-150 steps,
    35-75 s on 2 cores), shared by the RL tests below, which resume from it into ``rl``."""
    out = tmp_path_factory.mktemp("tool_use_warmup")
    recipe = find_recipe("tool_use", [f"output_dir={out}", "loggers=[jsonl]"])
    recipe.stages = [s for s in recipe.stages if s.get("id") == "warmup"]
    result = recipe.run()
    progress = read_progress(str(out))
    assert progress is not None and progress["completed"] == ["warmup"]
    accuracy = result.stages["warmup"]["eval/accuracy"]
    return {"output_dir": str(out), "accuracy": accuracy, "steps": progress["global_step"]}


def run_rl(warmup: dict[str, Any], out: Path, *overrides: str) -> tuple[float, list[dict[str, Any]]]:
    """The recipe's RL stage for ``RL_STEPS`` steps from the warmup; its final held-out
    accuracy and its rows of metrics.jsonl."""
    shutil.copytree(warmup["output_dir"], out)
    overrides = (f"output_dir={out}", f"stages.rl.steps={RL_STEPS}", "stages.rl.eval.every=0", *overrides)
    recipe = find_recipe("tool_use", overrides)
    result = recipe.run()
    assert "warmup" not in result.stages  # resumed: the SFT stage did not run again
    assert (out / "reward_curve.png").exists()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result.stages["rl"]["eval/accuracy"], [r for r in rows if r.get("stage") == "rl" and "reward/mean" in r]


def check_learned(warmup: dict[str, Any], rl_acc: float, rows: list[dict[str, Any]], label: str) -> None:
    sft_acc = warmup["accuracy"]
    print(
        f"{label}: held-out accuracy after SFT ({warmup['steps']} steps) {sft_acc:.3f}, "
        f"after {RL_STEPS} RL steps {rl_acc:.3f}"
    )
    assert 0.3 <= sft_acc <= 0.7 and warmup["steps"] < 1500, "the warmup should stop early, at a modest accuracy"
    assert rl_acc >= sft_acc + MIN_GAIN, f"{label} should clearly beat SFT ({rl_acc:.3f} vs {sft_acc:.3f})"
    rewards = [r["reward/mean"] for r in rows]
    assert len(rewards) == RL_STEPS
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5  # the training reward rises too
    assert all(r["env/tool_calls"] > 0 for r in rows)  # trained on tool-using episodes


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_grpo_through_the_environment_raises_heldout_accuracy(tool_use_warmup: dict[str, Any], tmp_path: Path) -> None:
    rl_acc, rows = run_rl(tool_use_warmup, tmp_path / "grpo")
    check_learned(tool_use_warmup, rl_acc, rows, "grpo")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offpolicy_with_stale_episodes_raises_heldout_accuracy(tool_use_warmup: dict[str, Any], tmp_path: Path) -> None:
    rl_acc, rows = run_rl(
        tool_use_warmup, tmp_path / "offpolicy", "stages.rl.name=offpolicy", "stages.rl.stale.max_steps_off_policy=2"
    )
    staleness = [r["offpolicy/staleness_mean"] for r in rows]
    print("staleness per step:", staleness)
    assert max(staleness) == 2 and sum(staleness) / len(staleness) > 1.0  # asynchronous: trained on stale episodes
    check_learned(tool_use_warmup, rl_acc, rows, "offpolicy k=2")
