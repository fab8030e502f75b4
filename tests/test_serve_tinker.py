"""``tempering serve-tinker``'s server against the real ``tinker`` SDK (0.38): the five gaps that
stopped tinker-cookbook (issue 26), each shown the way the cookbook met it.

* A request the server refuses (a checkpoint that does not exist, a name already taken) used to
  answer an HTTP status: 400 left a hole in the run's ``seq_id`` order, so every later call
  waited forever; 409 the SDK retries for five minutes whatever the headers say. Both are now
  failed futures of category ``user``: the SDK raises at once and the run goes on.
* A dead client (a ``seq_id`` that never comes, a session that stops its heartbeats) and a
  server restart leave nothing waiting: missing ids are given up, silent sessions expire, a
  restarted server answers a run it no longer has with 404 and a message naming its
  checkpoints, which it still has (``registry.json``).
* Weights-only loads (``create_training_client_from_state``, ``load_state``), the REST routes
  the cookbook reads (run ``user_metadata``, checkpoint listings, ``weights_info``).

Every wait is bounded (``result(timeout=...)``): a regression fails, it does not hang.
"""

from __future__ import annotations

import json
import math
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import KEY, MODEL_KWARGS, set_env

from tempering.plugins.tinker_server.server import LocalTinkerServer
from tempering.plugins.tinker_server.service import ServedModel

pytestmark = pytest.mark.timeout(120)

T = 20  # seconds any single SDK call may take here (they take milliseconds)
MODELS = {"tiny_llama": ServedModel("tiny_llama", MODEL_KWARGS)}
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints([1, 4, 5, 13, 6]),
    loss_fn_inputs={"target_tokens": [4, 5, 13, 6, 7], "weights": [0.0, 0.0, 1.0, 1.0, 1.0]},
)


def start(tmp_path: Path, **kwargs) -> LocalTinkerServer:
    kwargs.setdefault("root", str(tmp_path / "root"))
    return LocalTinkerServer(MODELS, hold_seconds=0.3, **kwargs).start()


@pytest.fixture
def server(monkeypatch, tmp_path):
    set_env(monkeypatch, tmp_path)
    srv = start(tmp_path)
    yield srv
    srv.stop()


def client(server: LocalTinkerServer) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=server.url, api_key=KEY)


def train_step(tc) -> float:
    loss = tc.forward_backward([DATUM], "cross_entropy").result(timeout=T).metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)
    return loss


def raw(server: LocalTinkerServer, method: str, route: str, body: object = None) -> tuple[int, dict, dict]:
    """One HTTP request as a client without the SDK sends it: (status, headers, JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        f"{server.url}/api/v1/{route}",
        data=data,
        method=method,
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=T) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read() or b"null")


def poll(server: LocalTinkerServer, request_id: str, deadline: float = T) -> dict:
    """A future's final answer (``retrieve_future`` until it is not ``try_again``)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        status, _, body = raw(server, "POST", "retrieve_future", {"request_id": request_id})
        if status != 200 or body.get("type") != "try_again":
            return {"status": status, **(body or {})}
    raise AssertionError(f"future {request_id} still pending after {deadline} s")


# ---------------------------------------------------------------------- refused requests
def test_a_taken_checkpoint_name_fails_at_once_and_the_run_goes_on(server):
    tc = client(server).create_lora_training_client(base_model="tiny_llama", rank=4)
    train_step(tc)
    path = tc.save_state("s1").result(timeout=T).path
    began = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="already exists"):
        tc.save_state("s1").result(timeout=T)  # was: HTTP 409, retried by the SDK for 5 minutes
    assert time.monotonic() - began < 5
    assert math.isfinite(train_step(tc))  # the refused request used its seq_id: nothing waits for it
    assert tc.save_state("s1", overwrite=True).result(timeout=T).path == path


def test_a_refused_load_fails_at_once_and_later_calls_complete(server):
    tc = client(server).create_lora_training_client(base_model="tiny_llama", rank=4)
    began = time.monotonic()
    with pytest.raises(tinker.RequestFailedError, match="no saved state at tinker://nope/weights/x"):
        tc.load_state("tinker://nope/weights/x").result(timeout=T)  # was: HTTP 400, and every later call hung
    assert time.monotonic() - began < 5
    before = train_step(tc)
    assert train_step(tc) < before  # the run trains on


