"""tempering's environments and rewards inside TRL (``tempering.plugins.interop.trl``).

Fast tests: the chat template renders exactly the tokens of tempering's ``tiny_chat`` renderer
(so a model warmed up by tempering sees the same format under TRL); the TRL environment shell
plays tool calls and the final answer through the registered ``calculator`` environment; the
reward adapter scores TRL's completions; bad names and keys fail before TRL starts; and TRL's
real ``GRPOTrainer`` accepts the environment (its tool offered, its reward logged) for two steps
on a random tiny model. The learning test is tests/test_trl_interop_learning.py.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from typing import Any

import pytest

from tempering.errors import ConfigError, UnknownComponentError
from tempering.plugins.datasets.tool_use import tool_use
from tempering.plugins.interop import trl as tt
from tempering.plugins.models.tiny import tiny_llama
from tempering.plugins.renderers.tiny_chat import TinyChat
from tempering.rollouts.environment import Environment
from tempering.rollouts.tools import Tool, tool


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    _, tok = tiny_llama(chat=True)
    return tt.tiny_chat_template(tok)


def dict_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """TRL's messages carry tool-call arguments as dicts, not JSON strings."""
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def test_the_chat_template_renders_tiny_chat_token_for_token(tokenizer: Any) -> None:
    renderer = TinyChat(tokenizer)
    row = tool_use("train", size=1, transcripts=True)[0]
    messages, tools = dict_arguments(row["messages"]), row["tools"]
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    assert whole == renderer.render_prompt(messages[:-1], tools).tokens + renderer.render_response(messages[-1])
    # text outside the model's alphabet is mapped as tiny_chat maps it: lower-cased, else '?'
    odd = [*messages[:2], {"role": "tool", "name": "mul", "content": "Error: Bad ~ 'x'"}]
    ids = tokenizer.apply_chat_template(odd, tools=tools, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ids == renderer.render_prompt(odd, tools).tokens
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith("bad ? 'x'<|assistant|>")


def test_tool_calls_parse_back_with_transformers_response_parser(tokenizer: Any) -> None:
    prefix = tokenizer.apply_chat_template(
        [{"role": "user", "content": "37*84"}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    call = tokenizer("<|call|>mul(a=37,b=84)<eos>", add_special_tokens=False)["input_ids"]
    parsed = tokenizer.parse_response(call, prefix=prefix)
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "mul", "arguments": {"a": 37, "b": 84}}}]
    answer = tokenizer("3108<eos>", add_special_tokens=False)["input_ids"]
    assert tokenizer.parse_response(answer, prefix=prefix)["content"] == "3108"


