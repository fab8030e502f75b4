"""The environment contract, end to end through the real ``environment`` sampler.

Every test drives real episodes (``tempering.rollouts.episode.run_episode`` behind the registered
``environment`` sampler, batched by ``ModelQueue``) with the ``tiny_chat`` renderer over
``tiny_llama(chat=True)``'s tokenizer. The "model" is :class:`ScriptedModel`, a sampling client
that answers each prompt with the assistant turn the test scripted for that episode and turn
(rendered by the renderer, so it is exactly what a model emitting that turn would sample): each
test decides what the model says and asserts what the environment, the sampler and the metrics
make of it. The last tests train a real tiny model through GRPO and the off-policy stage.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from concurrent.futures import Future
from typing import Any

import pytest
from tool_envs import WithAdd

from tempering.registry import get_registry
from tempering.rollouts.chat import ParsedResponse, ToolCall
from tempering.rollouts.environment import Environment, StepResult
from tempering.rollouts.episode import EpisodeLimits, ModelQueue, run_episode
from tempering.rollouts.rollout import SamplerContext, collect, rollout_metrics
from tempering.rollouts.scoring import RewardRunner
from tempering.rollouts.tools import Tool, tool, tools_of
from tempering.training.rl import build_group_batch
from tempering.types import Completion, SamplingParams


# --------------------------------------------------------------------------- the scripted model
@pytest.fixture(scope="module")
def renderer() -> Any:
    from tempering.plugins.models.tiny import tiny_llama

    _, tokenizer = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    return get_registry().build("renderer", "tiny_chat", "renderer", tokenizer=tokenizer)


def call(name: str, **arguments: Any) -> dict[str, Any]:
    """An assistant turn calling one tool."""
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


def say(text: str) -> dict[str, Any]:
    """An assistant turn with a final answer."""
    return {"role": "assistant", "content": text}


class ScriptedModel:
    """A sampling client (``sample(prompts, n, params) -> Future``) whose model says what the test
    scripted: ``script[question][turn]``, where ``question`` is the episode's user message found
    in the prompt and ``turn`` the number of assistant turns already in it. A scripted turn is an
    assistant message (rendered with ``renderer.render_response``), raw token ids, or a function
    of how many times that turn was asked before (to make a group's episodes differ). Like a
    real sampler it stops at the first stop id in ``params.stop`` and at ``params.max_tokens``.
    Every call is recorded: its prompts, params and the time it was made."""

    def __init__(self, renderer: Any, script: dict[str, list[Any]], logprob: float = -0.5) -> None:
        self.renderer, self.script, self.logprob = renderer, script, logprob
        self.calls: list[dict[str, Any]] = []
        self.asked: dict[tuple[str, int], int] = {}

    def turn(self, prompt: list[int]) -> list[int]:
        text = self.renderer.decode(prompt)
        [question] = [q for q in self.script if f"<|user|>{q}" in text]
        turn = prompt.count(self.renderer.role_ids["assistant"]) - 1
        out = self.script[question][turn]
        if callable(out):
            n = self.asked[question, turn] = self.asked.get((question, turn), -1) + 1
            out = out(n)
        return self.renderer.render_response(out) if isinstance(out, dict) else list(out)

    def sample(self, prompts: list[list[int]], num_samples: int, params: SamplingParams) -> Future:
        assert num_samples == 1, "episodes sample one completion per request"
        self.calls.append({"prompts": [list(p) for p in prompts], "params": params, "t": time.perf_counter()})
        rows = []
        for prompt in prompts:
            tokens, reason = [], "length"
            for t in self.turn(prompt)[: params.max_tokens]:
                tokens.append(t)
                if t in params.stop:
                    reason = "stop"
                    break
            rows.append([Completion(list(prompt), tokens, [self.logprob] * len(tokens), reason)])
        future: Future = Future()
        future.set_result(rows)
        return future


def sampler(renderer: Any, environment: Any, reward: Any = None, **keys: Any) -> Any:
    """The registered ``environment`` sampler, built the way a stage builds it."""
    reg = get_registry()
    context = SamplerContext(
        renderer.tokenizer,
        lambda: renderer,
        RewardRunner(reward) if reward is not None else None,
        build=lambda kind, spec, key: reg.build(kind, spec, key),
        factory=lambda kind, spec, key: reg.factory(kind, spec, f"sampler.{key}"),
    )
    return reg.build("sampler", {"name": "environment", "environment": environment, **keys}, "sampler", context=context)


def roll(
    renderer: Any,
    environment: Any,
    script: dict[str, list[Any]],
    examples: list[dict[str, Any]],
    group_size: int = 1,
    max_tokens: int = 40,
    seed: int | None = None,
    reward: Any = None,
    **keys: Any,
):
    """Play ``examples`` x ``group_size`` episodes; returns (groups, metrics, model, rollout)."""
    model = ScriptedModel(renderer, script)
    rollout = collect(
        sampler(renderer, environment, reward, **keys),
        model,
        examples,
        group_size,
        SamplingParams(max_tokens=max_tokens, seed=seed),
    )
    return rollout.groups, rollout_metrics(rollout.groups), model, rollout


# --------------------------------------------------------------------------- test environments
class Adder(WithAdd):
    """Add numbers with a tool; the answer is scored by exact match. Each instance records its
    calls in ``events`` (and adds itself to ``log``); an example's ``fail`` key makes ``reset``,
    ``step`` or ``cleanup`` raise."""

    def __init__(self, log: list | None = None) -> None:
        self.events: list[str] = []
        if log is not None:
            log.append(self)

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        self.q, self.fail, self.answer = example["q"], example.get("fail"), example.get("answer")
        self.events.append("reset")
        if self.fail == "reset":
            raise RuntimeError("boom in reset")
        return [{"role": "user", "content": self.q}]

    async def step(self, response: ParsedResponse) -> StepResult:
        self.events.append("step")
        if self.fail == "step":
            raise ValueError("boom in step")
        return await super().step(response)

    async def score(self, response: ParsedResponse) -> float | None:
        return None if self.answer is None else float(response.text == self.answer)

    async def cleanup(self) -> None:
        self.events.append("cleanup")
        if self.fail == "cleanup":
            raise OSError("boom in cleanup")


def logged(log: list) -> type[Adder]:
    """``Adder`` instances that add themselves to ``log`` (the sampler builds one per episode)."""
    return lambda: Adder(log)  # type: ignore[return-value]


# --------------------------------------------------------------------------- episode lifecycle
def test_an_episode_is_reset_steps_cleanup_and_its_row_is_token_exact(renderer):
    log: list = []
    script = {"1+2?": [call("add", a=1, b=2), say("3")]}
    [group], metrics, model, _ = roll(renderer, logged(log), script, [{"q": "1+2?", "answer": "3"}])
    assert [env.events for env in log] == [["reset", "step", "step", "cleanup"]]
    [sample] = group.samples
    traj = sample.trajectory
    assert (traj.stop, sample.reward, sample.failed, sample.masked) == ("done", 1.0, False, False)
    assert [t.response.tool_calls for t in traj.turns] == [[ToolCall("add", {"a": 1, "b": 2}, "call_0_0")], []]
    assert traj.turns[0].observation == [{"role": "tool", "tool_call_id": "call_0_0", "name": "add", "content": "3"}]
    assert traj.messages[-2:] == [traj.turns[0].observation[0], {"role": "assistant", "content": "3"}]
    assert traj.tools == [Tool.from_function(Adder().add).spec()]
    # the second prompt re-renders the first prompt, the sampled call and the tool's answer
    first, second = (c["prompts"][0] for c in model.calls)
    sampled = [t.completion.tokens for t in traj.turns]
    assert second[: len(first) + len(sampled[0])] == first + sampled[0]
    assert renderer.decode(second[len(first) + len(sampled[0]) :]) == "<|tool|>3<|assistant|>"
    # one training row: every token the model saw, weight 1 and the sampler's logprob exactly on the sampled ones
    [row] = traj.segments
    assert row.tokens == second + sampled[1] == renderer.render_prompt(traj.messages, traj.tools).tokens[:-1]
    expected = (
        [0.0] * len(first)
        + [1.0] * len(sampled[0])
        + [0.0] * (len(second) - len(first) - len(sampled[0]))
        + [1.0] * len(sampled[1])
    )
    assert row.weights == expected
    assert row.logprobs == [-0.5 * w for w in expected]
    assert metrics["env/tool_calls"] == 1.0 and metrics["env/turns_mean"] == 2.0 and metrics["env/stop/done"] == 1.0
    assert metrics["reward/failed"] == 0.0 and metrics["env/masked"] == 0.0 and "first_error" not in metrics


def test_cleanup_runs_after_reset_or_step_raises_and_only_those_episodes_fail(renderer):
    log: list = []
    script = {q: [call("add", a=2, b=2), say("4")] for q in ("a?", "b?", "c?", "d?")}
    examples = [
        {"q": "a?", "answer": "4", "fail": "reset"},
        {"q": "b?", "answer": "4", "fail": "step"},
        {"q": "c?", "answer": "4"},
        {"q": "d?", "answer": "4", "fail": "cleanup"},
    ]
    groups, metrics, model, _ = roll(renderer, logged(log), script, examples, group_size=2)
    assert [(env.q, env.events) for env in log] == [
        ("a?", ["reset", "cleanup"]),
        ("a?", ["reset", "cleanup"]),
        ("b?", ["reset", "step", "cleanup"]),
        ("b?", ["reset", "step", "cleanup"]),
        *[(q, ["reset", "step", "step", "cleanup"]) for q in ("c?", "c?", "d?", "d?")],
    ]  # one instance per episode, and cleanup always last
    a, b, c, d = groups
    assert [(s.failed, s.error, s.trajectory.stop) for s in a.samples] == [
        (True, "episode: RuntimeError: boom in reset", "error")
    ] * 2
    assert [(s.failed, s.error, s.trajectory.stop) for s in b.samples] == [
        (True, "episode: ValueError: boom in step", "error")
    ] * 2
    assert [(s.failed, s.reward, s.trajectory.stop) for s in c.samples] == [(False, 1.0, "done")] * 2
    # a cleanup that raises is counted and shown, the episode keeps its reward
    assert [(s.failed, s.reward, s.trajectory.errors) for s in d.samples] == [
        (False, 1.0, ["cleanup: OSError: boom in cleanup"])
    ] * 2
    assert metrics["reward/failed"] == 4.0
    assert metrics["first_error"] == "episode: RuntimeError: boom in reset"
    assert metrics["env/cleanup_errors"] == 2.0
    assert metrics["env/stop/error"] == 0.5 and metrics["env/stop/done"] == 0.5
    # the failed episodes are kept out of the loss: their rows (b's) have weight 0, the others weight 1
    batch, info = build_group_batch(groups, get_registry().build("advantage", "group_norm", "advantage"))
    assert info["reward/mean"] == 1.0
    assert [len(s.segments()) for g in groups for s in g.samples] == [
        0,
        0,
        1,
        1,
        1,
        1,
        1,
        1,
    ]  # a reset that raised left no row
    assert [max(d.weights) for d in batch.data] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    # the failing episodes did not hold the others up: two batched model calls in all
    assert [len(c["prompts"]) for c in model.calls] == [6, 4]


def test_bad_sampler_keys_fail_with_their_path(renderer):
    from tempering.errors import ConfigError, UnknownComponentError

    with pytest.raises(ConfigError, match=r"^sampler\.on_max_turns: use zero or mask \(got 'drop'\)"):
        sampler(renderer, Adder, on_max_turns="drop")
    with pytest.raises(ConfigError, match=r"^sampler\.max_turns: must be >= 1, got 0"):
        sampler(renderer, Adder, max_turns=0)
    with pytest.raises(
        ConfigError, match=r"^sampler\.environment: the environment sampler needs 'environment: <registered name>'"
    ):
        sampler(renderer, None)
    with pytest.raises(UnknownComponentError, match=r"^sampler\.environment\.name: unknown environment 'adder'\."):
        sampler(renderer, "adder")


# --------------------------------------------------------------------------- tools
def test_tool_schema_comes_from_the_typed_documented_function():
    def convert(value: float, unit: str, to: str = "m", exact: bool = False) -> str:
        """Convert a length between units.

        Args:
            value: the length
            unit: its unit
            to: the unit wanted
            exact: whether to keep every digit
        """
        return f"{value}{unit}"

    built = Tool.from_function(convert, timeout=2.0)
    assert (built.name, built.timeout) == ("convert", 2.0)
    assert built.spec() == {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Convert a length between units.",
            "parameters": {
                "type": "object",
                "properties": {
                    "value": {"type": "number", "description": "the length"},
                    "unit": {"type": "string", "description": "its unit"},
                    "to": {"type": "string", "description": "the unit wanted"},
                    "exact": {"type": "boolean", "description": "whether to keep every digit"},
                },
                "required": ["value", "unit"],
            },
        },
    }

    # on an environment: the @tool methods, bound, in definition order, with @tool's name and timeout
    class Env(Environment):
        @tool(name="plus", timeout=0.5)
        def add(self, a: int, b: int) -> int:
            """Add.

            Args:
                a: one
                b: two
            """
            return a + b

        def helper(self) -> None:  # not a tool
            pass

    [plus] = tools_of(Env())
    assert (plus.name, plus.timeout, plus.parameters["required"]) == ("plus", 0.5, ["a", "b"])


def test_a_tool_without_docstring_args_is_refused_when_built():
    def undocumented(a: int) -> int:
        """Does something."""
        return a

    with pytest.raises(
        ValueError,
        match=r"^tool test_a_tool_without_docstring_args_is_refused_when_built\.<locals>\.undocumented: "
        r".*no description for the argument 'a'\. Give it type hints and a Google-style docstring",
    ):
        Tool.from_function(undocumented)

    class Env(Environment):
        @tool
        def lookup(self, word: str) -> str:
            return word

    with pytest.raises(
        ValueError,
        match=r"^tool .*<locals>\.Env\.lookup: Cannot generate JSON schema for lookup because it has no docstring",
    ):
        Env().tools()


def test_sync_and_async_tools_are_called_alike():
    async def slow_upper(word: str) -> str:
        """Upper-case a word.

        Args:
            word: the word
        """
        await asyncio.sleep(0)
        return word.upper()

    def pair(word: str, n: int) -> list:
        """Repeat.

        Args:
            word: the word
            n: how often
        """
        return [word] * n

    async def main():
        return await asyncio.gather(
            Tool.from_function(slow_upper).call({"word": "ab"}), Tool.from_function(pair).call({"word": "x", "n": 2})
        )

    up, rep = asyncio.run(main())
    assert (up.content, up.error, up.timed_out) == ("AB", None, False)
    assert (rep.content, rep.error) == ('["x", "x"]', None)  # containers as JSON


class Faulty(Environment):
    """Tools that raise, hang and take arguments, for the error paths the model must see."""

    tool_timeout = 0.2

    @tool
    def explode(self, x: int) -> int:
        """Always fails.

        Args:
            x: anything
        """
        raise ValueError(f"cannot explode {x}")

    @tool
    async def hang(self, x: int) -> int:
        """Never answers in time.

        Args:
            x: anything
        """
        await asyncio.sleep(5)
        return x

    @tool
    def sleepy(self, x: int) -> int:
        """A sync tool that answers too late.

        Args:
            x: anything
        """
        time.sleep(2.0)  # 10x the timeout: the bound below tells the two apart on a loaded machine
        return x


@pytest.mark.parametrize(
    "turn, seen, metric, first_error",
    [
        (
            call("explode", x=7),
            "valueerror: cannot explode 7",
            "env/tool_errors",
            "tool explode raised ValueError: cannot explode 7",
        ),
        (call("hang", x=1), "tool hang timed out after 0.2s", "env/tool_timeouts", "tool hang timed out after 0.2s"),
        (
            call("sleepy", x=1),
            "tool sleepy timed out after 0.2s",
            "env/tool_timeouts",
            "tool sleepy timed out after 0.2s",
        ),
        (
            call("nope", x=1),
            "unknown tool 'nope' (tools: explode, hang, sleepy)",
            "env/tool_errors",
            "unknown tool 'nope' (tools: explode, hang, sleepy)",
        ),
        (
            call("explode", x=1, y=2),
            "bad arguments for explode: got an unexpected keyword argument 'y'",
            "env/tool_errors",
            "bad arguments for explode: got an unexpected keyword argument 'y'",
        ),
        (
            call("explode"),
            "bad arguments for explode: missing a required argument: 'x'",
            "env/tool_errors",
            "bad arguments for explode: missing a required argument: 'x'",
        ),
    ],
    ids=["raises", "async-timeout", "sync-timeout", "unknown", "bad-arg", "missing-arg"],
)
def test_a_failing_tool_call_is_an_error_message_the_model_reads_next_turn(renderer, turn, seen, metric, first_error):
    script = {"go": [turn, say("ok")]}
    t0 = time.perf_counter()
    [group], metrics, model, _ = roll(renderer, Faulty, script, [{"prompt": "go"}], reward=lambda text, ex: 0.5)
    # a hung tool costs the episode its timeout (0.2 s), not its run time (2 s, or 5 s): 1.5 s
    # leaves 1.3 s for the rest of the episode on a loaded machine and still fails if it waited
    assert model.calls[1]["t"] - t0 < 1.5
    [sample] = group.samples
    [observation] = sample.trajectory.turns[0].observation
    # the error text is the tool's answer, and the next prompt shows it (in tiny_chat's lower-case alphabet) ...
    assert observation["content"].lower() == f"error: {seen}"
    second_prompt = renderer.decode(model.calls[1]["prompts"][0])
    assert second_prompt.endswith(f"<|tool|>error: {seen}<|assistant|>")
    # ... the episode goes on (the final answer scored by the stage's reward) and the error is counted
    assert (sample.trajectory.stop, sample.reward, sample.failed) == ("done", 0.5, False)
    assert metrics[metric] == 1.0 and metrics["env/tool_errors"] == 1.0 and metrics["env/tool_calls"] == 1.0
    assert metrics["env/tool_timeouts"] == (1.0 if metric == "env/tool_timeouts" else 0.0)
    assert metrics["env/first_error"] == first_error
    assert sample.feedback == first_error  # the failed call, naming the tool, is the episode's feedback


# --------------------------------------------------------------------------- feedback
class Coached(Faulty):
    """Each turn's step says how many calls it saw, as feedback; the final answer is left to
    the stage's reward."""

    turns = 0

    async def step(self, response: ParsedResponse) -> StepResult:
        result = await super().step(response)
        self.turns += 1
        result.feedback = f"turn {self.turns}: {len(response.tool_calls)} call(s)"
        return result


def test_an_episodes_feedback_joins_its_turns_tool_errors_and_the_stage_rewards_in_order(renderer):
    from tempering.plugins.rewards.basic import ExactMatch

    script = {"go": [call("explode", x=7), call("explode", x=8), say("41")]}
    [group], _metrics, _, _rollout = roll(
        renderer, Coached, script, [{"prompt": "go", "answer": "42"}], reward=ExactMatch()
    )
    [sample] = group.samples
    assert (sample.reward, sample.failed, sample.trajectory.stop) == (0.0, False, "done")
    assert sample.feedback == (
        "tool explode raised ValueError: cannot explode 7\nturn 1: 1 call(s)\n"
        "tool explode raised ValueError: cannot explode 8\nturn 2: 1 call(s)\n"
        "turn 3: 0 call(s)\nexpected '42', got '41'"
    )
    assert "feedback" not in sample.reward_info


def test_running_out_of_turns_and_the_calculators_own_score_are_feedback(renderer):
    [group], *_ = roll(
        renderer, Faulty, {"go": [call("hang", x=1)] * 2}, [{"prompt": "go"}], max_turns=1, reward=lambda text, ex: 1.0
    )
    assert group.samples[0].feedback == "tool hang timed out after 0.2s\nno final answer within max_turns=1 turns"
    script = {"6*7": [call("mul", a=6, b=7), say("24")], "6*8": [say("46")], "6*9": [call("mul", a=6, b=9), say("54")]}
    examples = [{"question": q, "answer": a} for q, a in zip(script, ("42", "48", "54"))]
    groups, *_ = roll(renderer, "calculator", script, examples)
    assert [g.samples[0].feedback for g in groups] == [
        "expected '42', got '24'; the last tool result was '42'",
        "expected '48', got '46'; mul was never called",
        None,
    ]
    assert [g.samples[0].reward for g in groups] == [0.0, 0.0, 1.0]


# --------------------------------------------------------------------------- retry: a slow checker
RETRY = {"name": "retry", "retry_message": "no. again, only the number."}  # the tiny tokenizer has no capitals


def test_retry_checks_each_answer_and_asks_again_until_it_passes_or_runs_out(renderer):
    script = {"2+3": [say("2+3=6"), say("5")], "4+4": [say("8")], "6+1": [say("6"), say("8")]}
    examples = [{"prompt": q, "answer": a} for q, a in zip(script, ("5", "8", "7"))]
    groups, metrics, model, _ = roll(renderer, RETRY, script, examples)
    retried, first, failed = (g.samples[0] for g in groups)
    assert [s.reward for s in (retried, first, failed)] == [1.0, 1.0, 0.0]
    assert [len(s.trajectory.turns) for s in (retried, first, failed)] == [2, 1, 2]
    assert retried.trajectory.turns[0].observation == [{"role": "user", "content": "no. again, only the number."}]
    assert retried.feedback == "expected '5', got '6'"  # the failed answer's, not the pass's
    assert failed.feedback == "expected '7', got '6'\nexpected '7', got '8'"
    assert first.feedback is None
    assert (metrics["env/passed_first"], metrics["env/retries"]) == (1.0, 2.0)
    assert [len(c["prompts"]) for c in model.calls] == [3, 2]  # the second turn: the two that failed


def test_retry_checks_a_turn_cut_at_the_token_limit_as_written(renderer):
    # "5 and" is cut after 2 tokens: the checker reads "5 " (math_answer: the last number) and
    # passes it; a cut turn is an answer, not the end of the episode
    script = {"2+3": [say("5 and so on")], "4+4": [say("7 and so on"), say("8")]}
    examples = [{"prompt": q, "answer": a} for q, a in zip(script, ("5", "8"))]
    groups, metrics, *_ = roll(renderer, RETRY, script, examples, max_tokens=2)
    assert [g.samples[0].reward for g in groups] == [1.0, 1.0]
    assert [len(g.samples[0].trajectory.turns) for g in groups] == [1, 2]
    assert metrics["env/retries"] == 1.0


def test_the_retry_checkers_latency_is_a_wait_the_episodes_share(renderer):
    # latency_s is a wait (a slow grader), not work: three episodes wait together (one
    # latency per answer, not three), and the process spends no CPU on it
    latency = 0.6
    script = {f"{a}+1": [say(str(a + 1))] for a in (1, 2, 3)}
    examples = [{"prompt": q, "answer": str(a + 1)} for q, a in zip(script, (1, 2, 3))]
    wall, cpu = time.perf_counter(), time.process_time()
    groups, *_ = roll(renderer, {**RETRY, "latency_s": latency}, script, examples)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert [g.samples[0].reward for g in groups] == [1.0, 1.0, 1.0]
    assert latency <= wall < 2 * latency, wall
    assert cpu < latency / 2, cpu


@pytest.mark.parametrize(
    "key, bad, says",
    [
        ("attempts", 0, "must be >= 1"),
        ("latency_s", -1.0, "must be a number of seconds >= 0"),
        ("latency_s", math.inf, "must be a number of seconds >= 0"),
        ("retry_message", " ", "must be text"),
    ],
)
def test_a_bad_retry_key_is_one_line_at_its_path(renderer, key, bad, says):
    from tempering.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"^sampler\.environment\.{key}: {says}") as info:
        sampler(renderer, {**RETRY, key: bad})
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- malformed turns
def test_a_malformed_tool_call_parses_to_a_parse_error(renderer):
    tokens = [renderer.call_id, *renderer._text("add(1,2)"), renderer.eos_id]
    parsed = renderer.render_prompt([{"role": "user", "content": "x"}]).parse(tokens)
    assert parsed == ParsedResponse(
        text="",
        tool_calls=[],
        parse_error="malformed tool call 'add(1,2)': arguments must be named (key=value)",
        raw="<|call|>add(1,2)<eos>",
    )
    bad_json = renderer.parse(
        [*renderer._text("hi"), renderer.call_id, *renderer._text("add(a=1,b=)"), renderer.eos_id]
    )
    assert (bad_json.text, bad_json.parse_error) == ("hi", "malformed tool call 'add(a=1,b=)': not a call expression")


