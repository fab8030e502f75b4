"""The tracker loggers (``wandb`` offline, ``trackio`` local, ``mlflow`` file store): each gets the
run's numeric metrics at their steps, the resolved config, and the rollouts as a table -- read
back here from what the tracker wrote, not from what was sent. A missing package is a
one-line error with the install command.

The tracker tests are marked ``extras``: skipped where the package is not installed, run by
.ci/run in a venv with the extras (``pip install -e '.[wandb,trackio,mlflow]'``)."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from observability_run import small_run

from tempering.errors import ConfigError
from tempering.plugins.loggers.tracker import COLUMNS, flatten, numeric, table_rows, transcript_text
from tempering.registry import get_registry
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe

QUESTIONS = [{"prompt": f"q{i}", "answer": "3"} for i in range(8)]


def graded(completion: str, example: dict[str, Any]) -> float:
    return float(completion) / 3


def run_with(out: Path, logger: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A 3-step GRPO run (FakeBackend: sample i says str(i)) logging to ``logger``; returns the
    rows of metrics.jsonl and rollouts.jsonl, the truth the tracker must hold."""
    stage = {
        "id": "rl",
        "name": "grpo",
        "steps": 3,
        "prompts_per_step": 4,
        "group_size": 4,
        "log_rollouts": 2,
        "dataset": QUESTIONS,
        "reward": graded,
    }
    Recipe.from_dict({"name": "tracked", "output_dir": str(out), "loggers": ["jsonl", logger], "stages": [stage]}).run(
        backend=FakeBackend()
    )
    read = lambda name: [json.loads(x) for x in (out / name).read_text().splitlines()]
    return read("metrics.jsonl"), read("rollouts.jsonl")


def series(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), float)]


# --------------------------------------------------------------------------- shared pieces, no extras
def test_a_missing_tracker_package_is_one_line_with_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(
        ConfigError,
        match=r"^loggers\[1\]: the mlflow logger needs the 'mlflow' package: "
        r"pip install 'tempering\[mlflow\]'$",
    ):
        get_registry().check("logger", {"name": "mlflow"}, "loggers[1]", context=("output_dir",))
    with pytest.raises(ConfigError, match=r"^loggers\[0\]\.projct: unknown key 'projct'. Did you mean 'project'\?"):
        get_registry().check("logger", {"name": "wandb", "projct": "x"}, "loggers[0]", context=("output_dir",))
    assert {"wandb", "trackio", "mlflow"} <= set(get_registry().names("logger"))


def test_rows_tables_and_config_flattening() -> None:
    assert numeric({"step": 3, "time": 1.0, "loss": 0.5, "ok": True, "first_error/x": "boom", "bad": float("nan")}) == {
        "loss": 0.5,
        "ok": 1.0,
    }
    assert flatten({"stages": [{"name": "grpo", "eval": {}}], "seed": 0}) == {
        "stages.0.name": "grpo",
        "stages.0.eval": "{}",
        "seed": "0",
    }
    records = [json.loads(x) for x in (Path(small_run()) / "rollouts.jsonl").read_text().splitlines()]
    episode = next(r for r in records if r["kind"] == "train" and any(m.get("tool_calls") for m in r["messages"]))
    [row] = table_rows([episode])
    cells = dict(zip(COLUMNS, row))
    assert cells["prompt"] == episode["example"]["question"] and cells["reward"] == episode["reward"]
    text = transcript_text(episode)
    assert text.startswith(f"user: {episode['example']['question']}\nassistant:")
    assert "  -> mul({" in text and "\ntool [mul]: " in text


