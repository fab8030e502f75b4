"""``tempering view`` answers only requests addressed to a loopback host name (DNS rebinding).

Before: the viewer answered any ``Host`` header, so a web page whose name an attacker points at
127.0.0.1 after loading it (DNS rebinding) could read the run's transcripts and recipe from
the user's browser.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path

import pytest

from tempering.apps import cli
from tempering.apps.view.server import ViewServer, host_allowed


@pytest.fixture
def run_dir(tmp_path: Path) -> str:
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "stage": "rl", "reward": 0.5}) + "\n")
    return str(tmp_path)


def ask(server: ViewServer, path: str, host: str | None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.httpd.server_address[1], timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        res = conn.getresponse()
        return res.status, res.read().decode()
    finally:
        conn.close()


def test_only_loopback_host_names_are_answered(run_dir: str) -> None:
    with ViewServer(run_dir, port=0) as server:
        port = server.httpd.server_address[1]
        for host in (
            f"127.0.0.1:{port}",
            "127.0.0.1",
            f"localhost:{port}",
            "LOCALHOST",
            f"[::1]:{port}",
            f"app.localhost:{port}",
        ):
            status, body = ask(server, "/api/metrics", host)
            assert status == 200 and json.loads(body)[0]["reward"] == 0.5, (host, status, body)
        for host in (
            f"evil.example:{port}",
            "evil.example",
            f"127.0.0.1.evil.example:{port}",
            f"10.0.0.5:{port}",
            "localhost.evil.example",
            "",
            None,
        ):
            for path in ("/api/run", "/api/metrics", "/api/rollouts", "/"):
                status, body = ask(server, path, host)
                if host is None:  # HTTP/1.1 requires the header: the parser refuses the request
                    assert status == 400 and "Host" in body and "reward" not in body, (path, status, body)
                    continue
                assert status == 403, (host, path, status)
                assert "reward" not in body and "--allow-host" in body


def test_a_host_named_with_the_flag_is_answered(run_dir: str) -> None:
    with ViewServer(run_dir, port=0, allowed_hosts=["devbox.internal"]) as server:
        port = server.httpd.server_address[1]
        assert ask(server, "/api/metrics", f"devbox.internal:{port}")[0] == 200
        assert ask(server, "/api/metrics", f"DevBox.Internal:{port}")[0] == 200
        assert ask(server, "/api/metrics", f"localhost:{port}")[0] == 200
        assert ask(server, "/api/metrics", f"other.internal:{port}")[0] == 403


def test_host_allowed() -> None:
    assert host_allowed("127.0.0.1:8300") and host_allowed("[::1]:8300") and host_allowed("localhost")
    assert host_allowed("127.0.0.2:1") and host_allowed("a.b.localhost:1")
    assert not host_allowed("localhost.evil:1") and not host_allowed("[::2]:1") and not host_allowed(None)
    assert host_allowed("x.test:1", ["x.test"]) and not host_allowed("y.test:1", ["x.test"])


def test_the_cli_takes_allow_host() -> None:
    args = cli.build_parser().parse_args(["view", "runs/x", "--allow-host", "devbox.internal", "--allow-host", "b"])
    assert args.allow_host == ["devbox.internal", "b"]
