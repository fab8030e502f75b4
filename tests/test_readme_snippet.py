"""The README's Python example (issue 24 item 13), run as written: it must visibly learn and say
where its output went (it trained a model to reward 0.000 for 20 steps and printed nothing)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_python_example_learns_and_says_where_its_output_is(tmp_path: Path) -> None:
    blocks = [b for b in python_blocks(README.read_text(encoding="utf-8")) if "Recipe(" in b]
    assert len(blocks) == 1, "expected one Python Recipe(...) example in README.md"
    script = tmp_path / "snippet.py"
    script.write_text(blocks[0], encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TEMPERING_PROGRESS": "0"}
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"mean reward (\d\.\d\d) at step 1, (\d\.\d\d) at step 20", proc.stdout)
    assert m, proc.stdout
    first, last = float(m.group(1)), float(m.group(2))
    assert last >= first + 0.05 and last >= 0.18, (first, last)  # what the README promises: ~0.1 -> 0.20
    where = re.search(r"metrics, plot and checkpoints: (\S+)", proc.stdout)
    assert where, proc.stdout
    out = tmp_path / where.group(1)
    assert (out / "metrics.jsonl").is_file() and (out / "reward_curve.png").is_file()
