"""``serve-tinker`` runs for days (issue 34): a client's finished session gives back what it used.

Twenty client runs one after another through the real ``tinker`` SDK against an in-process
server, each as a cookbook loop uses the server -- a LoRA training client, forward_backward and
optim_step, a sampling client of its weights (recorded for ``stable_reinforce``), named sampler
weights, a sampling client loaded from another run's saved weights -- then ``close()``. Before
the fix every run's model copies, sampling copy, snapshots and futures stayed: about 30 MB a run
of this model, well past the 10% allowed after a few runs (the kernel killed a SmolLM2 server
after ~20 cookbook runs). The model is a ``tiny_llama`` of ~3 M parameters (12 MB a copy), so
a leak of one copy a run shows within the 20 runs, and a run takes a fraction of a second.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import KEY, set_env

from tempering.plugins.backends.local.memory import give_back, rss_bytes
from tempering.plugins.tinker_server.server import LocalTinkerServer
from tempering.plugins.tinker_server.service import ServedModel

pytestmark = pytest.mark.timeout(180)

T = 30  # seconds any single SDK call may take here
RUNS = 20
MODEL = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "intermediate_size": 512}
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 4, 5, 13, 6]),
    loss_fn_inputs={"target_tokens": [4, 5, 13, 6, 7], "weights": [0.0, 0.0, 1.0, 1.0, 1.0]},
)
PROMPT = types.ModelInput.from_ints([1, 4, 5, 13])


def client_run(server: LocalTinkerServer, i: int, earlier: str | None) -> str:
    """One client's whole session; returns its saved sampler weights' path."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model="mem", rank=8).result(timeout=T)
    for _ in range(2):
        tc.forward_backward([DATUM], "cross_entropy").result(timeout=T)
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=T)
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=T)
    sampler.sample(PROMPT, 2, types.SamplingParams(max_tokens=4)).result(timeout=T)
    path = tc.save_weights_for_sampler(f"run-{i}").result(timeout=T).path
    if earlier is not None:  # another run's weights, loaded from disk (its session has ended)
        sc.create_sampling_client(model_path=earlier).result(timeout=T).compute_logprobs(PROMPT).result(timeout=T)
    sc.close("success").result(timeout=T)
    return path


def settled_rss() -> int:
    give_back()  # the test process's collector and allocator too: the client lives here
    return rss_bytes()


@pytest.mark.skipif(not rss_bytes(), reason="needs /proc to read the resident size")
def test_memory_returns_to_idle_after_each_of_twenty_client_runs(monkeypatch, tmp_path):
    set_env(monkeypatch, tmp_path)
    server = LocalTinkerServer({"mem": ServedModel("tiny_llama", MODEL)}, hold_seconds=0.2, root=str(tmp_path / "r"))
    server.start()
    try:
        path = client_run(server, 0, None)  # warm-up: imports, the base model, allocator pools
        path = client_run(server, 1, path)
        idle = settled_rss()
        seen = []
        for i in range(2, 2 + RUNS):
            path = client_run(server, i, path)
            svc = server.service
            assert not svc.runs and not svc.samplers and not svc.sampler_paths, (i, svc.runs, svc.samplers)
            assert len(svc.records) == 0  # the session's stable_reinforce records went with it
            server.forget_futures()  # what the housekeeping thread does every second
            assert not server.futures and not svc.request_sessions
            seen.append(settled_rss())
            assert seen[-1] <= idle * 1.10, (
                f"after run {i - 1} of {RUNS}: {seen[-1] / 2**20:.0f} MB resident, idle {idle / 2**20:.0f} MB; "
                f"after each run: {[round(s / 2**20) for s in seen]}"
            )
        print(f"idle {idle / 2**20:.0f} MB; after each run {[round(s / 2**20) for s in seen]} MB")
        # the checkpoints stay: every run's sampler weights are still listed and loadable
        assert len([c for c in svc.registry.checkpoints.values() if c.checkpoint_type == "sampler"]) == RUNS + 2
    finally:
        server.stop()


def test_the_request_logs_are_bounded(monkeypatch, tmp_path):
    """``server.received`` / ``server.sampled`` keep the newest ``request_log`` entries (the
    tests read them); ``tempering serve-tinker`` keeps none (``request_log=0``)."""
    set_env(monkeypatch, tmp_path)
    for size in (3, 0):
        with LocalTinkerServer({"mem": ServedModel("tiny_llama", MODEL)}, hold_seconds=0.2, request_log=size) as srv:
            sc = tinker.ServiceClient(base_url=srv.url, api_key=KEY)
            sampler = sc.create_sampling_client(base_model="mem").result(timeout=T)
            for _ in range(4):
                sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=2)).result(timeout=T)
            sc.close("success").result(timeout=T)
            assert len(srv.received) == size and len(srv.sampled) == size
            if size:
                assert [r.kind for r in srv.received][-1] == "FinishSession"


