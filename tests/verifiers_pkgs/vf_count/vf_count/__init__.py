"""``vf-count``: a verifiers 0.4 environment for tempering's tests -- endless, with a named seat.

Like verifiers' own textarena: the taskset never ends (``INFINITE``: task ``i`` asks for
``"{i % 5}+1="``), and the environment's config names its one seat ``player`` instead of
``agent`` (so a config that sets ``agent`` is invalid for it). The harness is one chat call; the
rubric's ``correct`` is 1 when the reply is the sum.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import verifiers.v1 as vf
from openai import AsyncOpenAI


class CountData(vf.TaskData):
    answer: str = ""


class CountTask(vf.Task[CountData]):
    @vf.reward
    async def correct(self, task: CountData, trace: vf.Trace) -> float:
        return float(trace.last_reply == task.answer)


class CountTaskset(vf.Taskset[CountTask, vf.TasksetConfig]):
    INFINITE = True

    def load(self) -> Iterator[CountTask]:
        for i in itertools.count():
            yield CountTask(CountData(prompt=f"{i % 5}+1=", answer=str(i % 5 + 1)))


class CountEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


class CountEnv(vf.Env[CountEnvConfig]):
    async def run(self, task, agents):  # type: ignore[no-untyped-def]
        await agents.player.run(task)


class OneCall(vf.Harness[vf.HarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):  # type: ignore[no-untyped-def]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            _, prompt = self.resolve_prompt(data)
            out = await client.chat.completions.create(model=ctx.model, messages=[{"role": "user", "content": prompt}])
        return vf.ProgramResult(exit_code=0, stdout=out.choices[0].message.content or "", stderr="")


__all__ = ["CountEnv", "CountTaskset", "OneCall"]