def test_a_state_of_another_rank_is_refused_naming_both(server):
    sc = client(server)
    other = sc.create_lora_training_client(base_model="tiny_llama", rank=2)
    path = other.save_state("r2").result(timeout=T).path
    tc = sc.create_lora_training_client(base_model="tiny_llama", rank=4)
    with pytest.raises(tinker.RequestFailedError, match=r"rank 2.*rank 4"):
        tc.load_state(path).result(timeout=T)
    assert math.isfinite(train_step(tc))


def test_other_4xx_answers_tell_the_sdk_not_to_retry(server):
    status, headers, body = raw(server, "POST", "get_info", {"model_id": "nobody:train:0"})
    assert status == 404 and headers.get("x-should-retry") == "false" and "nobody:train:0" in body["detail"]


# ---------------------------------------------------------------------- weights-only loads
def test_weights_only_and_full_loads(server):
    sc = client(server)
    tc = sc.create_lora_training_client(base_model="tiny_llama", rank=4)
    for _ in range(3):
        train_step(tc)
    path = tc.save_state("trained").result(timeout=T).path
    trained = tc.forward([DATUM], "cross_entropy").result(timeout=T).metrics["loss:sum"]

    weights_only = sc.create_training_client_from_state(path)  # the cookbook's load_checkpoint_path
    with_optimizer = sc.create_training_client_from_state_with_optimizer(path)
    live = sc.create_lora_training_client(base_model="tiny_llama", rank=4)
    live.load_state(path).result(timeout=T)
    for c in (weights_only, with_optimizer, live):
        assert c.forward([DATUM], "cross_entropy").result(timeout=T).metrics["loss:sum"] == pytest.approx(
            trained, rel=1e-5
        )
    runs = server.service.runs
    assert runs[weights_only.model_id].backend._optimizer is None  # a fresh Adam at the next step
    assert runs[live.model_id].backend._optimizer is None
    assert runs[with_optimizer.model_id].backend._optimizer is not None
    assert math.isfinite(train_step(weights_only)) and math.isfinite(train_step(with_optimizer))


# ---------------------------------------------------------------------- REST routes
def test_rest_routes_the_cookbook_reads(server):
    sc = client(server)
    tc = sc.create_lora_training_client(base_model="tiny_llama", rank=4, user_metadata={"renderer_name": "llama3"})
    state = tc.save_state("st", user_metadata={"step": "0"}).result(timeout=T).path
    sampler = tc.save_weights_for_sampler("sw").result(timeout=T).path
    rc = tinker.RestClient(base_url=server.url, api_key=KEY)
    run = rc.get_training_run_by_tinker_path(state).result(timeout=T)
    assert run.user_metadata == {"renderer_name": "llama3"} and run.lora_rank == 4 and run.base_model == "tiny_llama"
    assert run.last_checkpoint.tinker_path == state and run.last_sampler_checkpoint.tinker_path == sampler
    listed = rc.list_checkpoints(tc.model_id).result(timeout=T).checkpoints
    assert [(c.checkpoint_type, c.tinker_path) for c in listed] == [("training", state), ("sampler", sampler)]
    assert listed[0].user_metadata == {"step": "0"} and listed[0].size_bytes > 0
    info = rc.get_weights_info_by_tinker_path(state).result(timeout=T)
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny_llama", True, 4)
    assert rc.list_training_runs().result(timeout=T).training_runs[0].training_run_id == tc.model_id
    assert {c.tinker_path for c in rc.list_user_checkpoints().result(timeout=T).checkpoints} == {state, sampler}
    rc.publish_checkpoint_from_tinker_path(state).result(timeout=T)
    assert rc.list_checkpoints(tc.model_id).result(timeout=T).checkpoints[0].public
    began = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match="already public"):
        rc.publish_checkpoint_from_tinker_path(state).result(timeout=T)  # at once, not after 5 minutes of retries
    assert time.monotonic() - began < 5
    rc.delete_checkpoint_from_tinker_path(sampler).result(timeout=T)
    assert [c.tinker_path for c in rc.list_checkpoints(tc.model_id).result(timeout=T).checkpoints] == [state]


