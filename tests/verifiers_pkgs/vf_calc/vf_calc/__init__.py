"""``vf-calc``: a verifiers 0.4 environment for tempering's tests -- multi-turn, with a tool.

Each task asks for a sum (``"12+5?"``) and offers one tool, ``add(a, b)``. The harness is an
agent loop run in-process through the rollout's interception endpoint: it runs each tool call
the model makes and asks again, for at most three model calls. The rubric: ``correct`` (1 when
the final reply is the sum); the metric ``tool_calls`` counts the tool results in the trace.
A task whose prompt is ``"boom"`` makes the reward raise (a task error, for failure tests).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import verifiers.v1 as vf
from openai import AsyncOpenAI

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


class CalcData(vf.TaskData):
    answer: str = ""


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def correct(self, task: CalcData, trace: vf.Trace) -> float:
        if task.prompt == "boom":
            raise RuntimeError("the rubric failed on purpose")
        return float(trace.last_reply == task.answer)

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages))


class CalcConfig(vf.TasksetConfig):
    size: int = 6
    boom: bool = False


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> Iterator[CalcTask]:
        if self.config.boom:
            yield CalcTask(CalcData(prompt="boom", answer="0"))
        for i in range(self.config.size):
            a, b = 10 + i, 2 + i
            yield CalcTask(CalcData(prompt=f"{a}+{b}?", answer=str(a + b)))


class AddLoop(vf.Harness[vf.HarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):  # type: ignore[no-untyped-def]
        _, prompt = self.resolve_prompt(data)
        messages = [{"role": "user", "content": prompt}]
        reply = ""
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            for _turn in range(3):
                out = await client.chat.completions.create(model=ctx.model, messages=messages, tools=[ADD])
                message = out.choices[0].message
                reply = message.content or ""
                if not message.tool_calls:
                    break
                messages.append(
                    {"role": "assistant", "content": reply, "tool_calls": [c.model_dump() for c in message.tool_calls]}
                )
                for call in message.tool_calls:
                    try:
                        args = json.loads(call.function.arguments)
                        result = str(int(args["a"]) + int(args["b"]))
                    except (KeyError, TypeError, ValueError) as exc:
                        result = f"Error: {exc}"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return vf.ProgramResult(exit_code=0, stdout=reply, stderr="")


__all__ = ["AddLoop", "CalcTaskset"]