def test_the_environment_plays_tool_calls_and_the_final_answer() -> None:
    calculator = tt.environment_factory("calculator")
    env = calculator()
    assert env.reset(question="37*84", answer="3108", calls=[["mul", {"a": 37, "b": 84}]]) == "37*84"
    from transformers.utils import get_json_schema

    schema = get_json_schema(env.mul)["function"]
    assert schema["name"] == "mul" and schema["description"] == "Multiply two integers."
    assert schema["parameters"]["properties"]["a"] == {"type": "integer", "description": "the first factor"}
    assert env.mul(a=37, b=84) == "3108"
    logged: dict[str, float] = {}
    right = [
        {"role": "assistant", "content": "", "tool_calls": [{}]},
        {"role": "tool", "content": "3108"},
        {"role": "assistant", "content": "3108"},
    ]
    assert tt.environment_reward([right], [env], log_metric=logged.__setitem__) == [1.0]
    assert logged == {
        "env/copied_result": 1.0,
        "env/right_calls": 1.0,
        "env/tool_calls": 1.0,
        "env/failed": 0.0,
        "env/tool_errors": 0.0,
        "env/tool_timeouts": 0.0,
    }
    assert [m["role"] for m in env._transcript] == ["user", "assistant", "tool", "assistant"]

    # a pooled instance starts over at reset: a wrong answer, a failing call, a rollout cut after a tool result
    assert env.reset(question="12*10", answer="120") == "12*10"
    assert env._metrics == {} and env._reward is None
    with pytest.raises(tt.ToolFailed, match="bad arguments for mul"):  # TRL counts it (tools/failure_frequency)
        env.mul(a=12)
    assert env._errors and "bad arguments for mul" in env._errors[0]
    assert env._metrics["tool_errors"] == 1.0 and env._transcript[-1]["content"].startswith("Error: bad arguments")
    assert tt.environment_reward([[{"role": "assistant", "content": "121"}]], [env]) == [0.0]
    other = calculator()
    other.reset(question="12*10", answer="120")
    other.mul(a=12, b=10)
    assert tt.environment_reward([[{"role": "tool", "content": "120"}]], [other]) == [0.0]
    # no 'calls' column (dropped, or never there): right_calls is not measured, so not logged as 0
    logged.clear()
    bare = calculator()
    bare.reset(question="12*10", answer="120")
    bare.mul(a=12, b=10)
    tt.environment_reward([[{"role": "assistant", "content": "120"}]], [bare], log_metric=logged.__setitem__)
    assert "env/right_calls" not in logged and logged["env/tool_calls"] == 1.0


def test_a_tool_schema_without_a_typed_function_reaches_trl_intact() -> None:
    """The methods are built from each tool's JSON schema, so a tool whose function takes
    ``**kwargs`` (the openenv environment's action) shows TRL the same schema."""
    from transformers.utils import get_json_schema

    parameters = {
        "type": "object",
        "required": ["guess"],
        "properties": {"guess": {"type": "integer", "description": "your guess, 1 to 9"}, "note": {"type": "string"}},
    }
    seen: list[dict[str, Any]] = []

    class Free(Environment):
        def tools(self) -> list[Tool]:
            async def act(**action: Any) -> str:
                seen.append(action)
                return "ok"

            return [Tool(name="act", fn=act, description="Guess the hidden number.", parameters=parameters)]

    env = tt.environment_factory(Free)()
    env.reset(prompt=None, messages=[{"role": "user", "content": "go"}])
    schema = get_json_schema(env.act)["function"]
    assert schema["description"] == "Guess the hidden number." and schema["parameters"]["required"] == ["guess"]
    assert schema["parameters"]["properties"]["guess"] == {"type": "integer", "description": "your guess, 1 to 9"}
    assert schema["parameters"]["properties"]["note"]["description"] == "note"
    assert env.act(guess=3) == "ok" and seen == [{"guess": 3}]
    calculator = tt.environment_factory("calculator")()
    [mul] = calculator.__class__._make().tools()
    assert get_json_schema(calculator.mul)["function"]["parameters"] == mul.parameters


def test_reset_refuses_a_prompt_it_cannot_hold() -> None:
    class TwoMessages(Environment):
        async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
            return [{"role": "system", "content": "be brief"}, {"role": "user", "content": example["q"]}]

    env = tt.environment_factory(TwoMessages)()
    with pytest.raises(ValueError, match="leave 'prompt' out of the dataset"):
        env.reset(q="hi")
    rows = tt.prompts([{"q": "hi"}], tt.environment_factory(TwoMessages))
    assert rows == [
        {"q": "hi", "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]}
    ]
    assert env.reset(**rows[0]) is None  # the row's prompt already is the environment's


def test_prompts_keeps_the_prompt_column_the_environment_reads() -> None:
    """An environment whose reset reads the example's own ``prompt``: ``tt.prompts`` (what the
    adapter's error recommends) fills TRL's ``prompt`` and the environment still gets its own."""

    class ReadsPrompt(Environment):
        async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
            return [{"role": "system", "content": "be brief"}, {"role": "user", "content": example["prompt"]}]

    factory = tt.environment_factory(ReadsPrompt)
    [row] = tt.prompts([{"prompt": "what is 2+3?"}], factory)
    assert row["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+3?"}]
    env = factory()
    assert env.reset(**row) is None and env._transcript[1]["content"] == "what is 2+3?"


