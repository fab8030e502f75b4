"""``tempering serve-tinker`` as a user runs it (issue 26, gap 4): a real process serving a model
under the name the client asks for, checkpoints kept across a restart of the process, no
non-loopback bind without a key, and a tokenizer the SDK loads by the served name, offline.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import KEY, MODEL_KWARGS

pytestmark = pytest.mark.timeout(180)

T = 30
NAME = "acme/tiny-llama"  # an org/model name, as tinker-cookbook requires


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_for(tmp_path: Path) -> dict[str, str]:
    env = {
        **os.environ,
        "HOME": str(tmp_path / "home"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "TINKER_TELEMETRY": "0",
        "TINKER_API_KEY": KEY,
        "HF_HUB_OFFLINE": "1",
    }
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_HOME", None)
    return env


def serve(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "tempering",
        "serve-tinker",
        "--port",
        str(port),
        "--name",
        NAME,
        "--model-kwargs",
        json.dumps(MODEL_KWARGS),
        "--root",
        str(tmp_path / "root"),
        *extra,
    ]
    proc = subprocess.Popen(cmd, env=env_for(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = proc.stdout.readline()  # "serving acme/tiny-llama (tiny_llama) at http://..." once it listens
    if not (f"serving {NAME}" in first and f"127.0.0.1:{port}" in first):
        proc.kill()
        raise AssertionError(first + proc.communicate(timeout=T)[0])
    return proc


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    try:
        # measured 1.3-3 s; once > 90 s in a loaded CI run, cause not found: the server dumps its
        # threads' stacks after 20 s, shown here if it does not stop
        return proc.wait(timeout=3 * T)
    except subprocess.TimeoutExpired:
        proc.kill()
        output = proc.communicate(timeout=T)[0]
        raise AssertionError("serve-tinker did not stop on SIGINT:\n" + output[-6000:]) from None
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()


def test_help_names_the_options():
    out = subprocess.run(
        [sys.executable, "-m", "tempering", "serve-tinker", "--help"], capture_output=True, text=True, timeout=T
    )
    assert out.returncode == 0
    for option in ("--model", "--name", "--host", "--api-key", "--root", "--session-timeout"):
        assert option in out.stdout
    listed = subprocess.run(
        [sys.executable, "-m", "tempering", "--help"], capture_output=True, text=True, timeout=T
    ).stdout
    assert "serve-tinker" in listed


def test_serves_a_model_under_its_name_and_keeps_checkpoints_across_a_restart(tmp_path, monkeypatch):
    import tinker
    from tinker import types

    monkeypatch.setenv("TINKER_TELEMETRY", "0")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(tmp_path, port)
    try:
        sc = tinker.ServiceClient(base_url=url, api_key=KEY)
        names = [m.model_name for m in sc.get_server_capabilities().supported_models]
        assert names == [NAME]
        tc = sc.create_lora_training_client(base_model=NAME, rank=4)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 4, 5, 13]),
            loss_fn_inputs={"target_tokens": [4, 5, 13, 6], "weights": [0.0, 1.0, 1.0, 1.0]},
        )
        tc.forward_backward([datum], "cross_entropy").result(timeout=T)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)
        path = tc.save_state("kept").result(timeout=T).path
        loss = tc.forward([datum], "cross_entropy").result(timeout=T).metrics["loss:sum"]
    finally:
        assert stop(proc) == 0
    proc = serve(tmp_path, port)  # the same root: the registry and the checkpoint files are read back
    try:
        rc = tinker.RestClient(base_url=url, api_key=KEY)
        assert [c.tinker_path for c in rc.list_checkpoints(tc.model_id).result(timeout=T).checkpoints] == [path]
        again = (
            tinker.ServiceClient(base_url=url, api_key=KEY).create_training_client_from_state(path).result(timeout=T)
        )
        assert again.forward([datum], "cross_entropy").result(timeout=T).metrics["loss:sum"] == pytest.approx(
            loss, rel=1e-5
        )
    finally:
        assert stop(proc) == 0


def test_a_bind_beyond_loopback_needs_a_key(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "tempering",
        "serve-tinker",
        "--host",
        "0.0.0.0",
        "--port",
        str(free_port()),
        "--root",
        str(tmp_path),
    ]
    out = subprocess.run(cmd, env=env_for(tmp_path), capture_output=True, text=True, timeout=T)
    assert out.returncode != 0 and "needs api_keys" in out.stderr and "--api-key" in out.stderr, out.stderr


def test_the_sdk_loads_the_served_tokenizer_by_name_offline(tmp_path):
    """``get_tokenizer`` is ``AutoTokenizer.from_pretrained(<served name>)``: after
    ``install_tokenizer`` it finds the files in the hub cache with ``HF_HUB_OFFLINE=1``."""
    from tempering.plugins.models.smollm2 import smollm2_folder
    from tempering.plugins.tinker_server.tokenizers import install_tokenizer

    try:
        folder = smollm2_folder()
    except Exception as err:  # noqa: BLE001 - the weights are an optional install
        pytest.skip(f"smollm2 is not installed here ({err}); tempering install-model smollm2")
    if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        pytest.skip("smollm2 is not installed here; tempering install-model smollm2")
    cache = tmp_path / "hub"
    tokenizer_only = tmp_path / "tok"
    tokenizer_only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if os.path.isfile(os.path.join(folder, name)):
            (tokenizer_only / name).write_bytes(Path(folder, name).read_bytes())
    served = "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert install_tokenizer(served, str(tokenizer_only), cache=str(cache)) is not None
    assert install_tokenizer(served, str(tokenizer_only), cache=str(cache)) is None  # never overwritten
    code = (
        "from tinker.lib.public_interfaces.sampling_client import _load_tokenizer_from_model_info as load\n"
        f"t = load({served!r}, {served!r})\nprint(t.encode('What is 2 + 3?'))"
    )
    env = {**env_for(tmp_path), "HF_HUB_CACHE": str(cache)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )  # imports: slow on busy cores
    assert out.returncode == 0, out.stderr[-2000:]
    from transformers import AutoTokenizer

    assert json.loads(out.stdout.strip().splitlines()[-1]) == AutoTokenizer.from_pretrained(folder).encode(
        "What is 2 + 3?"
    )


def test_a_damaged_registry_is_named_as_such(tmp_path):
    """A truncated ``registry.json`` is one line naming the file and the way out (it was reported
    as an ``--api-key`` problem), for serving and for ``--status``."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "registry.json").write_text('{"runs": [{"training_run_id": "x", "base')
    for extra in ([], ["--status"]):
        cmd = [sys.executable, "-m", "tempering", "serve-tinker", "--port", str(free_port()), "--root", str(root)]
        out = subprocess.run(cmd + extra, env=env_for(tmp_path), capture_output=True, text=True, timeout=T)
        err = out.stderr.strip()
        assert out.returncode != 0 and len(err.splitlines()) == 1, err
        assert "registry.json: the run registry is damaged" in err and "move it aside" in err
        assert "--api-key" not in err and "Traceback" not in err