# ---------------------------------------------------------------------- disk: checkpoints
def test_sampler_weights_hold_weights_only_and_retention_keeps_the_newest(monkeypatch, tmp_path):
    """Sampler checkpoints hold the adapter and nothing else (they held Adam's two moments and
    every earlier sampling client's snapshot: 3x and growing); a state no longer carries the
    server's sampler snapshots; ``keep_checkpoints=2`` keeps each run's newest two of each kind
    (files removed too); ``--status`` shows counts and disk use."""
    import subprocess

    import torch

    set_env(monkeypatch, tmp_path)
    root = tmp_path / "r"
    with LocalTinkerServer(
        {"mem": ServedModel("tiny_llama", MODEL)}, hold_seconds=0.2, root=str(root), keep_checkpoints=2
    ) as server:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model="mem", rank=8).result(timeout=T)
        states, samplers = [], []
        for i in range(4):
            tc.forward_backward([DATUM], "cross_entropy").result(timeout=T)
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=T)
            tc.save_weights_and_get_sampling_client().result(timeout=T)  # a snapshot the server keeps
            samplers.append(tc.save_weights_for_sampler(f"s{i}").result(timeout=T).path)
            states.append(tc.save_state(f"w{i}").result(timeout=T).path)
        kept = server.service.registry.checkpoints
        assert [p for p in states + samplers if p in kept] == states[2:] + samplers[2:]
        folders = {p: kept[p].folder for p in states[2:] + samplers[2:]}
        assert sorted(os.listdir(root / "states")) == sorted(os.path.basename(folders[p]) for p in states[2:])
        sampler_state = torch.load(Path(folders[samplers[-1]]) / "state.pt", weights_only=True)
        full_state = torch.load(Path(folders[states[-1]]) / "state.pt", weights_only=True)
        assert sampler_state["optimizer"] is None and sampler_state["snapshots"] == {}
        assert full_state["optimizer"] is not None and full_state["snapshots"] == {}
        sampler_size, state_size = kept[samplers[-1]].size_bytes, kept[states[-1]].size_bytes
        print(f"sampler weights {sampler_size} B, state {state_size} B")
        assert sampler_size < 0.45 * state_size  # weights alone: about a third of weights + Adam's moments
        sc.close("success").result(timeout=T)
    out = subprocess.run(
        [sys.executable, "-m", "tempering", "serve-tinker", "--status", "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=T,
    )
    assert out.returncode == 0, out.stderr
    lines = {line.split(":")[0].strip(): line for line in out.stdout.splitlines()}
    assert "1 training runs (0 open)" in out.stdout
    assert lines["training checkpoints"].split()[2] == "2" and lines["sampler checkpoints"].split()[2] == "2"
    assert float(lines["disk use of the root"].split()[-2]) > 0


def test_an_expired_checkpoint_is_deleted(monkeypatch, tmp_path):
    """A TTL is enforced: the housekeeping deletes a checkpoint once its ``expires_at`` passed."""
    set_env(monkeypatch, tmp_path)
    with LocalTinkerServer({"mem": ServedModel("tiny_llama", MODEL)}, hold_seconds=0.2, root=str(tmp_path)) as server:
        tc = (
            tinker.ServiceClient(base_url=server.url, api_key=KEY)
            .create_lora_training_client(base_model="mem", rank=8)
            .result(timeout=T)
        )
        path = tc.save_state("short", ttl_seconds=3600).result(timeout=T).path
        record = server.service.registry.checkpoints[path]
        assert record.expires_at is not None  # recorded at save (was only by the REST ttl call)
        record.expires_at = "2000-01-01T00:00:00+00:00"
        assert server.service.expire_checkpoints() == [f"deleted {path}: its TTL ran out (2000-01-01T00:00:00+00:00)"]
        assert path not in server.service.registry.checkpoints and not os.path.exists(record.folder)


def test_a_long_run_holds_only_its_newest_sampling_clients(monkeypatch, tmp_path):
    """A cookbook RL loop makes a sampling client every step and never says it dropped the old
    one: the server keeps a run's newest ``keep_sampling_clients`` in memory (one copy of the
    weights each, shared with the snapshot it scores with); an older unnamed one answers 404
    saying why, older named weights are loaded again from disk."""
    set_env(monkeypatch, tmp_path)
    with LocalTinkerServer(
        {"mem": ServedModel("tiny_llama", MODEL)}, hold_seconds=0.2, root=str(tmp_path), keep_sampling_clients=2
    ) as server:
        sc = tinker.ServiceClient(base_url=server.url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model="mem", rank=8).result(timeout=T)
        named = tc.save_weights_for_sampler("first").result(timeout=T).path
        before = (
            sc.create_sampling_client(model_path=named).result(timeout=T).compute_logprobs(PROMPT).result(timeout=T)
        )
        clients = []
        for _ in range(4):
            tc.forward_backward([DATUM], "cross_entropy").result(timeout=T)
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)
            clients.append(tc.save_weights_and_get_sampling_client().result(timeout=T))
        [run] = server.service.runs.values()
        assert len(run.backend.snapshot_names()) == 2 and len(run.published) == 2
        params = types.SamplingParams(max_tokens=2)
        for newest in clients[2:]:
            assert newest.sample(PROMPT, 1, params).result(timeout=T).sequences
        with pytest.raises(Exception, match="was released: this server keeps each training run's newest 2"):
            clients[0].sample(PROMPT, 1, params).result(timeout=T)
        again = sc.create_sampling_client(model_path=named).result(timeout=T)  # from disk now
        assert again.compute_logprobs(PROMPT).result(timeout=T) == pytest.approx(before, abs=1e-5)
        sc.close("success").result(timeout=T)