def test_a_hanging_environment_is_cut_off_by_the_timeout() -> None:
    class Hangs(Environment):
        @tool
        async def wait(self, seconds: float) -> str:
            """Wait.

            Args:
                seconds: how long
            """
            await asyncio.sleep(seconds)
            return "done"

        async def step(self, response: Any) -> Any:
            await asyncio.sleep(30)

    env = tt.environment_factory(Hangs, timeout=0.2)()
    env.reset(prompt=None, messages=[{"role": "user", "content": "go"}])
    with pytest.raises(TimeoutError, match=r"environment.step\(\) did not return within 0.2 s"):
        env.wait(seconds=1)
    # on the final turn the episode's reward is None (TRL skips it) and the failure is counted
    logged: dict[str, float] = {}
    assert tt.environment_reward([[{"role": "assistant", "content": "x"}]], [env], log_metric=logged.__setitem__) == [
        None
    ]
    assert logged["env/failed"] == 1.0 and "did not return within 0.2 s" in env._errors[-1]


def test_registered_rewards_score_trl_completions() -> None:
    exact, math = tt.reward_funcs("exact_match", {"name": "exact_match", "answer_key": "solution"})
    assert exact.__name__ == "exact_match"
    completions = [[{"role": "assistant", "content": " 42 "}], [{"role": "assistant", "content": "41"}]]
    columns = {"answer": ["42", "42"], "solution": ["41", "41"], "trainer_state": None, "log_metric": print}
    assert exact(prompts=[[], []], completions=completions, **columns) == [1.0, 0.0]
    assert math(prompts=[[], []], completions=completions, **columns) == [0.0, 1.0]
    # a reward that fails on a row gives None (TRL leaves the row out of that reward)
    assert exact(prompts=[[]], completions=["42"], solution=["1"]) == [None]


def test_bad_names_and_keys_fail_before_trl_starts() -> None:
    with pytest.raises(UnknownComponentError, match=r"environment_factory\.name: unknown environment 'calculater'"):
        tt.environment_factory("calculater")
    with pytest.raises(ConfigError, match="environment_factory"):
        tt.environment_factory("calculator", depth=3)
    with pytest.raises(UnknownComponentError, match=r"reward_funcs\[0\].name: unknown reward"):
        tt.reward_funcs("exact_mach")
    _, plain = tiny_llama()
    with pytest.raises(ValueError, match=re.escape("no <|call|> token")):
        tt.tiny_chat_template(plain)


def test_trls_grpo_trainer_takes_the_environment(tokenizer: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """Two real GRPOTrainer steps on a random tiny model: TRL offers the environment's tool,
    scores every rollout through it and logs its metrics."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    model, _ = tiny_llama(chat=True, max_position_embeddings=128)
    rows = Dataset.from_list([{"question": r["question"], "answer": r["answer"]} for r in tool_use("train", size=8)])
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=24,
        max_steps=2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        max_tool_calling_iterations=2,
    )
    trainer = GRPOTrainer(
        model=model,
        processing_class=tokenizer,
        args=args,
        train_dataset=rows,
        environment_factory=tt.environment_factory("calculator"),
        reward_funcs=[tt.environment_reward],
    )
    assert [t.__name__ for t in trainer.tools] == ["mul"]
    trainer.train()
    logged = [h for h in trainer.state.log_history if "rewards/environment_reward/mean" in h]
    assert len(logged) == 2
    assert all(0.0 <= h["rewards/environment_reward/mean"] <= 1.0 for h in logged)
    pool = trainer._environment_pool[None]
    assert len(pool) >= 8 and all(e._done for e in pool[:8])  # every rollout was scored by its environment
