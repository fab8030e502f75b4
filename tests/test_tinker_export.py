"""``tempering export`` of a run trained on Tinker: the adapter comes off the service through the
real SDK (``save_weights_external``, ``RestClient.get_external_weights_urls``, the signed URLs;
the local Tinker server of tests/fake_tinker.py behind them), is merged locally into the base
model -- or written alone with ``--adapter`` -- and the exported model's logprobs equal the
Tinker backend's (its trainer forward on the service) to 1e-5."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import tinker  # noqa: F401 - a dev dependency: missing is a failure, not a skip
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import MODEL_KWARGS, sent, serve
from test_export import backend_logprobs, hf_logprobs, load_merged_export, sft

from tempering.apps import cli
from tempering.plugins.models.tiny import tiny_llama
from tempering.plugins.tinker_server.service import ServedModel
from tempering.training.recipe import Recipe
from tempering.training.rundata import RunDir, run_backend

pytestmark = pytest.mark.timeout(60)
#: A base model named like a hub id: not buildable here, so merging it needs --base-model.
HUB_NAME = "acme/tiny-base"


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(
        monkeypatch,
        tmp_path,
        {"tiny_llama": ServedModel("tiny_llama", MODEL_KWARGS), HUB_NAME: ServedModel("tiny_llama", MODEL_KWARGS)},
    )


def train(out: Path, model: str) -> Path:
    """Two SFT stages of 3 steps on Tinker (checkpoints at steps 3 and 6); the run folder."""
    backend = {
        "name": "tinker",
        "model": model,
        "model_kwargs": MODEL_KWARGS,
        "lora": {"rank": 4},
        "retry_backoff": 0.0,
    }
    cfg = {
        "name": "tinker-export",
        "output_dir": str(out),
        "loggers": ["jsonl"],
        "backend": backend,
        "seed": 3,
        "stages": [sft("first"), sft("second")],
    }
    with pytest.warns(UserWarning, match="backend 'tinker' ignores local-backend keys"):
        Recipe.from_dict(cfg).run()
    return out


def tinker_logprobs(out: Path, step: int | None = None) -> torch.Tensor:
    """The logprobs of the run's checkpoint on Tinker: a backend rebuilt from run.json, the
    checkpoint loaded, the trainer's forward pass on the service."""
    with (
        pytest.warns(UserWarning, match="ignores local-backend keys"),
        run_backend(RunDir(str(out)), step) as (backend, _),
    ):
        return backend_logprobs(backend)


@pytest.mark.filterwarnings("ignore:.*ignores local-backend keys:UserWarning")
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft calls a deprecated alias
def test_tinker_export_merged_and_adapter_match_the_service(server, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = train(tmp_path / "run", "tiny_llama")
    served = tinker_logprobs(out)

    assert cli.main(["export", str(out), "--to", str(tmp_path / "hf")]) == 0
    model, tokenizer = load_merged_export(tmp_path / "hf")
    diff = (hf_logprobs(model, tokenizer) - served).abs().max().item()
    assert diff <= 1e-5, diff
    base, _ = tiny_llama(**MODEL_KWARGS)
    assert (hf_logprobs(base, tokenizer) - served).abs().max().item() > 1e-3  # the adapter did change the model
    note = json.loads((tmp_path / "hf" / "tempering.json").read_text())
    assert note["global_step"] == 6 and note["stage"] == "second" and note["adapter"] is False

    # The adapter went through the SDK's external-weights path, and the temporary export was deleted.
    assert len(sent(server, "SaveWeightsExternal")) == 1 and len(server.requests("ExternalWeightsUrls")) == 1
    assert len(server.requests("DeleteCheckpoint")) == 1 and server.service.external == {}

    assert cli.main(["export", str(out), "--to", str(tmp_path / "adapter"), "--adapter"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()
    }
    peft_model = PeftModel.from_pretrained(tiny_llama(**MODEL_KWARGS)[0], str(tmp_path / "adapter"))
    assert (hf_logprobs(peft_model, tokenizer) - served).abs().max().item() <= 1e-5

    assert cli.main(["export", str(out), "--step", "3", "--to", str(tmp_path / "step3")]) == 0
    early = hf_logprobs(AutoModelForCausalLM.from_pretrained(tmp_path / "step3"), tokenizer)
    assert (early - tinker_logprobs(out, step=3)).abs().max().item() <= 1e-5
    assert (early - served).abs().max().item() > 1e-3  # a different checkpoint indeed


@pytest.mark.filterwarnings("ignore:.*ignores local-backend keys:UserWarning")
@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")  # peft calls a deprecated alias
def test_a_hub_base_needs_base_model_and_downloads_are_signed(server, tmp_path: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = train(tmp_path / "run", HUB_NAME)
    assert cli.main(["export", str(out), "--to", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"tempering: error: --base-model: the base model '{HUB_NAME}' is not on this machine")
        and "\n" not in err
    )
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())

    base, _ = tiny_llama(**MODEL_KWARGS)
    base.save_pretrained(tmp_path / "base")  # what a user downloads from the hub
    assert cli.main(["export", str(out), "--to", str(tmp_path / "hf"), "--base-model", str(tmp_path / "base")]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (hf_logprobs(model, tokenizer) - tinker_logprobs(out)).abs().max().item() <= 1e-5

    # A saved state's weights, downloaded directly, equal the loaded checkpoint's; a signed URL
    # answers without an API key, a forged one 403.
    import urllib.error
    import urllib.request

    from safetensors.torch import load_file

    with run_backend(RunDir(str(out))) as (backend, ckpt):
        state = json.loads((Path(ckpt["path"]) / "tinker_checkpoint.json").read_text())["tinker_path"]
        backend.download_weights(str(tmp_path / "loaded"))
        backend.download_weights(str(tmp_path / "direct"), state=state)
    loaded, direct = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("loaded", "direct"))
    assert direct.keys() == loaded.keys() and all(torch.equal(direct[k], loaded[k]) for k in direct)
    assert any(t.abs().max() > 0 for k, t in direct.items() if "lora_B" in k)  # trained (B starts at zero)
    with pytest.raises(urllib.error.HTTPError) as forged:
        urllib.request.urlopen(f"{server.url}/external/forged-token/adapter_model.safetensors", timeout=5)
    assert forged.value.code == 403
