"""``vf-sums``: a verifiers 0.4 environment for tempering's tests -- single turn, a rubric.

Each task asks for a sum (``"3+4="``); the rubric's one reward, ``correct``, is 1 when the
model's reply is the sum, and its metric ``length`` is the reply's length. The harness is one
chat call, made in-process through the rollout's interception endpoint (verifiers' contract: a
harness may run its loop in-process as long as every model call goes through ``endpoint``).
``args: {taskset: {size: N}}`` sets the number of tasks.
"""

from __future__ import annotations

from collections.abc import Iterator

import verifiers.v1 as vf
from openai import AsyncOpenAI


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward
    async def correct(self, task: SumData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)

    @vf.metric
    async def length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class SumConfig(vf.TasksetConfig):
    size: int = 8


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> Iterator[SumTask]:
        for i in range(self.config.size):
            a, b = i % 5, (3 * i) % 5
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=str(a + b)))


class OneCall(vf.Harness[vf.HarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):  # type: ignore[no-untyped-def]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            _, prompt = self.resolve_prompt(data)
            out = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": prompt}])
        return vf.ProgramResult(exit_code=0, stdout=out.choices[0].message.content or "", stderr="")


__all__ = ["OneCall", "SumTaskset"]
