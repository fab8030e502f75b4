"""verifiers 0.4 environments trained through the ``verifiers`` sampler and dataset.

Two small verifiers environment packages live in tests/verifiers_pkgs/ -- ``vf-sums`` (single
turn, a rubric with a reward and a metric) and ``vf-calc`` (a multi-turn agent loop with an
``add`` tool) -- and are installed here by pip from a copy of their source (a wheel built and
installed into a folder put on ``sys.path``), as a user installs an environment package. What
must hold: their tasks become the dataset; each sample is one verifiers episode whose model
calls reach the policy's endpoint, recorded token-exactly (one row for the tool loop); the
rubric's reward is the sample's; a failing rubric is a counted failure with verifiers'
traceback; an id that is not installed is one line before training; and GRPO trains on them on
the local backend and through the local Tinker server.

verifiers pins its own dependencies: it is the ``verifiers`` extra, and ``.ci/run`` runs these
tests in the agents venv (skipped where verifiers is not installed).
"""

from __future__ import annotations

import importlib
import json
import math
import shutil
import subprocess
import sys
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tempering.errors import ConfigError
from tempering.registry import get_registry
from tempering.rollouts.rollout import SamplerContext, collect, rollout_metrics
from tempering.types import Completion, SamplingParams

pytestmark = pytest.mark.extras
pytest.importorskip(
    "verifiers",
    reason="verifiers is not installed (pip install 'tempering[verifiers]'): .ci/run runs this in its agents venv",
)

PKGS = Path(__file__).resolve().parent / "verifiers_pkgs"
TINY_CHAT = {
    "chat": True,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}


@pytest.fixture(scope="module", autouse=True)
def installed(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Both packages pip-installed (offline: no build isolation, no dependencies: verifiers is
    here already) into a folder put first on ``sys.path`` for this module's tests."""
    root = tmp_path_factory.mktemp("vf_pkgs")
    target = root / "site"
    sources = [shutil.copytree(PKGS / name, root / name) for name in ("vf_sums", "vf_calc", "vf_count")]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            *map(str, sources),
        ],
        check=True,
        timeout=300,
    )
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    yield target
    sys.path.remove(str(target))


@pytest.fixture(scope="module")
def renderer() -> Any:
    from tempering.plugins.models.tiny import tiny_llama

    _, tokenizer = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    return get_registry().build("renderer", "tiny_chat", "renderer", tokenizer=tokenizer)


class Scripted:
    """A sampling client: calls ``add`` with the two numbers of a ``"a+b?"`` question when tools
    are offered and no tool answered yet; otherwise answers the sum (of the question, or the
    tool's result as it read it). Logprob -0.5 per token; every (prompt, tokens) kept."""

    def __init__(self, renderer: Any) -> None:
        self.renderer = renderer
        self.sampled: list[tuple[list[int], list[int]]] = []

    def turn(self, text: str) -> dict[str, Any]:
        question = text.split("<|user|>", 1)[1].split("<|", 1)[0]
        if "+" not in question:
            return {"role": "assistant", "content": "0"}
        a, b = (int(x) for x in question.strip("?=").split("+"))
        if "tools: add" in text and "<|tool|>" not in text:
            return {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "add", "arguments": {"a": a, "b": b}}}],
            }
        said = text.rsplit("<|tool|>", 1)[1].split("<|", 1)[0] if "<|tool|>" in text else str(a + b)
        return {"role": "assistant", "content": said}

    def sample(self, prompts: list[list[int]], n: int, params: SamplingParams) -> Future:
        rows = []
        for prompt in prompts:
            tokens = self.renderer.render_response(self.turn(self.renderer.decode(prompt)))[: params.max_tokens]
            self.sampled.append((list(prompt), tokens))
            rows.append([Completion(list(prompt), tokens, [-0.5] * len(tokens), "stop", policy_version=1)])
        done: Future = Future()
        done.set_result(rows)
        return done


def verifiers_sampler(renderer: Any, **keys: Any) -> Any:
    reg = get_registry()
    context = SamplerContext(
        renderer.tokenizer,
        lambda: renderer,
        None,
        build=lambda kind, spec, key: reg.build(kind, spec, key),
        factory=lambda kind, spec, key: reg.factory(kind, spec, f"sampler.{key}"),
    )
    return reg.build("sampler", {"name": "verifiers", **keys}, "sampler", context=context)