@pytest.mark.parametrize("written", ["""find(q='say "hi"')""", """find(q="it's")""", '''find(q="""a"b'c""")'''])
def test_a_call_the_model_wrote_re_renders_as_it_wrote_it(renderer, written):
    """A call re-rendered into the next prompt keeps the model's quoting: JSON's ``\\"`` escape
    would need a backslash, which the tiny alphabet lacks (the episode then failed with the
    tokenizer's "Missing [UNK] token" on the next turn)."""
    tokens = [renderer.call_id, *renderer._text(written), renderer.eos_id]
    parsed = renderer.parse(tokens)
    assert parsed.parse_error is None
    message = {"role": "assistant", "content": "", "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
    assert renderer.render_response(message) == tokens


class Strict(Adder):
    parse_errors = "end"


class Lenient(Adder):
    parse_errors = "feedback"


def test_parse_errors_end_the_episode_or_are_fed_back(renderer):
    malformed = [renderer.call_id, *renderer._text("add(1,2)"), renderer.eos_id]
    script = {"1+2?": [malformed, call("add", a=1, b=2), say("3")]}
    example = [{"q": "1+2?", "answer": "3"}]

    [group], metrics, _, _ = roll(renderer, Strict, script, example)
    [s] = group.samples
    assert (s.trajectory.stop, len(s.trajectory.turns), s.reward, s.failed, s.masked) == (
        "parse_error",
        1,
        0.0,
        False,
        False,
    )
    assert metrics["env/parse_errors"] == 1.0 and metrics["env/stop/parse_error"] == 1.0
    said = "the turn could not be parsed: malformed tool call 'add(1,2)': arguments must be named (key=value)"
    assert s.feedback == said

    [group], metrics, model, _ = roll(renderer, Lenient, script, example)
    [s] = group.samples
    assert (s.trajectory.stop, len(s.trajectory.turns), s.reward) == ("done", 3, 1.0)
    assert s.feedback == said  # fed back to the model, and feedback for the learner too
    feedback = (
        "Your last message could not be parsed (malformed tool call 'add(1,2)': arguments must be named "
        "(key=value)). Try again."
    )
    assert s.trajectory.turns[0].observation == [{"role": "user", "content": feedback}]
    assert renderer.decode(model.calls[1]["prompts"][0]).endswith(f"<|user|>{feedback.lower()}<|assistant|>")
    assert metrics["env/parse_errors"] == 1.0 and metrics["env/stop/done"] == 1.0
    # the malformed turn is not re-rendered as sampled (it has no parsed content), so the next
    # prompt does not extend the row: a second row starts, and each row weights exactly its sampled tokens
    assert metrics["env/row_splits"] == 1.0
    first, second = s.trajectory.segments
    assert first.tokens == model.calls[0]["prompts"][0] + malformed
    assert first.weights == [0.0] * len(model.calls[0]["prompts"][0]) + [1.0] * len(malformed)
    assert second.tokens[: len(model.calls[1]["prompts"][0])] == model.calls[1]["prompts"][0]
    assert sum(second.weights) == sum(len(t.completion.tokens) for t in s.trajectory.turns[1:])


def test_a_turn_cut_by_max_tokens_is_a_parse_error(renderer):
    script = {"1+2?": [say("the answer is three")]}
    [group], metrics, _, _ = roll(renderer, Strict, script, [{"q": "1+2?", "answer": "3"}], max_tokens=5)
    [s] = group.samples
    assert s.trajectory.turns[0].response.parse_error == "the turn hit the token limit before its stop token"
    assert (s.trajectory.stop, s.reward, len(s.completion.tokens)) == ("parse_error", 0.0, 5)
    assert metrics["completion/stop_frac"] == 0.0 and metrics["env/parse_errors"] == 1.0


# --------------------------------------------------------------------------- limits
class Looper(Adder):
    """Calls never end the episode; each tool turn is worth 0.25 (so zeroing is visible)."""

    async def step(self, response: ParsedResponse) -> StepResult:
        result = await super().step(response)
        result.reward = 0.25
        return result


@pytest.mark.parametrize("action", ["zero", "mask"])
def test_max_turns_zeroes_or_masks_the_episode(renderer, action):
    script = {"loop": [call("add", a=1, b=1)] * 3, "once": [call("add", a=1, b=1), say("2")]}
    groups, metrics, model, _ = roll(
        renderer, Looper, script, [{"q": "loop"}, {"q": "once"}], max_turns=3, on_max_turns=action
    )
    loop, once = (g.samples[0] for g in groups)
    assert [len(loop.trajectory.turns), loop.trajectory.stop] == [3, "max_turns"]
    assert (loop.reward, loop.masked, loop.failed) == ((0.0, False, False) if action == "zero" else (0.0, True, False))
    assert (once.reward, once.masked, once.trajectory.stop) == (
        0.5,
        False,
        "done",
    )  # 0.25 + 0.25, summed over its turns
    assert metrics["env/masked"] == (1.0 if action == "mask" else 0.0)
    assert metrics["env/stop/max_turns"] == 0.5 and metrics["env/stop/done"] == 0.5
    assert [len(c["prompts"]) for c in model.calls] == [2, 2, 1]
    batch, info = build_group_batch(groups, get_registry().build("advantage", "group_norm", "advantage"))
    assert info["reward/mean"] == (0.25 if action == "zero" else 0.5)  # a masked episode is out of the mean
    assert [max(d.weights) for d in batch.data] == ([1.0, 1.0] if action == "zero" else [0.0, 1.0])


@pytest.mark.parametrize("action", ["zero", "mask"])
def test_the_context_budget_ends_the_episode(renderer, action):
    """Two ways to run out: a turn cut at the budget, and no room left for the next turn."""
    script = {"1+2?": [call("add", a=1, b=2), say("3")]}
    example = [{"q": "1+2?", "answer": "3"}]
    [group], _, model, _ = roll(renderer, Adder, script, example)
    [full] = group.samples
    first_prompt, second_prompt = (c["prompts"][0] for c in model.calls)
    first_turn = len(full.trajectory.turns[0].completion.tokens)

    # (a) the budget cuts the first turn 2 tokens short: the turn is kept (its tokens were sampled), the episode ends
    budget = len(first_prompt) + first_turn - 2
    [group], metrics, model, _ = roll(
        renderer, Adder, script, example, max_total_tokens=budget, on_context_limit=action
    )
    [s] = group.samples
    assert model.calls[0]["params"].max_tokens == first_turn - 2
    assert (s.trajectory.stop, len(s.trajectory.turns), len(s.trajectory.segments[0].tokens)) == ("context", 1, budget)
    assert s.trajectory.turns[0].response.parse_error == "malformed tool call 'add(a=1,b=2': not a call expression"
    assert (s.reward, s.masked) == (0.0, action == "mask")
    assert metrics["env/stop/context"] == 1.0 and metrics["env/masked"] == float(action == "mask")

    # (b) the first turn fits exactly, the second prompt alone fills the budget: no second turn
    [group], metrics, model, _ = roll(
        renderer, Adder, script, example, max_total_tokens=len(second_prompt), on_context_limit=action
    )
    [s] = group.samples
    assert (s.trajectory.stop, len(s.trajectory.turns), len(model.calls)) == ("context", 1, 1)
    assert s.trajectory.segments[0].tokens == second_prompt
    assert (s.reward, s.masked) == (0.0, action == "mask")
    assert metrics["env/stop/context"] == 1.0 and metrics["env/masked"] == float(action == "mask")


# --------------------------------------------------------------------------- rewards
def test_final_answer_scored_by_the_environment_or_by_the_stage_reward(renderer):
    script = {"1+2?": [say("3")], "2+2?": [say("5")]}
    examples = [{"q": "1+2?", "answer": "3"}, {"q": "2+2?", "answer": "4"}]
    stage_reward = lambda text, ex: 10.0 + len(text)  # would give 11 if it were asked
    groups, _, _, rollout = roll(renderer, Adder, script, examples, reward=stage_reward)
    assert [g.samples[0].reward for g in groups] == [1.0, 0.0]  # Adder.score decided; the stage reward was not called
    assert rollout.stats.scored == 0

    unscored = [{"q": "1+2?"}, {"q": "2+2?"}]  # no answer: Adder.score returns None
    groups, _, _, _ = roll(renderer, Adder, script, unscored, reward=lambda text, ex: float(text == "3"))
    assert [g.samples[0].reward for g in groups] == [1.0, 0.0]

    groups, metrics, _, _ = roll(renderer, Adder, script, unscored)  # left to a stage that has no reward
    assert [g.samples[0].failed for g in groups] == [True, True]
    assert metrics["first_error"] == "the environment left the reward to the stage, which has none"


class Ranked(Adder):
    """A group reward: +1 to the shortest answer of the group, added to each episode's own."""

    async def group_reward(self, trajectories: list) -> list[float]:
        lengths = [len(t.turns[-1].response.text) for t in trajectories]
        return [float(n == min(lengths)) for n in lengths]


def test_a_group_reward_is_added_to_each_episodes_reward(renderer):
    script = {"1+2?": [lambda n: say(["3", "03", "003"][n])]}  # the group's three episodes answer differently
    [group], _, _, _ = roll(renderer, Ranked, script, [{"q": "1+2?", "answer": "3"}], group_size=3)
    assert [s.reward for s in group.samples] == [2.0, 0.0, 0.0]  # own (1, 0, 0) + group (1, 0, 0)

    [group], _, _, _ = roll(
        renderer, Ranked, script, [{"q": "1+2?"}], group_size=3, reward=lambda text, ex: float(len(text))
    )
    assert [s.reward for s in group.samples] == [2.0, 2.0, 3.0]  # stage reward (1, 2, 3) + group (1, 0, 0)

    class Broken(Adder):
        def group_reward(self, trajectories: list) -> list[float]:
            return [1.0]  # one value for a group of three

    [group], metrics, _, _ = roll(renderer, Broken, script, [{"q": "1+2?", "answer": "3"}], group_size=3)
    assert [s.failed for s in group.samples] == [True] * 3
    assert metrics["first_error"] == "group_reward: ValueError: returned 1 values for a group of 3"


# --------------------------------------------------------------------------- batching (ModelQueue)
def test_episodes_share_one_sample_call_per_turn_in_lockstep_and_reproducibly(renderer):
    # three examples x two episodes, ending after 1, 2 and 3 turns
    script = {
        "a": [say("1")],
        "b": [call("add", a=1, b=1), say("2")],
        "c": [call("add", a=1, b=1), call("add", a=2, b=1), say("3")],
    }
    examples = [{"q": "a"}, {"q": "b"}, {"q": "c"}]

    def run_once():
        _, _, model, rollout = roll(renderer, Adder, script, examples, group_size=2, seed=5, reward=lambda t, e: 1.0)
        return model.calls, rollout.metrics

    calls, metrics = run_once()
    assert [len(c["prompts"]) for c in calls] == [6, 4, 2] and metrics["env/model_calls"] == 3.0
    # each call holds the live episodes' requests in episode order, with a per-call seed derived from the stage's
    question = lambda p: renderer.decode(p).split("<|user|>")[1][0]
    assert [[question(p) for p in c["prompts"]] for c in calls] == [list("aabbcc"), list("bbcc"), list("cc")]
    assert [c["params"].seed for c in calls] == [(5 * 1_000_003 + i * 7919) % 2**31 for i in range(3)]
    assert all(c["params"].stop == renderer.stop() for c in calls)  # the renderer's stop ids, explicit
    again, _ = run_once()
    assert [(c["prompts"], c["params"]) for c in again] == [(c["prompts"], c["params"]) for c in calls]


class SlowOrFast(Adder):
    @tool
    async def wait(self, s: float) -> str:
        """Answer after a while.

        Args:
            s: seconds
        """
        await asyncio.sleep(s)
        return "done"


SLOW_TOOL_S = 2.0


@pytest.mark.parametrize("batch_wait", [None, 0.05])
def test_batch_wait_lets_a_request_go_without_waiting_for_a_slow_tool(renderer, batch_wait):
    # the slow tool takes 2 s: the fast episode's two turns (each within batch_wait) come first
    # even on a loaded machine, where a 0.5 s tool raced them
    script = {
        "slow": [call("wait", s=SLOW_TOOL_S), say("ok")],
        "fast": [call("add", a=1, b=1), call("add", a=2, b=2), say("4")],
    }
    model = ScriptedModel(renderer, script)

    async def play():
        queue = ModelQueue(model, SamplingParams(max_tokens=40, stop=renderer.stop()), batch_wait=batch_wait)
        queue.join(0, 1)
        return await asyncio.gather(
            *(
                run_episode(SlowOrFast(), {"q": q}, renderer, queue, i, EpisodeLimits(), 40)
                for i, q in enumerate(["slow", "fast"])
            )
        )

    t0 = time.perf_counter()
    (slow, _), (fast, _) = asyncio.run(play())
    assert (slow.stop, len(slow.turns), fast.stop, len(fast.turns)) == ("done", 2, "done", 3)
    who = [["slow" if "<|user|>slow" in renderer.decode(p) else "fast" for p in c["prompts"]] for c in model.calls]
    at = [c["t"] - t0 for c in model.calls]
    if batch_wait is None:  # lockstep: the fast episode's second turn waits for the slow tool
        assert who == [["slow", "fast"], ["slow", "fast"], ["fast"]]
        assert at[1] >= SLOW_TOOL_S
    else:  # the fast episode's turns go on their own while the slow tool runs
        assert who == [["slow", "fast"], ["fast"], ["fast"], ["slow"]]
        assert at[3] >= SLOW_TOOL_S  # the slow episode's turn went when its tool answered


# --------------------------------------------------------------------------- training through environments
class TwoTurns(WithAdd):
    """For an untrained model: whatever it says first, it is asked once more, and the episode is
    worth the share of digits in its two turns (a shaped reward that varies within a group, so
    the advantages and the update are not zero). ``add`` is offered, so prompts list a tool."""

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        self.said: list[str] = []
        return [{"role": "user", "content": example["q"]}]

    async def step(self, response: ParsedResponse) -> StepResult:
        self.said.append(response.raw)
        if len(self.said) == 1:
            return StepResult([{"role": "user", "content": "and?"}], reward=0.0, metrics={"asked_again": 1.0})
        text = "".join(self.said)
        return StepResult(reward=sum(c.isdigit() for c in text) / max(len(text), 1), done=True)


TINY_CHAT = {
    "chat": True,
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    "stage", [{"name": "grpo"}, {"name": "offpolicy", "stale": {"max_steps_off_policy": 2}}], ids=["grpo", "offpolicy"]
)
def test_rl_stages_train_through_the_environment_sampler(tmp_path, stage):
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.training.recipe import Recipe

    backend = LocalBackend(model="tiny_llama", model_kwargs=TINY_CHAT, num_threads=1)
    before = {k: v.clone() for k, v in backend.model.state_dict().items()}
    questions = [{"q": f"{a}+{b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    recipe = Recipe.from_dict(
        {
            "name": "env",
            "output_dir": str(tmp_path),
            "loggers": ["jsonl"],
            "stages": [
                {
                    **stage,
                    "id": "rl",
                    "steps": 2,
                    "prompts_per_step": 2,
                    "group_size": 4,
                    "max_tokens": 6,
                    "dataset": questions,
                    "optimizer": {"learning_rate": 1e-2},
                    "sampler": {"name": "environment", "environment": TwoTurns, "max_turns": 3},
                }
            ],
        }
    )
    recipe.run(backend=backend)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "env/turns_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert math.isfinite(r["loss"]) and r["reward/failed"] == 0.0 and r["env/masked"] == 0.0
        assert r["env/turns_mean"] == 2.0 and r["env/asked_again"] == 8.0 and r["env/row_splits"] >= 1.0
        # an episode the environment ended on a turn that did not parse (cut by max_tokens) counts as parse_error
        assert r.get("env/stop/done", 0.0) + r.get("env/stop/parse_error", 0.0) == 1.0
        assert 0.0 < r["reward/mean"] < 1.0 and r["reward/std"] > 0.0
    if stage["name"] == "offpolicy":
        assert all(r["offpolicy/staleness_max"] <= 2 for r in steps)
    else:  # 8 episodes, two turns each, in lockstep: two batched model calls per step
        assert [r["env/model_calls"] for r in steps] == [2.0, 2.0]
    after = backend.model.state_dict()
    assert any(not torch_equal(before[k], after[k]) for k in before)


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))


