"""What tinker-cookbook's default loss and sampling options need from the server (issue 26, gap 1),
through the real SDK, with the numbers checked against definitions written here, one position at
a time (as in tests/test_tinker_builtin_formulas.py; nothing here imports ``tempering.rlmath``).

* ``stable_reinforce`` (the cookbook's async and recipe default): the SDK documents its
  interface -- sample with ``record_stability_info=True``, name each datum's sampled sequence
  with provenance -- not its formula. Ours: ``-sum(min(exp(lp - q), 2) * lp * A)`` with the
  ratio held constant, ``q`` the logprob the *server* recorded when it sampled the token.
* ``cispo`` without thresholds takes the documented defaults 0.0 / 4.0.
* ``topk_sample_logprobs`` returns each sampled position's top k; ``prompt_logprobs_last_n``
  scores only the prompt's last n tokens (the SDK refuses an answer that scores more).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import tinker
from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import KEY, MODEL_KWARGS, set_env

from tempering.plugins.tinker_server.server import LocalTinkerServer
from tempering.plugins.tinker_server.service import ServedModel

pytestmark = pytest.mark.timeout(120)

T = 20
PROMPT = [1, 4, 5, 13, 6, 7, 14]


@pytest.fixture
def server(monkeypatch, tmp_path):
    set_env(monkeypatch, tmp_path)
    srv = LocalTinkerServer(
        {"tiny_llama": ServedModel("tiny_llama", MODEL_KWARGS)}, hold_seconds=0.3, root=str(tmp_path / "r")
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def training(server):
    return tinker.ServiceClient(base_url=server.url, api_key=KEY).create_lora_training_client(
        base_model="tiny_llama", rank=4
    )


def sample(sampler, n: int = 2, **kwargs):
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    return sampler.sample(types.ModelInput.from_ints(PROMPT), n, params, **kwargs).result(timeout=T)


def datum_for(seq, advantage: float, logprobs: list[float] | None = None) -> types.Datum:
    """The cookbook's datum of one sampled sequence: prompt + tokens shifted by one, advantage on
    the sampled positions only, with provenance (prompt run from offset 1, then the sampled run)."""
    full = PROMPT + list(seq.tokens)
    n_prompt, n_sampled = len(PROMPT), len(seq.tokens)
    q = logprobs if logprobs is not None else [0.0] * (n_prompt - 1) + list(seq.logprobs)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": q,
            "advantages": [0.0] * (n_prompt - 1) + [advantage] * n_sampled,
        },
    )
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=n_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=n_sampled),
        ],
    )


def reference_stable_reinforce(lp: list[float], q: list[float | None], adv: list[float], cap: float = 2.0) -> float:
    """``-sum_t min(exp(lp_t - q_t), cap) * lp_t * A_t`` (prompt positions: A = 0)."""
    return -sum(min(math.exp(x - (y if y is not None else 0.0)), cap) * x * a for x, y, a in zip(lp, q, adv))


def test_stable_reinforce_uses_the_recorded_sampler_logprobs(training):
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True)
    seqs = [s for s in sample(sampler, 4).sequences if len(s.tokens) >= 2][:2]
    assert seqs, "the tiny model stopped at once on every sample"
    honest = [datum_for(s, a) for s, a in zip(seqs, (1.0, -0.5))]
    for _ in range(6):  # the policy moves on after sampling (stale samples): ratios leave 1, some past the cap
        first = honest[0]
        weights = [1.0] * first.model_input.length
        sft = types.Datum(
            first.model_input, {"target_tokens": first.loss_fn_inputs["target_tokens"], "weights": weights}
        )
        training.forward_backward([sft], "cross_entropy").result(timeout=T)
        training.optim_step(types.AdamParams(learning_rate=0.3)).result(timeout=T)
    out = training.forward(honest, "stable_reinforce").result(timeout=T)
    ratios = [
        math.exp(x - y)
        for o, s in zip(out.loss_fn_outputs, seqs)
        for x, y in zip(o["logprobs"].tolist()[len(PROMPT) - 1 :], s.logprobs)
    ]
    assert max(ratios) > 1.2, ratios  # off-policy: a cap of 1 (or none) would change the loss
    expected = 0.0
    for s, a, o in zip(seqs, (1.0, -0.5), out.loss_fn_outputs):
        lp = o["logprobs"].tolist()
        q = [None] * (len(PROMPT) - 1) + list(s.logprobs)
        expected += reference_stable_reinforce(lp, q, [0.0] * (len(PROMPT) - 1) + [a] * len(s.tokens))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    # logprobs the client got wrong do not matter: the server uses what it recorded
    lying = [datum_for(s, a, logprobs=[-9.0] * (len(PROMPT) - 1 + len(s.tokens))) for s, a in zip(seqs, (1.0, -0.5))]
    assert training.forward(lying, "stable_reinforce").result(timeout=T).metrics["loss:sum"] == pytest.approx(
        out.metrics["loss:sum"], rel=1e-5, abs=1e-6
    )
    assert training.forward_backward(honest, "stable_reinforce").result(timeout=T).metrics["loss:sum"] == pytest.approx(
        out.metrics["loss:sum"], rel=1e-4, abs=1e-5
    )


def test_stable_reinforce_refuses_data_it_cannot_match(server, training):
    unrecorded = sample(training.save_weights_and_get_sampling_client()).sequences[0]
    with pytest.raises(tinker.RequestFailedError, match="record_stability_info"):
        training.forward([datum_for(unrecorded, 1.0)], "stable_reinforce").result(timeout=T)
    recorded = sample(training.save_weights_and_get_sampling_client(record_stability_info=True)).sequences[0]
    bare = datum_for(recorded, 1.0)
    no_provenance = types.Datum(model_input=bare.model_input, loss_fn_inputs=bare.loss_fn_inputs)
    with pytest.raises(tinker.RequestFailedError, match="provenance"):
        training.forward([no_provenance], "stable_reinforce").result(timeout=T)
    other = tinker.ServiceClient(base_url=server.url, api_key=KEY).create_lora_training_client(
        base_model="tiny_llama", rank=4
    )
    with pytest.raises(tinker.RequestFailedError, match="same session"):
        other.forward([datum_for(recorded, 1.0)], "stable_reinforce").result(timeout=T)


def test_cispo_takes_the_documented_default_thresholds(training):
    seq = sample(training.save_weights_and_get_sampling_client()).sequences[0]
    n = len(PROMPT) - 1 + len(seq.tokens)
    q = [-1.0] * n  # ratios exp(lp + 1): above 1 where the model is sure, below where not
    adv = [0.5] * n
    full = PROMPT + list(seq.tokens)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "logprobs": q, "advantages": adv},
    )
    out = training.forward([d], "cispo").result(timeout=T)  # was refused: "needs loss_fn_config"
    lp = out.loss_fn_outputs[0]["logprobs"].tolist()
    expected = -sum(min(max(math.exp(x - y), 0.0), 4.0) * x * a for x, y, a in zip(lp, q, adv))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    explicit = training.forward([d], "cispo", {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}).result(timeout=T)
    assert explicit.metrics["loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-6)


def test_topk_sample_logprobs_and_prompt_logprobs_last_n(training):
    sampler = training.save_weights_and_get_sampling_client()
    resp = sample(sampler, 2, topk_sample_logprobs=3, include_prompt_logprobs=True, prompt_logprobs_last_n=2)
    for seq in resp.sequences:
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)  # was None
        for row, token, lp in zip(seq.topk_logprobs, seq.tokens, seq.logprobs):
            values = [v for _, v in row]
            assert len(row) == 3 and values == sorted(values, reverse=True)
            if token in dict(row):  # T=1: the sampled token's logprob is the distribution's
                assert dict(row)[token] == pytest.approx(lp, abs=1e-4)
            assert lp <= values[0] + 1e-4
    full = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=T)
    assert resp.prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert resp.prompt_logprobs[-2:] == pytest.approx(full[-2:], abs=1e-5)
    last = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=3).result(timeout=T)
    assert last[:-3] == [None] * (len(PROMPT) - 3) and last[-3:] == pytest.approx(full[-3:], abs=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stable_reinforce_formula_and_gradient_on_known_inputs(seed):
    """``builtin_loss`` against the definition above, with ratios well past the cap, and its
    gradient: ``-min(r_t, 2) * A_t`` per position (the ratio is a constant weight)."""
    import random

    import torch

    from tempering.plugins.tinker_server.builtin_losses import builtin_loss

    rng = random.Random(seed)
    n = 9
    lp = [rng.uniform(-4.0, -0.1) for _ in range(n)]
    q = [x + rng.uniform(-2.0, 2.0) for x in lp]  # ratios from e^-2 to e^2
    adv = [rng.uniform(-1.5, 1.5) for _ in range(n)]
    x = torch.tensor(lp, dtype=torch.float64, requires_grad=True)
    inputs = {
        "target_tokens": torch.zeros(n, dtype=torch.long),
        "logprobs": torch.tensor(q, dtype=torch.float64),
        "advantages": torch.tensor(adv, dtype=torch.float64),
    }
    loss = builtin_loss("stable_reinforce", None, x, inputs)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(reference_stable_reinforce(lp, q, adv), rel=1e-9)
    expected_grad = [-min(math.exp(a - b), 2.0) * c for a, b, c in zip(lp, q, adv)]
    assert x.grad.tolist() == pytest.approx(expected_grad, rel=1e-9)
    assert any(math.exp(a - b) > 2.0 for a, b in zip(lp, q))


# ---------------------------------------------------------------------- what the cookbook sends (issue 34)
def rl_loop_datum(seq, advantage: float) -> types.Datum:
    """tinker-cookbook's ``recipes.rl_loop`` datum: 0s as the targets (and logprobs) of the prompt
    positions, advantage 0 there, and provenance naming the prompt run anyway."""
    n_prompt = len(PROMPT)
    honest = datum_for(seq, advantage)
    inputs = dict(honest.loss_fn_inputs)
    inputs["target_tokens"] = [0] * (n_prompt - 1) + list(seq.tokens)
    zeros = types.Datum(honest.model_input, inputs)
    return zeros.with_provenance(model_input=honest.model_input_spans, loss_fn_inputs=honest.loss_fn_input_spans)


def test_stable_reinforce_takes_the_cookbook_rl_loop_datums(training):
    """Provenance is compared where the loss uses it: the sampled tokens, and prompt positions
    with a non-zero advantage (rl_loop's were refused: "differ from the prompt ... at offset 1")."""
    sampler = training.save_weights_and_get_sampling_client(record_stability_info=True)
    seqs = [s for s in sample(sampler, 4).sequences if len(s.tokens) >= 2][:2]
    assert seqs, "the tiny model stopped at once on every sample"
    cookbook = [rl_loop_datum(s, a) for s, a in zip(seqs, (1.0, -0.5))]
    honest = [datum_for(s, a) for s, a in zip(seqs, (1.0, -0.5))]
    got = training.forward_backward(cookbook, "stable_reinforce").result(timeout=T)
    want = training.forward(honest, "stable_reinforce").result(timeout=T)
    assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5, abs=1e-6)
    assert got.metrics["loss:sum"] != 0.0
    # a wrong prompt token where the advantage is not 0 is still refused, and so is a wrong sampled token
    wrong = rl_loop_datum(seqs[0], 1.0)
    adv = [1.0] * len(wrong.loss_fn_inputs["advantages"].tolist())
    bad_prompt = types.Datum(wrong.model_input, {**wrong.loss_fn_inputs, "advantages": adv})
    bad_prompt = bad_prompt.with_provenance(
        model_input=wrong.model_input_spans, loss_fn_inputs=wrong.loss_fn_input_spans
    )
    with pytest.raises(tinker.RequestFailedError, match=r"differ from the prompt .* non-zero advantage"):
        training.forward([bad_prompt], "stable_reinforce").result(timeout=T)
    targets = wrong.loss_fn_inputs["target_tokens"].tolist()
    targets[-1] = (targets[-1] + 1) % 20
    bad_sampled = types.Datum(wrong.model_input, {**wrong.loss_fn_inputs, "target_tokens": targets})
    bad_sampled = bad_sampled.with_provenance(
        model_input=wrong.model_input_spans, loss_fn_inputs=wrong.loss_fn_input_spans
    )
    with pytest.raises(tinker.RequestFailedError, match="differ from the sampled tokens"):
        training.forward([bad_sampled], "stable_reinforce").result(timeout=T)


