"""``tempering view``: the JSON the page reads, its filters, a server bound to loopback, and the
page itself in a real headless Chromium (Debian's, driven by Playwright) on a small real run:
curves drawn from metrics.jsonl, multi-turn transcripts with tool calls, filters, the recipe.

The browser test saves screenshots; with ``TEMPERING_DOCS_SCREENSHOTS=DIR`` it also writes
them to ``DIR`` (docs/images holds the ones docs/observability.md shows)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from observability_run import RL_STEPS, SFT_STEPS, small_run

from tempering.apps import cli
from tempering.apps.view.query import RolloutQuery, run_query
from tempering.apps.view.server import RunViewer, ViewServer
from tempering.errors import ConfigError
from tempering.training.rundata import RunDir

CHROMIUM = os.environ.get("TEMPERING_CHROMIUM", "/usr/bin/chromium")
# As root on a machine with no network: no sandbox, and no background connections to refuse.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as res:
            return res.status, res.headers["Content-Type"], res.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


# --------------------------------------------------------------------------- the API
def test_the_api_serves_the_run_folder() -> None:
    out = Path(small_run())
    viewer = RunViewer(RunDir.open(str(out)))
    status, run = viewer.route("/api/run", "")
    assert status == 200 and run["name"] == "small_tool_use" and run["stages"] == ["warmup", "rl"]
    assert run["components"]["algorithm:grpo"].startswith("tempering ")  # provenance, from run.json
    assert run["components"]["environment:calculator"].startswith("tempering ")
    assert run["progress"]["completed"] == ["warmup", "rl"] and all(run["files"].values())
    assert viewer.route("/api/metrics", "") == (200, lines(out / "metrics.jsonl"))

    records = lines(out / "rollouts.jsonl")
    status, page = viewer.route("/api/rollouts", "stage=rl&kind=train&limit=5")
    train = [r for r in records if r["stage"] == "rl" and r["kind"] == "train"]
    assert status == 200 and page["total"] == len(train) and len(page["records"]) == 5
    assert page["records"][0]["step"] == SFT_STEPS + RL_STEPS  # newest first
    assert page["facets"]["stages"] == ["warmup", "rl"] and page["facets"]["kinds"] == ["eval", "train"]
    assert viewer.route("/api/rollouts", "step_min=abc")[0] == 400
    assert viewer.route("/api/nope", "")[0] == 404


def record(**over: Any) -> dict[str, Any]:
    base = {
        "stage": "rl",
        "kind": "train",
        "step": 1,
        "group": 0,
        "sample": 0,
        "reward": 0.5,
        "failed": False,
        "failure": None,
        "prompt": None,
        "completion": "",
        "error": None,
        "messages": [],
    }
    return {**base, **over}


def test_filters_by_step_reward_failure_and_text() -> None:
    records = [
        record(step=1, reward=0.0, messages=[{"role": "user", "content": "37*84"}]),
        record(
            step=2,
            reward=1.0,
            messages=[
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c0", "function": {"name": "mul", "arguments": '{"a": 37}'}}],
                }
            ],
        ),
        record(
            step=3, reward="nan", failed=True, failure="timeout", error="took 60 s", feedback="expected '42', got '41'"
        ),
        record(step=3, kind="eval", stage="warmup", reward=1.0, prompt="12+34=", completion="46"),
    ]

    def steps(**params: Any) -> list[int]:
        query = RolloutQuery.from_params({k: [str(v)] for k, v in params.items()})
        return [r["step"] for r in run_query(records, query)["records"]]

    assert steps() == [3, 3, 2, 1]  # newest first, train before eval
    assert steps(step_min=2, step_max=2) == [2]
    assert steps(reward_min=0.5) == [3, 2]  # a failed sample's reward matches no range
    assert steps(failed="yes") == [3] and steps(failed="no") == [3, 2, 1] and steps(cause="timeout") == [3]
    assert steps(text="MUL") == [2] and steps(text="37*8") == [1] and steps(text="60 s") == [3]
    assert steps(text="got '41'") == [3]  # the feedback is searched too
    assert steps(stage="warmup", kind="eval") == [3]
    assert steps(limit=2, offset=1) == [3, 2]
    assert run_query(records, RolloutQuery())["facets"]["causes"] == ["timeout"]
    with pytest.raises(ConfigError, match=r"^failed: use one of any, yes, no"):
        RolloutQuery.from_params({"failed": ["maybe"]})


def test_the_server_listens_on_loopback_and_serves_page_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    with ViewServer(small_run(), port=0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert server.httpd.server_address[0] == "127.0.0.1"
        status, ctype, body = get(server.url)
        assert status == 200 and ctype.startswith("text/html") and '<script src="/view.js">' in body
        assert get(server.url + "view.js")[1].startswith("text/javascript")
        status, ctype, body = get(server.url + "api/run")
        assert status == 200 and ctype == "application/json" and json.loads(body)["stages"] == ["warmup", "rl"]
        assert get(server.url + "api/rollouts?limit=x")[0] == 400
    assert cli.main(["view", "/nonexistent/run"]) == 2
    assert "tempering: error: RUN_DIR: no such folder '/nonexistent/run'" in capsys.readouterr().err


# --------------------------------------------------------------------------- the page in a browser
def browser_or_skip() -> Any:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[dev]'; .ci/run does)")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run does; or set TEMPERING_CHROMIUM)")
    return sync_playwright


@contextlib.contextmanager
def page_at(url: str) -> Iterator[tuple[Any, list[str]]]:
    """Headless Chromium on ``url`` once the viewer says it is ready: the page, and the console
    errors and page errors it has logged so far (a test asserts the list empty at its end)."""
    sync_playwright = browser_or_skip()
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']", timeout=20_000)
            yield page, errors
        finally:
            browser.close()


def test_the_page_draws_curves_and_transcripts_in_a_real_browser(tmp_path: Path) -> None:
    browser_or_skip()  # before the run is made
    out = Path(small_run())
    records = lines(out / "rollouts.jsonl")
    shots = [tmp_path]
    if os.environ.get("TEMPERING_DOCS_SCREENSHOTS"):
        shots.append(Path(os.environ["TEMPERING_DOCS_SCREENSHOTS"]))
    with ViewServer(str(out), port=0) as server, page_at(server.url) as (page, errors):
        assert page.inner_text("#run-name") == "small_tool_use"

        # a curve per metric, with one point per logged value
        loss = page.locator('.stage[data-stage="warmup"] figure.chart[data-metric="loss"] path.series')
        assert loss.get_attribute("d").count("L") == SFT_STEPS - 1
        reward = page.locator('.stage[data-stage="rl"] figure.chart[data-metric="reward/mean"]')
        assert reward.locator("path.series").get_attribute("d").count("L") == RL_STEPS - 1
        for folder in shots:
            page.screenshot(path=str(folder / "view-metrics.png"))

        # clicking a point opens that step's rollouts
        box = reward.locator("svg").bounding_box()
        page.mouse.click(box["x"] + box["width"] - 10, box["y"] + box["height"] / 2)
        page.wait_for_function("location.hash.startsWith('#rollouts')")
        last = SFT_STEPS + RL_STEPS
        page.wait_for_selector(f"article.rollout[data-step='{last}']")
        steps = {int(s) for s in page.locator("article.rollout").evaluate_all("els => els.map(e => e.dataset.step)")}
        assert steps == {last}

        # a multi-turn transcript: the question, the model's tool call, the tool's result
        page.goto(server.url + "#rollouts?stage=rl&kind=train")
        page.wait_for_selector("article.rollout .msg[data-role='tool']")
        shown = [r for r in records if r["stage"] == "rl" and r["kind"] == "train"]
        # the summary counts what the page has filtered so far: wait for the whole log (on a
        # loaded machine the first paint showed "20 matching samples, steps 60-63" of 48)
        page.wait_for_function(
            f"document.querySelector('#rollout-summary').textContent.startsWith('{len(shown)} ')", timeout=20_000
        )
        assert page.inner_text("#rollout-summary").startswith(f"{len(shown)} matching samples")
        card = page.locator("article.rollout", has=page.locator(".msg[data-role='tool']")).first
        assert re.fullmatch(r"\d+\*\d+", card.locator(".msg[data-role='user'] pre").first.inner_text())
        assert re.fullmatch(r"mul\(a=\d+, b=\d+\)", card.locator(".tool-call code").first.inner_text())
        assert re.fullmatch(r"-?\d+", card.locator(".msg[data-role='tool'] pre").first.inner_text())
        # each sample's feedback (the calculator's "expected '42', got '41'") under its transcript
        listed = run_query(records, RolloutQuery(stage="rl", kind="train", limit=20))["records"]  # the first page
        said = [r["feedback"] for r in listed if r["feedback"]]
        assert said and page.locator("article.rollout .msg[data-role='feedback'] pre").all_inner_texts() == said
        for folder in shots:
            page.screenshot(path=str(folder / "view-rollouts.png"))

        # the filter bar: evaluation episodes only
        page.select_option("#filters [name=kind]", "eval")
        page.click("#filters button[type=submit]")
        evals = [r for r in records if r["stage"] == "rl" and r["kind"] == "eval"]
        page.wait_for_function(f"document.querySelector('#rollout-summary').textContent.startsWith('{len(evals)} ')")
        kinds = set(page.locator("article.rollout").evaluate_all("els => els.map(e => e.dataset.kind)"))
        assert kinds == {"eval"}

        # the recipe and where each component came from
        page.click("#tabs a[data-tab=recipe]")
        page.wait_for_selector("#tab-recipe.active")
        assert "name: small_tool_use" in page.inner_text("#recipe")
        assert "calculator" in page.inner_text("#components")
    assert errors == []
    assert (tmp_path / "view-rollouts.png").stat().st_size > 20_000


def test_view_cli_prints_the_url_and_serves(tmp_path: Path) -> None:
    """`tempering view` in a child process: it prints the loopback URL and answers there."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "tempering", "view", small_run(), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+/", line)
        assert url, line + proc.stderr.read()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert get(url.group(0) + "api/run")[0] == 200
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline
                time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
