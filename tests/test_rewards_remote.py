"""The reward server (real HTTP on 127.0.0.1) and the ``remote`` reward: per-sample errors,
retries with backoff, batching, the concurrency limit, and surviving a server that is killed
mid-run and restarted on the same port (in-process and as a ``tempering serve-reward``
subprocess killed with SIGKILL)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tempering.plugins.rewards.remote import RemoteReward
from tempering.registry import get_registry
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample

ASYNC_TARGET = "tempering.plugins.rewards.testing:async_length"
SYNC_TARGET = "tempering.plugins.rewards.testing:length"


def mk(items) -> list[Sample]:
    return [Sample(example=dict(e), completion=Completion([], [], [], text=t)) for t, e in items]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(reward_server):
    return lambda target=ASYNC_TARGET, port=0, **kw: reward_server(target, port, **kw)


# --------------------------------------------------------------------------- the server
def test_server_endpoints_and_per_sample_errors(server):
    url, _ = server(SYNC_TARGET)
    with httpx.Client(trust_env=False) as c:
        health = c.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["reward"] == SYNC_TARGET
        body = {
            "samples": [
                {"completion": "abc", "example": {}},
                {"completion": "x", "example": {"fail": "bug"}},
                {"completion": "y", "example": {"nan": True}},
                {"completion": "hello"},
            ]
        }
        r = c.post(f"{url}/score", json=body)
        assert r.status_code == 200
        out = r.json()
        assert out["rewards"] == [3.0, None, None, 5.0]
        assert out["errors"][0] is None and out["errors"][3] is None
        assert "ValueError: asked to fail: bug" in out["errors"][1] and "not a finite number" in out["errors"][2]
        assert c.post(f"{url}/score", content=b"{not json").status_code == 400
        assert c.post(f"{url}/score", json={"samples": [{"example": {}}]}).status_code == 400
        assert c.post(f"{url}/nope", json={}).status_code == 404
        assert c.get(f"{url}/").status_code == 404


def test_server_runs_async_rewards_concurrently_and_returns_info(server):
    url, _ = server(ASYNC_TARGET)
    body = {"samples": [{"completion": "ab", "example": {"sleep_s": 0.5}} for _ in range(10)]}
    t0 = time.perf_counter()
    out = httpx.post(f"{url}/score", json=body, trust_env=False, timeout=10).json()
    elapsed = time.perf_counter() - t0
    assert out["rewards"] == [2.0] * 10
    # concurrent: about 0.5 s; one after another: 5 s. 2.5 s leaves room for a loaded machine
    assert elapsed < 2.5, f"10 x 0.5 s async samples took {elapsed:.2f}s: not concurrent"
    url2, _ = server("tempering.plugins.rewards.testing:length_with_pid")
    out = httpx.post(f"{url2}/score", json={"samples": [{"completion": "a", "example": {}}]}, trust_env=False).json()
    assert out["infos"] == [{"pid": os.getpid()}]


def test_server_accepts_a_registered_reward_name(server):
    url, _ = server("math_answer")
    body = {
        "samples": [
            {"completion": r"\boxed{\frac{1}{2}}", "example": {"answer": "0.5"}},
            {"completion": "7", "example": {}},
        ]
    }
    out = httpx.post(f"{url}/score", json=body, trust_env=False).json()
    assert out["rewards"] == [1.0, None] and "no 'answer'" in out["errors"][1]
    assert out["infos"][0]["method"] == "boxed"


def test_feedback_travels_over_the_protocol(server):
    url, _ = server("exact_match")
    body = {
        "samples": [
            {"completion": "41", "example": {"answer": "42"}},
            {"completion": "42", "example": {"answer": "42"}},
            {"completion": "42", "example": {}},
        ]
    }
    out = httpx.post(f"{url}/score", json=body, trust_env=False).json()
    assert out["rewards"] == [0.0, 1.0, None] and out["feedbacks"] == ["expected '42', got '41'", None, None]
    reward = get_registry().build(
        "reward", {"name": "remote", "url": url, "batch_size": 2, "batch_wait": 0.2}, "reward"
    )
    ss = mk([("41", {"answer": "42"}), ("42", {"answer": "42"})])
    assert RewardRunner(reward).score(ss).scored == 2
    assert [(s.reward, s.feedback, s.reward_info) for s in ss] == [
        (0.0, "expected '42', got '41'", {}),
        (1.0, None, {}),
    ]


# --------------------------------------------------------------------------- the remote reward
def test_remote_reward_scores_and_records_server_side_failures(server):
    url, _ = server(ASYNC_TARGET)
    reward = get_registry().build("reward", {"name": "remote", "url": url, "retries": 1, "backoff": 0.01}, "reward")
    ss = mk([("abc", {}), ("x", {"fail": "bug"}), ("y", {"nan": True}), ("hello", {"sleep_s": 0.01})])
    stats = RewardRunner(reward).score(ss)
    assert (stats.scored, stats.failed) == (2, 2)
    assert [s.reward for s in ss] == [3.0, 0.0, 0.0, 5.0]
    assert "asked to fail" in ss[1].error and "not a finite number" in ss[2].error
    assert reward.requests == 4  # batch_size 1: one request per sample


def test_remote_batching_sends_many_samples_per_request(server):
    url, stop = server(ASYNC_TARGET)
    reward = RemoteReward(url, batch_size=4, batch_wait=0.05)
    ss = mk([("a" * i, {"fail": "odd"} if i == 5 else {}) for i in range(10)])
    stats = RewardRunner(reward).score(ss)
    assert (stats.scored, stats.failed) == (9, 1) and ss[5].failed
    assert [s.reward for i, s in enumerate(ss) if i != 5] == [0, 1, 2, 3, 4, 6, 7, 8, 9]
    assert reward.requests == 3  # 4 + 4 + 2
    assert stop.server.requests_served == 3

    async def direct():
        try:
            return await reward.score_many([("ab", {}), ("abc", {"fail": 1}), ("abcd", {})])
        finally:
            await reward.aclose()

    many = asyncio.run(direct())
    assert many[0] == 2.0 and isinstance(many[1], Exception) and many[2] == 4.0


def test_remote_concurrency_limit(server):
    class Tracking:
        def __init__(self):
            self.now = self.peak = 0
            self.lock = threading.Lock()

        def __call__(self, completion, example):
            with self.lock:
                self.now += 1
                self.peak = max(self.peak, self.now)
            time.sleep(0.05)
            with self.lock:
                self.now -= 1
            return 1.0

    tracking = Tracking()
    url, _ = server(tracking)
    stats = RewardRunner(RemoteReward(url, concurrency=2)).score(mk([("x", {})] * 8))
    assert stats.scored == 8 and tracking.peak == 2


@pytest.fixture
def scripted(json_server):
    """``make(script) -> url``: a reward server answering POST /score from a script of
    (status, delay_s) pairs, then 200s; ``make.hits`` holds the arrival times."""
    from tempering.runs.serving import Reply

    state: dict = {"script": [], "hits": []}

    def answer(call):
        samples = call.json["samples"]
        state["hits"].append(time.perf_counter())
        status, delay = state["script"].pop(0) if state["script"] else (200, 0)
        time.sleep(delay)
        if status != 200:
            return Reply(status, {"error": "scripted"})
        return Reply(200, {"rewards": [1.0] * len(samples), "errors": [None] * len(samples)})

    url = json_server(answer)

    def make(script):
        state["script"], state["hits"] = list(script), []
        make.hits = state["hits"]
        return url

    return make


def test_retries_with_exponential_backoff(scripted):
    url = scripted([(503, 0), (500, 0), (429, 0)])
    ss = mk([("x", {})])
    stats = RewardRunner(RemoteReward(url, retries=3, backoff=0.05, backoff_max=1.0)).score(ss)
    assert stats.scored == 1 and ss[0].reward == 1.0
    hits = scripted.hits
    gaps = [b - a for a, b in zip(hits, hits[1:])]
    assert len(hits) == 4
    # delays 0.05, 0.1, 0.2 (+-25 % jitter): each gap at least 0.75x, and growing
    assert gaps[0] >= 0.0375 and gaps[1] >= 0.075 and gaps[2] >= 0.15 and gaps[2] > gaps[0], gaps


def test_retries_exhausted_client_errors_and_timeouts_are_failures(scripted):
    url = scripted([(503, 0)] * 3)
    ss = mk([("x", {})])
    stats = RewardRunner(RemoteReward(url, retries=2, backoff=0.01)).score(ss)
    assert stats.failed == 1 and "after 3 attempt(s)" in ss[0].error and "HTTP 503" in ss[0].error
    url = scripted([(400, 0)])
    ss = mk([("x", {})])
    RewardRunner(RemoteReward(url, retries=3, backoff=0.01)).score(ss)
    assert ss[0].failed and "HTTP 400" in ss[0].error and len(scripted.hits) == 1  # 4xx: no retry
    url = scripted([(200, 1.0), (200, 1.0)])
    ss = mk([("x", {})])
    t0 = time.perf_counter()
    RewardRunner(RemoteReward(url, timeout=0.2, retries=1, backoff=0.01)).score(ss)
    assert ss[0].failed and "timed out" in ss[0].error and time.perf_counter() - t0 < 1.5


# --------------------------------------------------------------------------- kill and restart
def test_server_killed_mid_run_fails_those_samples_then_recovers_on_restart(server):
    port = free_port()
    url, stop = server(ASYNC_TARGET, port=port)
    reward = RemoteReward(url, retries=2, backoff=0.02, timeout=2.0, batch_size=4)
    runner = RewardRunner(reward, timeout=10)
    history = []
    keepalive = httpx.Client(trust_env=False)
    for step in range(6):
        if step == 2:
            assert keepalive.get(f"{url}/health").status_code == 200  # an open keep-alive connection
            stop()  # the server goes away between batches
            with pytest.raises(httpx.TransportError):  # ... and stops answering on it too
                keepalive.get(f"{url}/health")
            keepalive.close()
        if step == 4:
            url2, _ = server(ASYNC_TARGET, port=port)  # and comes back on the same port
            assert url2 == url
        batch = mk([("abc", {}) for _ in range(8)])
        stats = runner.score(batch)  # never raises
        history.append((stats.scored, stats.failed))
        if 2 <= step < 4:
            assert all(s.failed and "ConnectError" in s.error for s in batch)
    assert history == [(8, 0), (8, 0), (0, 8), (0, 8), (8, 0), (8, 0)]


def _spawn_cli(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tempering", "serve-reward", ASYNC_TARGET, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False, timeout=0.5).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.05)
        if proc.poll() is not None:
            raise AssertionError(f"serve-reward exited: {proc.stdout.read()}")
    proc.kill()
    raise AssertionError("serve-reward did not come up")


def test_cli_server_sigkilled_during_a_request_then_restarted():
    port = free_port()
    proc = _spawn_cli(port)
    try:
        line = proc.stdout.readline()
        assert "serving async reward" in line and f"127.0.0.1:{port}" in line and "POST /score" in line
        reward = RemoteReward(f"http://127.0.0.1:{port}", retries=2, backoff=0.05, timeout=5.0, batch_size=8)
        runner = RewardRunner(reward, timeout=30)
        ok = mk([("abcd", {})] * 8)
        assert runner.score(ok).scored == 8
        # kill -9 while a slow batch is being scored on the server
        slow = mk([("abcd", {"sleep_s": 2.0})] * 8)
        threading.Timer(0.3, lambda: os.kill(proc.pid, signal.SIGKILL)).start()
        t0 = time.perf_counter()
        stats = runner.score(slow)
        assert stats.failed == 8 and time.perf_counter() - t0 < 3.0
        proc.wait(timeout=5)
        assert proc.returncode == -signal.SIGKILL
        proc.stdout.close()
        proc = _spawn_cli(port)  # restart on the same port
        again = mk([("abcde", {})] * 8)
        assert runner.score(again).scored == 8 and {s.reward for s in again} == {5.0}
    finally:
        proc.kill()
        proc.wait(timeout=5)
        proc.stdout.close()