# ---------------------------------------------------------------------- dead clients
def test_a_dead_client_leaves_nothing_waiting(monkeypatch, tmp_path):
    """A client that took seq_id 1 and died before sending it, then stopped its heartbeats: the
    request behind the hole runs after ``gap_timeout_seconds``, the late one fails, and the
    silent session expires (its run closed, its model released)."""
    set_env(monkeypatch, tmp_path)
    srv = start(tmp_path, session_timeout_seconds=3.0, gap_timeout_seconds=1.0)
    try:
        session = raw(srv, "POST", "create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.38.0"})[2][
            "session_id"
        ]
        model = {"session_id": session, "model_seq_id": 0, "base_model": "tiny_llama", "lora_config": {"rank": 4}}
        created = raw(srv, "POST", "create_model", model)[2]
        model_id = created["model_id"]
        adam = {"learning_rate": 1e-3}
        behind = raw(srv, "POST", "optim_step", {"model_id": model_id, "seq_id": 2, "optim_params": adam})[2]
        began = time.monotonic()
        assert "metrics" in poll(srv, behind["request_id"])  # ran once seq_id 1 was given up
        assert 0.5 < time.monotonic() - began < 8
        late = raw(srv, "POST", "optim_step", {"model_id": model_id, "seq_id": 1, "optim_params": adam})[2]
        assert "came after its place" in poll(srv, late["request_id"])["error"]
        assert any("gave up seq_id [1]" in line for line in srv.housekeeping)
        end = time.monotonic() + 10
        while model_id in srv.service.runs and time.monotonic() < end:
            time.sleep(0.2)
        assert model_id not in srv.service.runs  # released, not only closed: the server runs for days
        assert "no heartbeat" in (srv.service.registry.runs[model_id].closed or "")
        status, _, body = raw(srv, "POST", "optim_step", {"model_id": model_id, "seq_id": 3, "optim_params": adam})
        assert status == 404 and "closed" in body["detail"] and "no heartbeat" in body["detail"]
    finally:
        srv.stop()


# ---------------------------------------------------------------------- restarts
def test_a_restart_keeps_checkpoints_and_never_leaves_a_client_waiting(monkeypatch, tmp_path):
    set_env(monkeypatch, tmp_path)
    first = start(tmp_path)
    port = int(first.url.rsplit(":", 1)[1])
    sc = client(first)
    tc = sc.create_lora_training_client(base_model="tiny_llama", rank=4, user_metadata={"renderer_name": "llama3"})
    for _ in range(3):
        train_step(tc)
    state = tc.save_state("before-restart").result(timeout=T).path
    sampler = tc.save_weights_for_sampler("before-restart").result(timeout=T).path
    trained = tc.forward([DATUM], "cross_entropy").result(timeout=T).metrics["loss:sum"]
    prompt = types.ModelInput.from_ints([1, 4, 5, 13])
    scored = tc.create_sampling_client(sampler).compute_logprobs(prompt).result(timeout=T)
    first.stop()

    second = start(tmp_path, port=port)
    try:
        began = time.monotonic()
        with pytest.raises(Exception, match="the server restarted"):
            tc.forward([DATUM], "cross_entropy").result(timeout=T)  # its run is gone: said at once
        assert time.monotonic() - began < 10
        fresh = client(second)
        again = fresh.create_training_client_from_state(state)
        assert again.forward([DATUM], "cross_entropy").result(timeout=T).metrics["loss:sum"] == pytest.approx(
            trained, rel=1e-5
        )
        assert fresh.create_sampling_client(model_path=sampler).compute_logprobs(prompt).result(
            timeout=T
        ) == pytest.approx(scored)
        rc = tinker.RestClient(base_url=second.url, api_key=KEY)
        assert rc.get_training_run_by_tinker_path(state).result(timeout=T).user_metadata == {"renderer_name": "llama3"}
        assert {c.tinker_path for c in rc.list_checkpoints(tc.model_id).result(timeout=T).checkpoints} == {
            state,
            sampler,
        }
    finally:
        second.stop()


def test_binding_beyond_loopback_needs_an_api_key(tmp_path):
    with pytest.raises(ValueError, match="needs api_keys"):
        LocalTinkerServer(MODELS, host="0.0.0.0", root=str(tmp_path))


