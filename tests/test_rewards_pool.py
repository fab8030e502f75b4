"""process_pool: CPU-heavy rewards in worker processes, per-call timeouts, recycling a pool
whose worker hangs or dies."""

from __future__ import annotations

import os
import time

import pytest

from tempering.plugins.rewards.pool import ProcessPoolReward
from tempering.plugins.rewards.testing import length_with_pid
from tempering.registry import get_registry
from tempering.rollouts.scoring import RewardRunner, _is_async
from tempering.types import Completion, Sample

TARGET = "tempering.plugins.rewards.testing:length_with_pid"


def mk(items) -> list[Sample]:
    return [Sample(example=dict(e), completion=Completion([], [], [], text=t)) for t, e in items]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture(scope="module")
def pool():
    reward = ProcessPoolReward(TARGET, workers=2, timeout=1.0)
    reward.start()
    yield reward
    reward.close()


def test_runs_in_worker_processes_in_parallel(pool):
    assert _is_async(pool) and pool.max_concurrency == 2
    ss = mk([("a" * i, {"burn_ms": 100}) for i in range(4)])
    stats = RewardRunner(pool).score(ss)
    assert stats.scored == 4 and [s.reward for s in ss] == [0.0, 1.0, 2.0, 3.0]
    pids = {s.reward_info["pid"] for s in ss}
    assert len(pids) == 2 and os.getpid() not in pids  # both workers took work


def test_reward_errors_and_nan_are_failures(pool):
    ss = mk([("ok", {}), ("x", {"fail": "checker bug"}), ("y", {"nan": True})])
    stats = RewardRunner(pool).score(ss)
    assert (stats.scored, stats.failed) == (1, 2)
    assert "ValueError: asked to fail: checker bug" in ss[1].error
    assert "not a finite number" in ss[2].error


def test_hung_worker_times_out_pool_is_recycled_and_later_calls_work():
    reward = ProcessPoolReward(TARGET, workers=2, timeout=0.5)
    try:
        old = reward.start()
        ss = mk([("hang", {"hang": True}), ("ab", {"burn_ms": 50}), ("abc", {"burn_ms": 50})])
        t0 = time.perf_counter()
        stats = RewardRunner(reward).score(ss)
        assert time.perf_counter() - t0 < 5
        assert (stats.scored, stats.failed, stats.timeouts) == (2, 1, 1)
        assert ss[0].failed and "longer than 0.5s" in ss[0].error and "recycled" in ss[0].error
        assert [s.reward for s in ss[1:]] == [2.0, 3.0]  # neighbours of the hung call were not failed
        assert reward.recycled == 1
        deadline = time.time() + 5
        while any(alive(p) for p in old) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in old), "the retired pool's workers (one hung) were not killed"
        ss = mk([("abcd", {}), ("abcde", {})])
        assert RewardRunner(reward).score(ss).scored == 2 and [s.reward for s in ss] == [4.0, 5.0]
        assert not {s.reward_info["pid"] for s in ss} & set(old)  # a fresh pool
    finally:
        reward.close()


def test_crashed_worker_is_a_failure_and_the_pool_recovers():
    reward = ProcessPoolReward(TARGET, workers=1, timeout=5.0)
    try:
        ss = mk([("boom", {"crash": True})])
        stats = RewardRunner(reward).score(ss)
        assert stats.failed == 1 and "died" in ss[0].error and reward.recycled == 1
        ss = mk([("fine", {})])
        assert RewardRunner(reward).score(ss).scored == 1 and ss[0].reward == 4.0
    finally:
        reward.close()


def test_built_from_config_with_a_registered_reward_and_params():
    spec = {"name": "process_pool", "reward": "math_answer", "params": {"abs_tol": 0.01}, "workers": 1, "timeout": 20}
    reward = get_registry().build("reward", spec, "reward")
    try:
        ss = mk([(r"\boxed{3.004}", {"answer": "3"}), ("3.5", {"answer": "3"})])
        assert RewardRunner(reward).score(ss).scored == 2
        assert [s.reward for s in ss] == [1.0, 0.0] and ss[0].reward_info["method"] == "boxed"
    finally:
        reward.close()


def test_callable_reward_and_bad_configs():
    reward = ProcessPoolReward(length_with_pid, workers=1)
    try:
        ss = mk([("abc", {})])
        assert RewardRunner(reward).score(ss).scored == 1 and ss[0].reward == 3.0
    finally:
        reward.close()
    with pytest.raises(ValueError, match="params"):
        ProcessPoolReward(length_with_pid, params={"x": 1})
    with pytest.raises(ValueError, match="start_method"):
        ProcessPoolReward(TARGET, start_method="teleport")
    # an unimportable target fails when the reward is configured, not as a failure of every call
    with pytest.raises(ValueError, match=r"^process_pool\.reward: cannot import module 'no_such_module_xyz'"):
        ProcessPoolReward("no_such_module_xyz:f", workers=1)