def tasks(id: str, **keys: Any) -> list[dict[str, Any]]:
    return get_registry().build("dataset", {"name": "verifiers", "id": id, **keys}, "dataset")


def test_the_tasks_are_the_dataset() -> None:
    rows = tasks("vf_sums", args={"taskset": {"size": 3}})
    assert rows == [
        {"task": 0, "prompt": "0+0=", "verifiers_id": "vf_sums"},
        {"task": 1, "prompt": "1+3=", "verifiers_id": "vf_sums"},
        {"task": 2, "prompt": "2+1=", "verifiers_id": "vf_sums"},
    ]
    assert len(tasks("vf-calc")) == 6  # a hub-style id (dashes) names the same module


def within(seconds: float, fn: Any) -> Any:
    """``fn()``, failing (not hanging) when it does not return within ``seconds``."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(("value", fn()))
        except BaseException as exc:  # noqa: BLE001 - raised again on the test's thread
            out.append(("error", exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"did not return within {seconds:g} s"
    kind, value = out[0]
    if kind == "error":
        raise value
    return value


def test_an_endless_taskset_with_a_named_seat_plays_what_a_step_needs(renderer: Any) -> None:
    """vf-count's taskset never ends (as verifiers' textarena) and its config's one seat is
    ``player``: the sampler reads only the tasks a step plays, runs the seat in the subprocess
    runtime, and the dataset needs a ``size`` for it (one line)."""
    examples = within(30, lambda: tasks("vf_count", size=3))
    assert [e["prompt"] for e in examples] == ["0+1=", "1+1=", "2+1="]
    sampler = within(30, lambda: verifiers_sampler(renderer, id="vf_count"))
    rollout = collect(sampler, Scripted(renderer), [*examples, {"task": 7}], 1, SamplingParams(max_tokens=8))
    samples = [s for g in rollout.groups for s in g.samples]
    assert [s.reward for s in samples] == [1.0] * 4, [s.error for s in samples]
    with pytest.raises(ConfigError, match=r"^dataset: verifiers environment 'vf_count' has an endless taskset"):
        within(30, lambda: tasks("vf_count"))


def test_a_config_error_shows_verifiers_real_cause() -> None:
    with pytest.raises(ConfigError) as err:
        tasks("vf_sums", args={"taskset": {"sise": 3}})
    text = str(err.value)
    assert "taskset.sise: Extra inputs are not permitted" in text and "\n" not in text, text


def test_single_turn_rubric_rewards_and_token_exact_rows(renderer: Any) -> None:
    model = Scripted(renderer)
    examples = tasks("vf_sums", size=4)
    rollout = collect(verifiers_sampler(renderer, id="vf_sums"), model, examples, 2, SamplingParams(max_tokens=8))
    samples = [s for g in rollout.groups for s in g.samples]
    assert len(samples) == 8 and not any(s.failed for s in samples)
    assert all(s.reward == 1.0 for s in samples)  # the scripted model says the sum: the rubric's correct = 1
    assert {tuple(s.trajectory.segments[0].tokens) for s in samples} == {tuple(p + t) for p, t in model.sampled}
    for s in samples:
        [row] = s.trajectory.segments
        prompt, sampled = next((p, t) for p, t in model.sampled if p + t == row.tokens)
        assert row.weights == [0.0] * len(prompt) + [1.0] * len(sampled)
        assert row.logprobs == [0.0] * len(prompt) + [-0.5] * len(sampled)
        assert s.trajectory.metrics["vf_length"] == 1.0  # the rubric's metric: a one-digit reply
    assert rollout_metrics(rollout.groups)["env/turns_mean"] == 1.0


def test_multi_turn_with_a_tool_is_one_row_per_episode(renderer: Any) -> None:
    model = Scripted(renderer)
    rollout = collect(
        verifiers_sampler(renderer, id="vf_calc"), model, tasks("vf_calc", size=3), 2, SamplingParams(max_tokens=24)
    )
    samples = [s for g in rollout.groups for s in g.samples]
    assert not any(s.failed for s in samples) and all(s.reward == 1.0 for s in samples)
    for s in samples:
        assert len(s.trajectory.turns) == 2 and s.trajectory.metrics["tool_calls"] == 1.0
        assert s.trajectory.metrics["vf_tool_calls"] == 1.0 and s.trajectory.metrics["row_splits"] == 0.0
        [row] = s.trajectory.segments  # the tool's answer extended the first call's row
        first, second = s.trajectory.turns
        assert (
            row.tokens[: first.prompt_len + len(first.completion.tokens)]
            == first.completion.prompt_tokens + first.completion.tokens
        )
        assert sum(row.weights) == len(first.completion.tokens) + len(second.completion.tokens)
        a, b = map(int, s.example["prompt"].rstrip("?").split("+"))
        assert (
            f"<|tool|>{a + b}" in renderer.decode(row.tokens)
            and renderer.decode(second.completion.tokens) == f"{a + b}<eos>"
        )


def test_a_failing_rubric_is_a_counted_failure_with_its_traceback(renderer: Any) -> None:
    sampler = verifiers_sampler(renderer, id="vf_calc", args={"taskset": {"boom": True, "size": 1}})
    rollout = collect(sampler, Scripted(renderer), [{"task": 0}, {"task": 1}], 1, SamplingParams(max_tokens=24))
    boom, fine = (g.samples[0] for g in rollout.groups)
    assert boom.failed and not fine.failed and fine.reward == 1.0
    metrics = rollout_metrics(rollout.groups)
    assert metrics["failed/verifiers_error"] == 1.0 and "the rubric failed on purpose" in metrics["first_error"]
    assert "RuntimeError: the rubric failed on purpose" in metrics["first_traceback/verifiers_error"]


RECIPE = """
name: vf
seed: 0
output_dir: {out}
backend:
  name: local
  model: tiny_llama
  model_kwargs: {{chat: true, hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64,
                 max_position_embeddings: 128}}
  num_threads: 1