def test_gspo_without_config_takes_ppo_thresholds(training):
    """The cookbook's ``rl_loop loss_fn=gspo`` sends no ``loss_fn_config`` (was refused: "needs
    clip_low_threshold (no documented default)"); the defaults are PPO's 0.8 / 1.2."""
    seq = sample(training.save_weights_and_get_sampling_client()).sequences[0]
    n_prompt = len(PROMPT) - 1
    full = PROMPT + list(seq.tokens)
    d = types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={
            "target_tokens": full[1:],
            "logprobs": [0.0] * n_prompt + [x - 0.3 for x in seq.logprobs],  # sequence ratio e^0.3 > 1.2: clipped
            "advantages": [0.0] * n_prompt + [0.7] * len(seq.tokens),
            "sequence_ratio_mask": [0.0] * n_prompt + [1.0] * len(seq.tokens),
        },
    )
    default = training.forward([d], "gspo").result(timeout=T)
    lp = default.loss_fn_outputs[0]["logprobs"].tolist()
    q, adv = d.loss_fn_inputs["logprobs"].tolist(), d.loss_fn_inputs["advantages"].tolist()
    s = math.exp(sum(x - y for x, y in zip(lp[n_prompt:], q[n_prompt:])) / len(seq.tokens))
    assert s > 1.2
    expected = -sum(min(s * a, min(max(s, 0.8), 1.2) * a) for a in adv)  # every token carries s's value
    assert default.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    wider = training.forward([d], "gspo", {"clip_low_threshold": 0.8, "clip_high_threshold": 2.0}).result(timeout=T)
    assert wider.metrics["loss:sum"] != pytest.approx(default.metrics["loss:sum"], rel=1e-3)


