"""docs/writing-a-plugin.md's dataset formats (issue 24 item 15): its example runs as written
(SFT on a tool-call transcript, DPO on a single- and a multi-turn pair), and the template's
``unit_questions`` dataset returns rows in the documented shapes that the stages accept."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-a-plugin.md"
TEMPLATE_SRC = ROOT / "examples" / "plugin_template" / "src"


def test_the_documented_dataset_example_runs(tmp_path: Path) -> None:
    text = DOC.read_text(encoding="utf-8")
    assert "\n## Datasets\n" in text
    blocks = [
        b for b in re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M) if b.startswith("# datasets example")
    ]
    assert len(blocks) == 1
    (tmp_path / "example.py").write_text(blocks[0], encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TEMPERING_PROGRESS": "0"}
    proc = subprocess.run(
        [sys.executable, "example.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "['multi', 'single', 'warmup'] -> runs/datasets_example" in proc.stdout, proc.stdout
    rows = [
        json.loads(line) for line in (tmp_path / "runs" / "datasets_example" / "metrics.jsonl").read_text().splitlines()
    ]
    assert {r.get("stage") for r in rows} >= {"warmup", "single", "multi"} or len(rows) >= 6


def test_the_template_dataset_rows_have_the_documented_shapes(tmp_path: Path) -> None:
    sys.path.insert(0, str(TEMPLATE_SRC))
    try:
        from tempering_plugin_template.datasets import unit_questions
        from tempering_plugin_template.environments import UnitConverter
    finally:
        sys.path.remove(str(TEMPLATE_SRC))
    task = unit_questions("tasks", 3)[0]
    assert set(task) == {"question", "answer"}
    t = unit_questions("transcripts", 3)[0]
    roles = [m["role"] for m in t["messages"]]
    assert roles == ["user", "assistant", "tool", "assistant"]
    call = t["messages"][1]["tool_calls"][0]
    assert isinstance(call["function"]["arguments"], str) and json.loads(call["function"]["arguments"])
    assert t["messages"][2]["tool_call_id"] == call["id"] and t["messages"][2]["name"] == "convert"
    assert t["tools"] == [s.spec() for s in UnitConverter().tools()]
    p = unit_questions("pairs", 3)[0]
    assert (
        p["chosen"][0]["role"] == "assistant"
        and p["rejected"][0]["role"] == "assistant"
        and p["chosen"] != p["rejected"]
    )
    assert unit_questions("tasks", 5, seed=1) == unit_questions("tasks", 5, seed=1)