# --------------------------------------------------------------------------- wandb (offline)
def wandb_records(path: str) -> list[Any]:
    """The records of an offline run's ``.wandb`` file: a LevelDB-style log (a 7-byte header,
    then 32 KiB blocks of chunks: crc32 u32, length u16, type u8) of wandb Record protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        buf, pos = buf + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4) and buf:  # FULL or LAST: a record is complete
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


@pytest.mark.extras
def test_wandb_offline_holds_metrics_config_and_the_rollouts_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'tempering[wandb]')")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows, rollouts = run_with(tmp_path / "run", {"name": "wandb", "mode": "offline", "project": "tempering-test"})
    [file] = glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = wandb_records(file)
    history: dict[int, dict[str, Any]] = {}
    for rec in records:
        if rec.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
    for key in ("reward/mean", "loss", "accuracy"):
        assert series(rows, key) == [(s, h[key]) for s, h in sorted(history.items()) if key in h], key
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["tempering"] == json.loads((tmp_path / "run" / "run.json").read_text())["tempering"]
    assert config["recipe"]["name"] == "tracked" and "algorithm:grpo" in config["components"]
    assert run.display_name == "tracked"
    tables = sorted(
        glob.glob(str(tmp_path / "run" / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json"))
    )
    logged = [row for t in tables for row in json.loads(Path(t).read_text())["data"]]  # increments: new rows each
    assert json.loads(Path(tables[0]).read_text())["columns"] == list(COLUMNS)
    assert sorted(map(tuple, ([r[1], r[3], r[4]] for r in logged))) == sorted(
        (r["step"], r["group"], r["sample"]) for r in rollouts
    )


# --------------------------------------------------------------------------- trackio (local)
@pytest.mark.extras
def test_trackio_holds_metrics_config_and_rollout_tables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when trackio is first imported
    pytest.importorskip("trackio", reason="trackio is not installed (pip install 'tempering[trackio]')")
    from trackio.sqlite_storage import SQLiteStorage

    project = f"tempering-test-{uuid.uuid4().hex[:8]}"
    rows, rollouts = run_with(tmp_path / "run", {"name": "trackio", "project": project})
    assert SQLiteStorage.get_runs(project) == ["tracked"]
    logs = SQLiteStorage.get_logs(project, "tracked")
    for key in ("reward/mean", "loss"):
        assert series(rows, key) == [(e["step"], e[key]) for e in logs if key in e], key
    config = SQLiteStorage.get_run_config(project, "tracked")
    assert config["recipe"]["name"] == "tracked" and "algorithm:grpo" in config["components"]
    tables = [(e["step"], e["rollouts"]["_value"]) for e in logs if "rollouts" in e]
    assert [s for s, _ in tables] == sorted({r["step"] for r in rollouts})
    assert [(row["step"], row["group"], row["sample"]) for _, t in tables for row in t] == [
        (r["step"], r["group"], r["sample"]) for r in rollouts
    ]


# --------------------------------------------------------------------------- mlflow (file store)
@pytest.mark.extras
@pytest.mark.filterwarnings("ignore:For backward compatibility:DeprecationWarning")  # pandas 3, inside mlflow.log_table
def test_mlflow_file_store_holds_metrics_params_config_and_rollout_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'tempering[mlflow]')")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the logger opts in for its own file store
    from mlflow.tracking import MlflowClient

    rows, rollouts = run_with(tmp_path / "run", {"name": "mlflow", "experiment": "tempering-test"})
    client = MlflowClient(tracking_uri=f"file://{tmp_path / 'run' / 'mlruns'}")
    [run] = client.search_runs([client.get_experiment_by_name("tempering-test").experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    for key in ("reward/mean", "loss"):
        assert series(rows, key) == sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
    assert run.data.params["stages.0.name"] == "grpo" and run.data.params["name"] == "tracked"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert "run.json" in artifacts
    steps = sorted({r["step"] for r in rollouts})
    tables = {a.path for a in client.list_artifacts(run.info.run_id, "rollouts")}
    assert tables == {f"rollouts/step{s:06d}.json" for s in steps}
    local = Path(client.download_artifacts(run.info.run_id, f"rollouts/step{steps[0]:06d}.json", str(tmp_path)))
    table = json.loads(local.read_text())
    assert table["columns"] == list(COLUMNS) and len(table["data"]) == sum(r["step"] == steps[0] for r in rollouts)