def test_forward_with_n_by_k_target_tokens_gives_each_candidates_logprob(training):
    """``forward`` with ``(N, K)`` ``target_tokens`` (what ``forward_backward_custom`` sends for
    the cookbook's SDFT ``reverse=true``; was refused): logprobs ``(N, K)``, column k the
    logprobs of a 1-D forward on column k, and loss ``-sum(weights * logprobs)``."""
    tokens = [1, 4, 5, 13, 6]
    candidates = [[4, 5, 6], [5, 4, 7], [13, 6, 8], [6, 7, 9], [7, 8, 10]]
    weights = [[0.0, 0.0, 0.0], [0.5, 0.3, 0.2], [0.6, 0.4, 0.0], [1.0, 0.0, 0.0], [0.2, 0.2, 0.6]]
    d = types.Datum(
        model_input=types.ModelInput.from_ints(tokens),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[t for row in candidates for t in row], dtype="int64", shape=[5, 3]),
            "weights": types.TensorData(data=[w for row in weights for w in row], dtype="float32", shape=[5, 3]),
        },
    )
    out = training.forward([d], "cross_entropy").result(timeout=T)
    lp = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert lp.shape == (5, 3)
    for k in range(3):
        column = types.Datum(
            model_input=types.ModelInput.from_ints(tokens),
            loss_fn_inputs={"target_tokens": [row[k] for row in candidates], "weights": [1.0] * 5},
        )
        one = training.forward([column], "cross_entropy").result(timeout=T).loss_fn_outputs[0]["logprobs"].tolist()
        assert lp[:, k].tolist() == pytest.approx(one, abs=1e-5)
    expected = -sum(w * x for wr, xr in zip(weights, lp.tolist()) for w, x in zip(wr, xr))
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)

    def custom(data, logprobs):  # the SDK's client-side custom loss runs on this forward
        return -(logprobs[0] * data[0].loss_fn_inputs["weights"].to_torch()).sum(), {}

    custom_out = training.forward_backward_custom([d], custom).result(timeout=T)
    assert custom_out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
