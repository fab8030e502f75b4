"""Access to a reward server: a shared-secret token (bearer header, constant-time compare), no
non-loopback bind without one, the token never printed, request size capped -- and the
``tempering`` console script serving a ``module:function`` from the folder it runs in.

Before: ``serve-reward`` answered anyone who could reach the port, and
``tempering serve-reward my_mod:f`` failed with 'No module named my_mod' in my_mod's folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tempering.errors import ConfigError
from tempering.plugins.rewards import server as server_module
from tempering.plugins.rewards.remote import TOKEN_ENV, RemoteReward
from tempering.plugins.rewards.server import (
    check_access,
    is_loopback,
    make_server,
)
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample

TARGET = "tempering.plugins.rewards.testing:length"
SECRET = "s3cret-token-for-tests-0123456789"


def samples(*texts: str) -> list[Sample]:
    return [Sample(example={}, completion=Completion([], [], [], text=t)) for t in texts]


@pytest.fixture
def served(reward_server):
    return lambda **kw: reward_server(TARGET, **kw)[0]


def test_a_token_is_required_and_compared_in_constant_time(served, monkeypatch):
    compared = []
    real = server_module.hmac.compare_digest
    monkeypatch.setattr(server_module.hmac, "compare_digest", lambda a, b: compared.append(1) or real(a, b))
    url = served(token=SECRET)
    body = {"samples": [{"completion": "abc", "example": {}}]}
    with httpx.Client(trust_env=False) as c:
        missing = c.post(f"{url}/score", json=body)
        assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
        assert TOKEN_ENV in missing.json()["error"] and SECRET not in missing.text
        assert c.post(f"{url}/score", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert c.post(f"{url}/score", json=body, headers={"Authorization": f"Basic {SECRET}"}).status_code == 401
        assert c.get(f"{url}/health").status_code == 401
        ok = c.post(f"{url}/score", json=body, headers={"Authorization": f"Bearer {SECRET}"})
        assert ok.status_code == 200 and ok.json()["rewards"] == [3.0]
    assert len(compared) == 2  # both bearer values went through hmac.compare_digest


def test_the_remote_reward_sends_the_token_from_the_environment(served, monkeypatch):
    url = served(token=SECRET)
    refused = samples("abcd")
    RewardRunner(RemoteReward(url, retries=0), timeout=10).score(refused)
    assert refused[0].failed and "HTTP 401" in refused[0].error  # no token: a recorded failure, not a 0

    monkeypatch.setenv(TOKEN_ENV, SECRET)
    reward = RemoteReward(url, retries=0)
    scored = samples("abcd", "ab")
    assert RewardRunner(reward, timeout=10).score(scored).scored == 2 and [s.reward for s in scored] == [4.0, 2.0]
    assert SECRET not in repr(reward)  # the token is not a field: it never shows in a printed config
    other = RemoteReward(url, retries=0, token_env="SOME_OTHER_VAR")
    assert "Authorization" not in other._headers


def test_no_token_means_loopback_only():
    for host in ("127.0.0.1", "::1", "localhost"):
        assert is_loopback(host)
        check_access(host, None)
    for host in ("0.0.0.0", "", "192.168.1.10", "::"):
        assert not is_loopback(host)
        with pytest.raises(
            ConfigError,
            match=rf"^serve-reward --host: refusing to serve on '{host}' without a token: "
            rf".*Set {TOKEN_ENV} to a shared secret",
        ):
            check_access(host, None)
        check_access(host, SECRET)
    with pytest.raises(ConfigError, match=r"refusing to serve on '0.0.0.0'"):
        make_server(TARGET, host="0.0.0.0", port=0)  # refused before binding anything
    with pytest.raises(ConfigError, match="the token is empty"):
        check_access("127.0.0.1", "  ")


def test_request_size_is_capped(served):
    url = served(max_body=1000)
    with httpx.Client(trust_env=False) as c:
        big = c.post(f"{url}/score", json={"samples": [{"completion": "x" * 2000, "example": {}}]})
        assert big.status_code == 413 and "limit of 1000 bytes" in big.json()["error"]
        small = c.post(f"{url}/score", json={"samples": [{"completion": "x" * 10, "example": {}}]})
        assert small.status_code == 200 and small.json()["rewards"] == [10.0]


def test_the_console_script_serves_a_module_from_its_folder_without_printing_the_token(tmp_path):
    script = Path(sys.executable).with_name("tempering")
    if not script.exists():
        pytest.skip("the tempering console script is not installed next to this interpreter")
    (tmp_path / "my_reward_mod.py").write_text("def f(completion, example):\n    return 2.0 * len(completion)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {TOKEN_ENV: SECRET}
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [str(script), "serve-reward", "my_reward_mod:f", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert "serving sync reward 'my_reward_mod:f'" in line and "requests need the token" in line, line
        headers = {"Authorization": f"Bearer {SECRET}"}
        deadline = time.time() + 20
        while True:
            try:
                reply = httpx.post(
                    f"http://127.0.0.1:{port}/score",
                    headers=headers,
                    trust_env=False,
                    json={"samples": [{"completion": "abc", "example": {}}]},
                )
                break
            except httpx.TransportError:
                assert time.time() < deadline, "the server did not come up"
                time.sleep(0.05)
        assert reply.json()["rewards"] == [6.0]
        assert httpx.get(f"http://127.0.0.1:{port}/health", trust_env=False).status_code == 401
    finally:
        proc.terminate()
        out = line + proc.communicate(timeout=10)[0]
    assert SECRET not in out and "POST /score" in out  # requests are logged, the token never