# ---------------------------------------------------------------------- batched sampling
def test_concurrent_samples_are_batched_while_the_model_is_busy(monkeypatch, tmp_path):
    """``serve-tinker`` batches the requests that arrive while a generate call runs (a cookbook RL
    step sends ``groups_per_batch`` at once); each still gets its own ``num_samples``, and a
    seeded request is never batched."""
    set_env(monkeypatch, tmp_path)
    srv = start(tmp_path, batch_sampling=True)
    try:
        sampler = client(srv).create_sampling_client(base_model="tiny_llama")
        params = types.SamplingParams(max_tokens=4, temperature=1.0)
        prompts = [[1, 4, 5, 13], [1, 6, 7, 13, 2], [1, 8, 13], [1, 9, 9, 9, 13], [1, 4, 13], [1, 5, 6, 7, 8, 13]] * 3
        futures = [sampler.sample(types.ModelInput.from_ints(p), 3, params) for p in prompts]
        answers = [f.result(timeout=T) for f in futures]
        assert all(len(a.sequences) == 3 and all(1 <= len(s.tokens) <= 4 for s in a.sequences) for a in answers)
        [batcher] = [s._batcher for s in srv.service.samplers.values() if s._batcher is not None]
        assert batcher.calls < len(prompts), batcher.calls  # some requests shared a call
        seeded = [
            sampler.sample(types.ModelInput.from_ints(prompts[0]), 2, types.SamplingParams(max_tokens=4, seed=7))
            for _ in range(3)
        ]
        tokens = [[s.tokens for s in f.result(timeout=T).sequences] for f in seeded]
        assert tokens[0] == tokens[1] == tokens[2]  # a seed gives the same samples whatever was queued
    finally:
        srv.stop()


def test_sampler_weights_outlive_the_session_that_saved_them(server):
    """A finished session releases its runs' models; its saved sampler weights are then loaded
    from disk for the next client (they were held by the released model)."""
    first = client(server)
    tc = first.create_lora_training_client(base_model="tiny_llama", rank=4)
    train_step(tc)
    path = tc.save_weights_for_sampler("kept").result(timeout=T).path
    prompt = types.ModelInput.from_ints([1, 4, 5, 13])
    before = tc.create_sampling_client(path).compute_logprobs(prompt).result(timeout=T)
    server.service.finish(tc.model_id.split(":")[0], "success")  # what the SDK's close() sends
    assert tc.model_id not in server.service.runs and server.service.registry.runs[tc.model_id].closed
    after = client(server).create_sampling_client(model_path=path).compute_logprobs(prompt).result(timeout=T)
    assert after == pytest.approx(before, abs=1e-5)


def test_a_large_request_is_split_into_micro_batches_with_the_same_result(server):
    """A cookbook RL step sends hundreds of datums in one forward_backward: the server splits them
    to bound memory (all of them at once was out of memory for SmolLM2); Tinker's losses are
    sums over datums, so the loss, the per-datum logprobs and the step are the same."""
    sc = client(server)
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1, 4 + i % 5, 5, 13, 6][: 3 + i % 3]),
            loss_fn_inputs={"target_tokens": [4, 5, 13, 6, 7][: 3 + i % 3], "weights": [1.0] * (3 + i % 3)},
        )
        for i in range(7)
    ]
    results = []
    for tokens in (10_000, 6):  # one call, then micro-batches of at most 6 padded tokens
        server.service.micro_batch_tokens = tokens
        tc = sc.create_lora_training_client(base_model="tiny_llama", rank=4)
        out = tc.forward_backward(data, "cross_entropy").result(timeout=T)
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=T)
        after = tc.forward(data, "cross_entropy").result(timeout=T).metrics["loss:sum"]
        results.append((out.metrics["loss:sum"], [o["logprobs"].tolist() for o in out.loss_fn_outputs], after))
    (loss_a, lp_a, after_a), (loss_b, lp_b, after_b) = results
    assert loss_b == pytest.approx(loss_a, rel=1e-5) and after_b == pytest.approx(after_a, rel=1e-4)
    assert [len(r) for r in lp_b] == [len(r) for r in lp_a]
    assert all(x == pytest.approx(y, abs=1e-5) for a, b in zip(lp_a, lp_b) for x, y in zip(a, b))


def test_micro_batches_keep_order_and_bound_padded_tokens():
    from tempering.plugins.tinker_server.service import _micro_batches
    from tempering.types import Datum

    rows = [Datum(list(range(n)), list(range(n)), [1.0] * n) for n in (3, 3, 5, 2, 9, 1)]
    for budget, expected in (
        (8, [[3, 3], [5], [2], [9], [1]]),
        (10, [[3, 3], [5, 2], [9], [1]]),
        (1000, [[3, 3, 5, 2, 9, 1]]),
    ):
        parts = _micro_batches(rows, budget)
        assert [[len(r.input_tokens) for r in p] for p in parts] == expected  # rows x longest <= budget, or one row
        assert [r for p in parts for r in p] == rows
