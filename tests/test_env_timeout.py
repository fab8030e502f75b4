"""``sampler.env_timeout`` (issue 24 item 1): an environment call -- reset, step, cleanup, the
group score -- that never returns fails its episode as a counted ``env_timeout`` naming the key,
instead of hanging the run. Both ways a call can hang are covered: an ``await`` that never
finishes, and code that blocks (a synchronous sleep or wait inside ``async def step``), which
would freeze a loop shared with the model's batching; environment code runs on a loop of its
own per episode, so the sampler's loop keeps time. Every test is bounded to a few seconds."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from test_environments import Adder, renderer, roll, say  # noqa: F401 - renderer is a fixture

from tempering.rollouts.environment import StepResult

RELEASE = threading.Event()  # set at the end, so a blocked environment thread finishes


@pytest.fixture(autouse=True)
def _release_blocked_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


class Hangs(Adder):
    """``fail: await`` awaits forever in ``step``; ``fail: block`` blocks its thread; ``fail:
    reset`` hangs in ``reset``; anything else plays normally."""

    async def reset(self, example: dict[str, Any]) -> list[dict[str, Any]]:
        self.q, self.fail, self.answer = example["q"], example.get("fail"), example.get("answer")
        if self.fail == "reset":
            await asyncio.Event().wait()
        return [{"role": "user", "content": self.q}]

    async def step(self, response: Any) -> StepResult:
        if self.fail == "await":
            await asyncio.Event().wait()
        if self.fail == "block":
            RELEASE.wait(20)  # a blocking call inside async code: no await, the loop cannot run
        return await super().step(response)


@pytest.mark.parametrize("fail, where", [("await", "step"), ("block", "step"), ("reset", "reset")])
def test_a_hanging_environment_call_is_a_counted_failure_naming_the_key(renderer, fail, where):
    script = {q: [say("3")] for q in ("ok?", "hang?")}
    examples = [{"q": "ok?", "answer": "3"}, {"q": "hang?", "answer": "3", "fail": fail}]
    t0 = time.perf_counter()
    groups, metrics, _, _ = roll(renderer, Hangs, script, examples, group_size=2, env_timeout=0.5)
    assert time.perf_counter() - t0 < 8.0
    ok, hung = groups
    assert [(s.failed, s.reward) for s in ok.samples] == [(False, 1.0)] * 2  # the others went on
    assert all(s.failed and s.trajectory.stop == "error" for s in hung.samples)
    assert metrics["failed/env_timeout"] == 2.0 and metrics["reward/failed"] == 2.0
    text = metrics["first_error/env_timeout"]
    assert f"environment.{where}() did not return within 0.5 s" in text and "sampler.env_timeout" in text


class SlowGroupScore(Adder):
    async def group_reward(self, trajectories: list) -> list[float]:
        await asyncio.Event().wait()
        return [0.0] * len(trajectories)  # pragma: no cover


def test_a_hanging_group_score_fails_its_group_naming_the_key(renderer):
    t0 = time.perf_counter()
    [group], metrics, _, _ = roll(
        renderer, SlowGroupScore, {"1+2?": [say("3")]}, [{"q": "1+2?", "answer": "3"}], group_size=2, env_timeout=0.5
    )
    assert time.perf_counter() - t0 < 8.0
    assert [s.failed for s in group.samples] == [True, True]
    assert "group_reward() did not return within 0.5 s" in metrics["first_error/env_timeout"]


def test_env_timeout_has_a_default_for_long_agent_steps_and_bad_values_name_the_key(renderer):
    from test_environments import sampler

    from tempering.errors import ConfigError
    from tempering.plugins.samplers.environment import EnvironmentSampler

    assert EnvironmentSampler.env_timeout == 600.0
    assert sampler(renderer, Adder).limits.env_timeout == 600.0
    with pytest.raises(ConfigError, match=r"^sampler\.env_timeout: must be > 0 \(seconds\) or null"):
        sampler(renderer, Adder, env_timeout=0)
