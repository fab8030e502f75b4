"""What goes wrong between the Tinker backend and the service, shown with the real SDK against
the local Tinker server and its fault injection (tests/fake_tinker.py).

Each test is a defect the in-process fake of the SDK's clients hid; on the backend before these
fixes each of them fails (a raw SDK exception, a wait of minutes or forever, a lost run):

* setup errors are one line naming the fix: a rejected or missing key, an unreachable base URL
  (at once, not after the SDK's 5 minutes of retries), a silent service (bounded), a model name;
* checkpoints at one step get distinct names (the service refuses a name twice: HTTP 409, which
  the SDK retries for 5 minutes);
* a custom loss that cannot run fails before it is sent, and the training client stays usable;
* a training call the service fails, poisons, loses (410) or never answers is recovered: a new
  client from the last saved state, the lost calls repeated -- the weights end exactly where a
  run without the fault ends;
* waits are bounded and say what they wait for (a sample stuck in rate limits, a paused queue);
* stops are explicit (EOS ids, never the service's implicit stop), the session is closed with
  the run's outcome, a failed base-model sampler is not cached, TTLs under an hour are refused.
"""

from __future__ import annotations

import math
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import MODEL_KWARGS, make_backend, sent, serve, set_env, start_server

from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.errors import ConfigError
from tempering.plugins.backends.tinker.backend import TinkerBackend
from tempering.plugins.backends.tinker.errors import (
    TinkerAuthError,
    TinkerLossError,
    TinkerServiceError,
)
from tempering.plugins.models.tiny import tiny_llama
from tempering.plugins.tinker_server.service import ServedModel
from tempering.types import AdamParams, Batch, Completion, Datum, SamplingParams

pytestmark = pytest.mark.timeout(60)  # the old backend waited minutes, or forever, in several of these

BOS, EOS = 1, 2
PROMPT = [BOS, 4, 5, 13, 6, 7, 14]  # "12+34="


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path)


def batch(shift: int = 0) -> Batch:
    a = Completion(PROMPT, [7 + shift, 9, EOS], [-0.5, -0.25, -0.125], "stop")
    b = Completion(PROMPT, [7, EOS], [-1.0, -0.75], "stop")
    return Batch([Datum.from_completion(a, advantage=1.0), Datum.from_completion(b, advantage=-1.0)])


def one_line(err: BaseException) -> str:
    message = str(err)
    assert "\n" not in message, message
    return message