loggers: [jsonl]
stages:
  - id: rl
    name: grpo
    dataset: {{name: verifiers, id: vf_sums}}
    sampler: {{name: verifiers, id: vf_sums}}
    loss: {{name: grpo, loss_type: dapo}}
    steps: 2
    prompts_per_step: 2
    group_size: 4
    max_tokens: 4
    optimizer: {{learning_rate: 1.0e-2}}
"""


def test_an_unknown_id_is_one_line_before_training(rejects_before_training: Any) -> None:
    rejects_before_training(
        RECIPE, "stages.0.sampler.id=vf_nope", "stages[0].sampler.id: no verifiers environment 'vf_nope' is installed"
    )


def rl_rows(out: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("stage") == "rl" and "loss" in r]


def test_grpo_trains_on_a_verifiers_environment_locally(tmp_path: Path) -> None:
    from tempering.training.recipe import Recipe

    recipe = tmp_path / "vf.yaml"
    recipe.write_text(RECIPE.format(out=tmp_path / "run"))
    Recipe.from_yaml(str(recipe), []).run()
    rows = rl_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["reward/failed"] == 0.0 and r["env/turns_mean"] == 1.0


@pytest.fixture
def chat_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    from fake_tinker import CHAT_KWARGS, serve

    from tempering.plugins.tinker_server.service import ServedModel

    yield from serve(monkeypatch, tmp_path, {"tiny_llama": ServedModel("tiny_llama", CHAT_KWARGS)})


def test_grpo_trains_on_a_verifiers_tool_environment_through_tinker(tmp_path: Path, chat_server: Any) -> None:
    from tempering.plugins.backends.tinker.mapping import plain_datum
    from tempering.training.recipe import Recipe

    recipe = tmp_path / "vf.yaml"
    recipe.write_text(RECIPE.format(out=tmp_path / "run").replace("vf_sums", "vf_calc"))
    with pytest.warns(UserWarning, match="ignores local-backend keys"):
        Recipe.from_yaml(str(recipe), ["backend.name=tinker", "stages.0.max_tokens=12"]).run()
    rows = rl_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all(r["reward/failed"] == 0.0 for r in rows)
    sampled = chat_server.sampled
    for fb in chat_server.bodies("ForwardBackward"):
        for datum in fb.data:
            row = plain_datum(datum)
            tokens = row["model_input"] + row["loss_fn_inputs"]["target_tokens"][-1:]
            weighted = {i + 1 for i, lp in enumerate(row["loss_fn_inputs"]["logprobs"]) if lp != 0.0}
            spans = set()
            for prompt, out in sampled:  # every sampled span this row starts with, as the server sampled it
                end = len(prompt) + len(out)
                if out and tokens[:end] == prompt + out:
                    spans |= set(range(len(prompt), end))
            assert weighted == spans