# --------------------------------------------------------------------------- the docs' example
def test_the_example_environment_in_the_docs_runs(renderer):
    """docs/environments.md's ``Lookup`` environment, executed from the doc itself: a lookup
    then the answer scores 1; a wrong key is an error message the model reads, not a crash."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "environments.md").read_text(encoding="utf-8")
    [code] = [block for block in doc.split("```python\n")[1:] if "class Lookup(Environment)" in block]
    namespace: dict[str, Any] = {}
    exec(code.split("```")[0], namespace)  # our own documentation
    lookup = namespace["Lookup"]
    value = (12 * 7919) % 1000
    script = {
        "value of k12?": [call("get", key="k12"), say(str(value))],
        "value of k7?": [call("get", key="k99"), say("0")],
    }
    groups, metrics, _, _ = roll(renderer, lambda: lookup(table_size=50), script, [{"key": "k12"}, {"key": "k7"}])
    good, bad = (g.samples[0] for g in groups)
    assert good.reward == 1.0 and good.trajectory.messages[2]["content"] == str(value)
    assert bad.reward == 0.0 and bad.trajectory.messages[2]["content"] == "Error: KeyError: 'k99'"
    assert metrics["env/tool_errors"] == 1.0 and metrics["env/tool_calls"] == 2.0