# ---------------------------------------------------------------------- setup errors
def test_a_rejected_key_is_one_line_naming_the_key(monkeypatch, tmp_path, capsys):
    set_env(monkeypatch, tmp_path)
    server = start_server(monkeypatch, api_keys={"tml-the-right-one"})
    try:
        backend = TinkerBackend(base_model="tiny_llama")  # TINKER_API_KEY is a wrong tml- key
        with pytest.raises(TinkerAuthError) as info:
            backend.tokenizer  # the session is created on first use: HTTP 401 on /client/config
        assert "TINKER_API_KEY" in one_line(info.value) and "tml-" in str(info.value)
        assert "tml-local-test" not in str(info.value)  # never echo the key

        recipe = tmp_path / "r.yaml"
        recipe.write_text(
            f"name: r\noutput_dir: {tmp_path / 'out'}\nbackend: {{name: tinker, base_model: tiny_llama}}\n"
            "loggers: []\nstages: [{name: sft, steps: 1}]\n"
        )
        from tempering.apps.cli import main

        assert main(["run", str(recipe)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "TINKER_API_KEY" in err
    finally:
        server.stop()


def test_no_key_at_all_is_one_line_naming_the_key(server, monkeypatch):
    monkeypatch.delenv("TINKER_API_KEY")  # and HOME holds no stored credentials
    with pytest.raises(TinkerAuthError) as info:
        make_backend(server).tokenizer
    assert "TINKER_API_KEY" in one_line(info.value)


def test_an_unreachable_service_fails_at_once_naming_the_url(monkeypatch, tmp_path):
    set_env(monkeypatch, tmp_path)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    monkeypatch.setenv("TINKER_BASE_URL", url)
    backend = TinkerBackend(base_model="tiny_llama")
    start = time.monotonic()
    with pytest.raises(TinkerServiceError) as info:
        backend.tokenizer
    assert time.monotonic() - start < 10  # the SDK alone retries a refused connection for minutes
    message = one_line(info.value)
    assert url in message and "TINKER_BASE_URL" in message and "cannot be reached" in message


def test_a_service_that_never_answers_is_bounded(monkeypatch, tmp_path):
    set_env(monkeypatch, tmp_path)
    with socket.socket() as sock:  # accepts connections (the kernel does), never answers
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        backend = TinkerBackend(
            base_model="tiny_llama", base_url=url, setup_timeout_seconds=1.5, wait_warning_seconds=0.5
        )
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match="still waiting for create a LoRA training client"):
            with pytest.raises(TinkerServiceError) as info:
                backend.tokenizer
        assert time.monotonic() - start < 10
    message = one_line(info.value)
    assert "no answer" in message and url in message and "setup_timeout_seconds" in message


def test_an_unknown_model_names_the_setting(server):
    with pytest.raises(TinkerServiceError) as info:
        make_backend(server, base_model="acme/no-such-model").tokenizer
    message = one_line(info.value)
    assert "acme/no-such-model" in message and "backend.base_model" in message and "tinker model list" in message


# ---------------------------------------------------------------------- checkpoints
def test_checkpoints_at_one_step_get_distinct_names(server, tmp_path):
    """A periodic checkpoint and the stage-end save at the same step used the same name; Tinker
    refuses a name twice (409), which the SDK retries for 5 minutes before failing."""
    backend = make_backend(server, checkpoint_index_dir=str(tmp_path / "index"))
    backend.forward_backward(batch(), GRPOLoss())
    backend.optim_step(AdamParams())
    backend.save(str(tmp_path / "a" / "step000001"))
    backend.save(str(tmp_path / "b" / "step000001"))  # same step, same folder name
    names = [r.path for r in sent(server, "SaveWeights")]
    assert len(names) == 2 and names[0] != names[1] and all("step000001" in n for n in names)
    assert len(server.service.states) == 2


def test_ttls_under_an_hour_are_refused_before_any_request(server, tmp_path):
    for key in ("checkpoint_ttl_seconds", "snapshot_ttl_seconds"):
        with pytest.raises(ConfigError) as info:
            make_backend(server, **{key: 600})
        assert info.value.path == f"backend.{key}" and "3600" in str(info.value)
    assert not server.received
    backend = make_backend(server, checkpoint_ttl_seconds=7200)
    backend.save(str(tmp_path / "ckpt"))
    assert sent(server, "SaveWeights")[0].ttl_seconds == 7200


# ---------------------------------------------------------------------- custom losses
def test_a_custom_loss_that_cannot_run_fails_before_it_is_sent(server):
    """The SDK runs a custom loss inside the training client's queue: one that raises (here: the
    KL term without reference logprobs) poisoned the client, and every later call failed."""
    backend = make_backend(server)
    with pytest.raises(TinkerLossError) as info:
        backend.forward_backward(batch(), GRPOLoss(beta=0.04))
    assert "ref_logprobs" in one_line(info.value) and "before anything was sent" in str(info.value)

    class NotAScalar:
        needs_logits = False

        def __call__(self, lp, tensors):
            from tempering.interfaces import LossOutput

            return LossOutput(lp.sum(-1))

    with pytest.raises(TinkerLossError, match="scalar"):
        backend.forward_backward(batch(), NotAScalar())
    assert not sent(server, "Forward") and not sent(server, "ForwardBackward")  # nothing reached the service
    good = batch()
    for d in good.data:
        d.extra["ref_logprobs"] = [-1.0] * len(d.target_tokens)
    assert math.isfinite(backend.forward_backward(good, GRPOLoss(beta=0.04)).result()["loss"])
    assert backend.optim_step(AdamParams()).result()["lr"] > 0  # the client is fine


# ---------------------------------------------------------------------- recovery
def train(backend: TinkerBackend, steps: int, loss=None, before_step=None, save_after: int | None = None, folder=None):
    """``steps`` optimizer steps on fixed batches; returns the final trainer logprobs."""
    for step in range(1, steps + 1):
        if before_step is not None:
            before_step(step)
        b = batch(shift=step)
        if loss is not None and getattr(loss, "beta", 0):
            for d in b.data:
                d.extra["ref_logprobs"] = [-1.5] * len(d.target_tokens)
        fb = backend.forward_backward(b, loss or GRPOLoss(epsilon_high=0.28))
        op = backend.optim_step(AdamParams(learning_rate=3e-2))
        assert math.isfinite(fb.result()["loss"]) and op.result()["lr"] > 0
        if save_after == step:
            backend.save(str(folder))
    return backend.logprobs(batch()).result()


FAULTS = {
    "failed": lambda s: s.faults.fail("ForwardBackward"),  # RequestFailedError, category server
    "expired": lambda s: s.faults.expire("OptimStep"),  # 410 when polled: RetryableException
    "never answered": lambda s: s.faults.hang("ForwardBackward"),  # try_again forever: bounded wait
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_failed_training_call_is_recovered_exactly(server, fault):
    clean = train(make_backend(server), 3)
    backend = make_backend(server, request_timeout_seconds=1.5, wait_warning_seconds=0.5)
    creates = len(sent(server, "CreateModel"))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Tinker: still waiting", category=RuntimeWarning)
        with pytest.warns(RuntimeWarning, match="rebuilding the training client from a fresh adapter"):
            recovered = train(backend, 3, before_step=lambda step: step == 2 and FAULTS[fault](server))
    assert len(sent(server, "CreateModel")) == creates + 2  # the first client, then its replacement
    for got, want in zip(recovered, clean):
        assert got == pytest.approx(want, abs=1e-6)  # exactly where the run without the fault is
    assert backend.calls.recoveries == 1 and not backend.calls.gave_up


def test_recovery_starts_from_the_last_saved_state(server, tmp_path):
    clean = train(make_backend(server), 3)
    backend = make_backend(server, checkpoint_index_dir=str(tmp_path / "index"))
    with pytest.warns(RuntimeWarning, match="from the saved state tinker://"):
        recovered = train(
            backend,
            3,
            before_step=lambda step: step == 2 and server.faults.fail("ForwardBackward"),
            save_after=1,
            folder=tmp_path / "step000001",
        )
    (state,) = [r.path for r in sent(server, "SaveWeights")]
    (load,) = sent(server, "LoadWeights")
    assert load.path.endswith(state) and load.optimizer  # rebuilt from the checkpoint, with Adam's state
    mine = [r for r in sent(server, "ForwardBackward") if r.model_id != sent(server, "ForwardBackward")[0].model_id]
    assert len(mine) == 4  # step 1, step 2 (failed), step 2 again, step 3: step 1 is in the saved state
    for got, want in zip(recovered, clean):
        assert got == pytest.approx(want, abs=1e-6)


def test_a_poisoned_training_client_is_recovered(server):
    """A custom-loss request whose forward pass fails poisons the SDK's training client: every
    request after it is refused. The backend replaces the client and repeats the step."""
    kl = GRPOLoss(beta=0.04, epsilon_high=0.28)  # the k3 KL term: a custom loss on Tinker
    clean = train(make_backend(server), 2, loss=kl)
    with pytest.warns(RuntimeWarning, match="rebuilding the training client"):
        recovered = train(
            make_backend(server), 2, loss=kl, before_step=lambda step: step == 2 and server.faults.fail("Forward")
        )
    for got, want in zip(recovered, clean):
        assert got == pytest.approx(want, abs=1e-6)


def test_recovery_gives_up_after_max_recoveries_in_one_line(server):
    backend = make_backend(server, max_recoveries=1)
    server.faults.fail("ForwardBackward", times=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(Exception) as info:
            backend.forward_backward(batch(), GRPOLoss()).result()
    message = one_line(info.value)
    assert "max_recoveries" in message and "resume from the last checkpoint" in message
    assert backend.calls.gave_up
    backend.close()
    assert sent(server, "FinishSession")[-1]["reason"]["type"] == "errored"


# ---------------------------------------------------------------------- bounded waits
def test_sampling_that_never_finishes_is_bounded_and_says_what_it_waits_for(server):
    backend = make_backend(server, request_timeout_seconds=2, wait_warning_seconds=0.5, max_retries=0)
    backend.sample([PROMPT], 1, SamplingParams(max_tokens=1)).result()  # the sampler exists
    server.faults.hang("Sample")  # its queue is paused for capacity: the SDK polls forever
    with pytest.warns(RuntimeWarning, match="still waiting for sample after"):
        with pytest.raises(TinkerServiceError) as info:
            backend.sample([PROMPT], 1, SamplingParams(max_tokens=1)).result()
    assert "no result for sample" in one_line(info.value) and "request_timeout_seconds" in str(info.value)

    server.faults.http("asample", 429, times=1000)  # the SDK retries a rate-limited sample forever
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(TinkerServiceError, match="request_timeout_seconds"):
            backend.sample([PROMPT], 1, SamplingParams(max_tokens=1)).result()
    assert time.monotonic() - start < 10
    server.faults.clear()


def test_what_the_sdk_absorbs_stays_invisible(server):
    """408 polls, a 429 at submission and an expired sample are the SDK's own business."""
    backend = make_backend(server)
    backend.sample([PROMPT], 1, SamplingParams(max_tokens=1)).result()
    server.faults.retrieve(408, times=2)
    server.faults.http("asample", 429)
    server.faults.expire("Sample")
    groups = backend.sample([PROMPT], 2, SamplingParams(max_tokens=2)).result()
    assert len(groups[0]) == 2 and backend.retry_count == 0
    assert ("retrieve", "retrieve") in server.faults.hit and ("route:asample", "http") in server.faults.hit


# ---------------------------------------------------------------------- stops, session, samplers
def llama3_like(**kwargs):
    """A tiny Llama whose tokenizer also knows Llama 3's end-of-text tokens (ids past its EOS)."""
    model, tokenizer = tiny_llama(**kwargs)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end_of_text|>", "<|eot_id|>"]})
    return model, tokenizer


def test_stops_are_always_explicit(monkeypatch, tmp_path):
    """An empty ``stop`` went out as None: the service's implicit stop, which for a Llama 3 base
    model is ``<|end_of_text|>`` while the tokenizer the SDK returns (the instruct one) says EOS
    is ``<|eot_id|>``."""
    name = "meta-llama/Llama-3.2-1B"
    models = {"tiny_llama": ServedModel("tiny_llama", MODEL_KWARGS), name: ServedModel(llama3_like, MODEL_KWARGS)}
    with contextmanager(serve)(monkeypatch, tmp_path, models) as server:
        plain = make_backend(server)
        plain.sample([PROMPT], 1, SamplingParams(max_tokens=2)).result()
        plain.sample([PROMPT], 1, SamplingParams(max_tokens=2, stop=[14])).result()  # a renderer's stop ids
        plain.sample([PROMPT], 1, SamplingParams(max_tokens=2, stop=["="])).result()
        llama = make_backend(server, base_model=name)
        end, eot = (llama.tokenizer.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eot_id|>"))
        llama.sample([PROMPT], 1, SamplingParams(max_tokens=2)).result()
        assert [r.sampling_params.stop for r in sent(server, "Sample")] == [[EOS], [14, EOS], ["="], [EOS, end, eot]]


@pytest.mark.parametrize(
    ("raised", "status"), [(None, "success"), (ValueError("boom"), "errored"), (KeyboardInterrupt(), "interrupted")]
)
def test_the_session_is_closed_with_the_runs_outcome(server, raised, status):
    backend = make_backend(server)
    backend.tokenizer  # a session exists
    try:
        try:
            if raised is not None:
                raise raised
        finally:
            backend.close()  # as the recipe runner does, in a finally
    except BaseException:  # noqa: BLE001
        pass
    assert [r["reason"]["type"] for r in sent(server, "FinishSession")] == [status]


def test_a_failed_base_model_sampler_is_not_kept(server):
    backend = make_backend(server)
    backend.tokenizer
    server.faults.http("create_sampling_session", 404)
    with pytest.raises(TinkerServiceError) as info:
        backend.logprobs(batch(), reference=True).result()
    assert "base-model sampling client" in one_line(info.value)
    rows = backend.logprobs(batch(), reference=True).result()  # tried again, not the cached failure
    assert len(rows) == 2 and all(math.isfinite(x) for r in rows for x in r)


# ---------------------------------------------------------------------- SDK 0.38 features
def test_inflight_sampling_clients_follow_the_trainer(server):
    """``sampling_client_kind: inflight``: a client created before an update samples the updated
    weights (no copy per publish); a snapshot client keeps its own."""
    backend = make_backend(server, sampling_client_kind="inflight")
    first = backend.sampling_client().result()
    snapshot = make_backend(server).sampling_client().result()  # another run, untouched: step 0 weights
    backend.forward_backward(batch(), GRPOLoss()).result()
    backend.optim_step(AdamParams(learning_rate=0.2)).result()
    second = backend.sampling_client().result()
    params = SamplingParams(max_tokens=3, temperature=0.0)
    old, new, fixed = (c.sample([PROMPT], 1, params).result()[0][0] for c in (first, second, snapshot))
    assert (first.policy_version, second.policy_version) == (0, 1)  # a lower bound for inflight clients
    assert old.logprobs == pytest.approx(new.logprobs, abs=1e-6)  # the first client now samples step 1
    assert old.logprobs != pytest.approx(fixed.logprobs, abs=1e-4)
    kinds = [r.kind for r in sent(server, "SaveWeightsForSampler")]
    assert kinds == ["inflight", "snapshot", "inflight"]
