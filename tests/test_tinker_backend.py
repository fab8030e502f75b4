"""The Tinker backend through the real SDK (``tinker`` 0.38) against the local Tinker server.

Every test that talks to a service starts
:class:`~tempering.plugins.tinker_server.server.LocalTinkerServer` on loopback
(``tests/fake_tinker.py``): the backend builds a real ``tinker.ServiceClient``, which speaks the
SDK's own wire protocol (JSON, and protobuf for forward/backward and samples) to a server that
trains and samples a tiny Llama with the local backend's code. What is checked here:

* the rows sent for GRPO, DPO, SDFT and off-policy batches, against hand-built datums (tokens,
  weights, sampler logprobs, advantages, ``loss_fn`` and ``loss_fn_config``);
* that each built-in mapping computes exactly our loss (value and gradient), by evaluating the
  documented formula of the built-in on the same tensors, and that the custom-loss path gives the
  service exactly our gradient;
* call order (forward_backward and optim_step submitted before anything is awaited, the sampler
  refreshed after the optimizer step), retries, checkpoints and resume;
* one recipe YAML run on ``backend.name=local`` and, switched by that key alone, on ``tinker``.

What the service does wrong, and what the backend does about it (setup errors, bounded waits,
recovery, ...), is tests/test_tinker_faults.py; the bundled recipes end to end on the server
are tests/test_tinker_recipes.py.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_tinker import make_backend, plain, sent, serve

from tempering.algorithms.dpo.algorithm import DPO
from tempering.algorithms.dpo.loss import DPOLoss
from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.algorithms.offpolicy import loss as offpolicy
from tempering.algorithms.sdft.loss import ImportanceSamplingLoss, SDFTLoss, fold_normaliser
from tempering.algorithms.sft.loss import CrossEntropyLoss
from tempering.plugins.backends.tinker import backend as backend_module
from tempering.plugins.backends.tinker import session as session_module
from tempering.plugins.backends.tinker.backend import TinkerBackend
from tempering.plugins.backends.tinker.errors import (
    TinkerAuthError,
    TinkerNotInstalledError,
    TinkerServiceError,
    TinkerTrainingError,
)
from tempering.plugins.backends.tinker.mapping import plan_loss
from tempering.plugins.tinker_server.builtin_losses import builtin_loss
from tempering.training.stale import OffPolicyObjective
from tempering.types import AdamParams, Batch, Completion, Datum, SamplingParams


@pytest.fixture
def server(monkeypatch, tmp_path):
    yield from serve(monkeypatch, tmp_path)


# The char tokenizer of tiny_llama: <pad>=0 <bos>=1 <eos>=2, "0".."9" = 3..12, "+"=13, "="=14, " "=15.
BOS, EOS = 1, 2
PROMPT = [BOS, 4, 5, 13, 6, 7, 14]  # "12+34="


def base_model(server):
    """The served model before any training (what a fresh adapter computes)."""
    return server.service.base("tiny_llama").model


def approx_rows(rows):
    return [
        {
            "model_input": r["model_input"],
            "loss_fn_inputs": {
                k: pytest.approx(v, abs=1e-6) if k != "target_tokens" else v for k, v in r["loss_fn_inputs"].items()
            },
        }
        for r in rows
    ]


def grpo_batch() -> Batch:
    """Two completions of "12+34=" as the GRPO stage builds them (advantage +1 and -1)."""
    a = Completion(PROMPT, [7, 9, EOS], [-0.5, -0.25, -0.125], "stop")  # "46"
    b = Completion(PROMPT, [7, EOS], [-1.0, -0.75], "stop")  # "4"
    return Batch([Datum.from_completion(a, advantage=1.0), Datum.from_completion(b, advantage=-1.0)])


# ---------------------------------------------------------------------- plugin and install
def test_plugin_registers_tinker_without_importing_the_sdk():
    code = textwrap.dedent("""
        import sys
        from tempering.registry import Registry
        reg = Registry(strict=True)
        comp = reg.get("backend", "tinker")
        comp.load()  # the backend module itself imports torch, but not the SDK
        print("tinker" in sys.modules, comp.target.__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "TinkerBackend"]


def test_missing_extra_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "tinker", None)  # import tinker -> ImportError
    with pytest.raises(TinkerNotInstalledError, match=r'pip install "tempering\[tinker\]"'):
        TinkerBackend(base_model="fake/tiny", service_client=object())


# ---------------------------------------------------------------------- auth
def test_malformed_key_fails_before_any_request(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TINKER_API_KEY", "sk-not-a-tinker-key")
    monkeypatch.delenv("TINKER_CREDENTIAL_CMD", raising=False)
    monkeypatch.setattr(
        backend_module, "service_client_factory", lambda **kw: pytest.fail("must not reach the service")
    )
    with pytest.raises(TinkerAuthError) as info:
        TinkerBackend(base_model="fake/tiny")
    message = str(info.value)
    assert "\n" not in message and "TINKER_API_KEY" in message and "tml-" in message
    assert "sk-not" not in message  # never echo the key

    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"name: r\noutput_dir: {tmp_path / 'out'}\nbackend: {{name: tinker, base_model: fake/tiny}}\n"
        "loggers: []\nstages: [{name: sft, steps: 1}]\n"
    )
    from tempering.apps.cli import main

    assert main(["run", str(recipe)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "TINKER_API_KEY" in err and "tml-" in err


# ---------------------------------------------------------------------- sampling
def test_sampling_params_and_completions(server):
    backend = make_backend(server)
    params = backend.sampling_params(SamplingParams(max_tokens=3, temperature=0.7, top_k=0, stop=[]))
    # no stop given: the tokenizer's EOS, explicitly (never None: the service's implicit stop)
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.stop, params.seed) == (
        3,
        0.7,
        -1,
        1.0,
        [EOS],
        None,
    )
    assert backend.sampling_params(SamplingParams(stop=[14])).stop == [14, EOS]  # EOS always stops
    assert backend.sampling_params(SamplingParams(stop=["="], top_k=5, seed=3)).model_dump(
        include={"stop", "top_k", "seed"}
    ) == {"stop": ["="], "top_k": 5, "seed": 3}

    groups = backend.sample([PROMPT, PROMPT[:4]], 3, SamplingParams(max_tokens=4, seed=1)).result()
    assert [len(g) for g in groups] == [3, 3]
    base, tokenizer = base_model(server), server.service.base("tiny_llama").tokenizer
    for prompt, group in zip([PROMPT, PROMPT[:4]], groups):
        for c in group:
            assert c.prompt_tokens == prompt and len(c.tokens) == len(c.logprobs) and 1 <= len(c.tokens) <= 4
            assert c.stop_reason == ("stop" if c.tokens[-1] == EOS else "length")
            assert c.policy_version == 0 and c.text == tokenizer.decode(c.tokens, skip_special_tokens=True)
            with torch.no_grad():  # the sampler's logprobs are the model's (temperature 1)
                logp = torch.log_softmax(base(input_ids=torch.tensor([prompt + c.tokens])).logits[0], -1)
            expected = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(c.tokens)]
            assert c.logprobs == pytest.approx(expected, abs=1e-5)
    requests = sent(server, "Sample")  # one request per prompt, sent concurrently: in either order
    assert sorted((r.num_samples, r.prompt.to_ints(), r.sampling_params.stop) for r in requests) == sorted(
        [(3, PROMPT, [EOS]), (3, PROMPT[:4], [EOS])]
    )


# ---------------------------------------------------------------------- the rows sent, by batch type
@pytest.mark.parametrize(
    ("loss_type", "extra", "coef"),
    [
        ("dapo", {}, ([1 / 5] * 3, [1 / 5] * 2)),  # token mean over the 5 completion tokens
        ("bnpo", {}, ([1 / 5] * 3, [1 / 5] * 2)),
        ("grpo", {}, ([1 / 6] * 3, [1 / 4] * 2)),  # 1 / (B * n_b)
        ("dr_grpo", {"max_completion_length": 4}, ([1 / 8] * 3, [1 / 8] * 2)),  # 1 / (B * L)
    ],
)
def test_grpo_rows_fold_the_normaliser_into_ppo_advantages(server, loss_type, extra, coef):
    backend = make_backend(server)
    fb = backend.forward_backward(grpo_batch(), GRPOLoss(loss_type=loss_type, epsilon_high=0.28, **extra))
    metrics = fb.result()
    (record,) = sent(server, "ForwardBackward")
    assert record.loss_fn == "ppo"
    assert record.loss_fn_config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    expected = [
        {
            "model_input": PROMPT + [7, 9],
            "loss_fn_inputs": {
                "target_tokens": PROMPT[1:] + [7, 9, EOS],
                "logprobs": [0.0] * 6 + [-0.5, -0.25, -0.125],
                "advantages": [0.0] * 6 + [1.0 * c for c in coef[0]],
            },
        },
        {
            "model_input": PROMPT + [7],
            "loss_fn_inputs": {
                "target_tokens": PROMPT[1:] + [7, EOS],
                "logprobs": [0.0] * 6 + [-1.0, -0.75],
                "advantages": [0.0] * 6 + [-1.0 * c for c in coef[1]],
            },
        },
    ]
    assert plain(record) == approx_rows(expected)
    assert "clip_ratio/region_mean" in metrics and math.isfinite(metrics["loss"])
    assert metrics["loss"] == pytest.approx(metrics["tinker/loss_sum"], abs=1e-5)  # our loss = the service's


def test_grpo_with_kl_or_two_sided_clip_is_a_custom_loss(server):
    backend = make_backend(server)
    batch = grpo_batch()
    for d in batch.data:
        d.extra["ref_logprobs"] = [-1.0] * len(d.target_tokens)
    for loss in (GRPOLoss(beta=0.04), GRPOLoss(delta=1.5), GRPOLoss(importance_sampling_level="sequence", beta=0.04)):
        assert plan_loss(loss, batch).custom
    metrics = backend.forward_backward(batch, GRPOLoss(beta=0.04)).result()
    (record,) = sent(server, "Forward")  # the SDK's custom loss: a forward pass, our loss, a linear backward
    assert record.loss_fn == "cross_entropy"
    (backward,) = sent(server, "ForwardBackward")
    assert backward.loss_fn == "cross_entropy" and metrics["tinker/custom_loss"] == 1.0
    assert (
        plain(record)
        == [  # only what the service needs for the surrogate cross_entropy
            {
                "model_input": PROMPT + [7, 9],
                "loss_fn_inputs": {"target_tokens": PROMPT[1:] + [7, 9, EOS], "weights": [0.0] * 6 + [1.0] * 3},
            },
            {
                "model_input": PROMPT + [7],
                "loss_fn_inputs": {"target_tokens": PROMPT[1:] + [7, EOS], "weights": [0.0] * 6 + [1.0] * 2},
            },
        ]
    )


def test_grpo_with_sequence_ratios_is_tinker_gspo(server):
    """GSPO (sequence-level ratios) maps onto Tinker's built-in ``gspo`` (GSPO-token) with the
    loss mask as ``sequence_ratio_mask``; the service's loss is ours."""
    backend = make_backend(server)
    metrics = backend.forward_backward(
        grpo_batch(), GRPOLoss(importance_sampling_level="sequence", epsilon_high=0.28)
    ).result()
    (record,) = sent(server, "ForwardBackward")
    assert record.loss_fn == "gspo" and not sent(server, "Forward")  # a built-in: no extra forward pass
    assert record.loss_fn_config == pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28})
    rows = plain(record)
    assert [r["loss_fn_inputs"]["sequence_ratio_mask"] for r in rows] == [[0.0] * 6 + [1.0] * 3, [0.0] * 6 + [1.0] * 2]
    assert rows[0]["loss_fn_inputs"]["advantages"] == pytest.approx([0.0] * 6 + [1 / 5] * 3)  # dapo: 1 / N folded in
    assert metrics["loss"] == pytest.approx(metrics["tinker/loss_sum"], abs=1e-6)


def test_dpo_rows_and_reference(server):
    backend = make_backend(server)
    stage = DPO()
    batch = stage.build_batch(backend.tokenizer, [{"prompt": "1+2=", "chosen": "3", "rejected": "4"}])
    for d, lp in zip(batch.data, backend.logprobs(batch, reference=True).result()):
        d.extra["ref_logprobs"] = lp
    metrics = backend.forward_backward(batch, DPOLoss(beta=0.1)).result()
    (record,) = sent(server, "Forward")
    prompt = [BOS, 4, 13, 5, 14]  # "1+2="
    assert plain(record) == [
        {
            "model_input": prompt + [6],
            "loss_fn_inputs": {"target_tokens": prompt[1:] + [6, EOS], "weights": [0.0] * 4 + [1.0] * 2},
        },
        {
            "model_input": prompt + [7],
            "loss_fn_inputs": {"target_tokens": prompt[1:] + [7, EOS], "weights": [0.0] * 4 + [1.0] * 2},
        },
    ]
    # reference = the base model, policy = the fresh adapter (the base model): DPO starts at ln 2
    assert metrics["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert metrics["tinker/custom_loss"] == 1.0


def test_sdft_sampled_token_rows_are_importance_sampling(server):
    backend = make_backend(server)
    c = Completion([BOS, 4, 14], [5, 6, EOS], [-0.3, -0.4, -0.5], "stop")  # "1=" -> "23"
    d = Datum.from_completion(c, weight=1.0)
    d.weights = [0.0, 0.0, 0.0, 1.0, 1.0]  # skip_first_tokens=1, as the stage does
    teacher = [0.0, 0.0, -0.1, -0.2, -0.6]
    (norm,) = fold_normaliser([d.weights], "seq_mean")
    d.advantages = [-(q - t) * n for q, t, n in zip(d.sampler_logprobs, teacher, norm)]
    d.extra["teacher_token_logprobs"] = teacher
    backend.forward_backward(Batch([d]), SDFTLoss(mode="sampled_token")).result()
    (record,) = sent(server, "ForwardBackward")
    assert (record.loss_fn, record.loss_fn_config) == ("importance_sampling", None)
    assert plain(record) == approx_rows(
        [
            {
                "model_input": [BOS, 4, 14, 5, 6],
                "loss_fn_inputs": {
                    "target_tokens": [4, 14, 5, 6, EOS],
                    "logprobs": [0.0, 0.0, 0.0, -0.4, -0.5],  # 0 where the weight is 0 (the skipped token too)
                    "advantages": [0.0, 0.0, 0.0, 0.1, -0.05],
                },
            }
        ]
    )

    with pytest.raises(NotImplementedError, match="sampled_token"):
        backend.forward_backward(Batch([d]), SDFTLoss(mode="topk_logits"))


OFFPOLICY = [
    offpolicy.PPOLoss(clip_high_threshold=1.28),
    offpolicy.CISPOLoss(),
    offpolicy.TISLoss(truncation=2.5),
    offpolicy.ClippedISLoss(),
    OffPolicyObjective(offpolicy.PPOLoss()),
]


@pytest.mark.parametrize("loss", OFFPOLICY, ids=["ppo", "cispo", "tis", "clipped_is", "objective"])
def test_offpolicy_rows_use_the_builtin_with_its_thresholds(server, loss):
    """The loss declares its built-in and thresholds (the offpolicy package owns that choice);
    the backend sends exactly those, with hand-checked rows."""
    backend = make_backend(server)
    rows = [
        Datum([BOS, 4, 14, 5], [4, 14, 5, EOS], [0, 0, 1, 1], [0.0, 0.0, -0.7, -0.2], [0.0, 0.3, 0.25, 0.25]),
        Datum([BOS, 14, 6], [14, 6, EOS], [0, 1, 0], [0.0, -1.5, -0.9], [0.5, -0.5, -0.5]),  # last token masked out
    ]
    backend.forward_backward(Batch(rows), loss).result()
    (record,) = sent(server, "ForwardBackward")
    assert record.loss_fn == loss.tinker_builtin in ("ppo", "cispo")
    declared = loss.tinker_loss_fn_config
    assert set(declared) == {"clip_low_threshold", "clip_high_threshold"}
    assert record.loss_fn_config == pytest.approx(declared)
    if isinstance(loss, offpolicy.PPOLoss) and type(loss) is offpolicy.PPOLoss:
        assert (record.loss_fn, record.loss_fn_config) == (
            "ppo",
            pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}),
        )
    assert plain(record) == approx_rows(
        [
            {
                "model_input": [BOS, 4, 14, 5],
                "loss_fn_inputs": {
                    "target_tokens": [4, 14, 5, EOS],
                    "logprobs": [0.0, 0.0, -0.7, -0.2],
                    "advantages": [0.0, 0.0, 0.25, 0.25],
                },
            },
            {
                "model_input": [BOS, 14, 6],
                "loss_fn_inputs": {
                    "target_tokens": [14, 6, EOS],
                    "logprobs": [0.0, -1.5, 0.0],
                    "advantages": [0.0, -0.5, 0.0],
                },
            },
        ]
    )


def test_losses_tinker_cannot_run_fail_clearly(server):
    backend = make_backend(server)
    batch = grpo_batch()
    with pytest.raises(NotImplementedError, match="full logits"):
        backend.forward_backward(batch, OffPolicyObjective(offpolicy.PPOLoss(), temperature=0.7))

    class NoThresholds:
        needs_logits, tinker_builtin = False, "ppo"

    with pytest.raises(ValueError, match="clip thresholds"):
        plan_loss(NoThresholds(), batch)
    assert not sent(server, "ForwardBackward")


def test_soft_targets_go_to_cross_entropy_as_n_by_k(server):
    class TopKCE:  # what an SDFT top-k cross-entropy loss would declare
        needs_logits, tinker_builtin = True, "cross_entropy"

    backend = make_backend(server)
    d = Datum([BOS, 4], [4, 14], [0.0, 1.0])
    d.extra["soft_target_ids"] = [[4, 5], [14, 6]]
    d.extra["soft_target_weights"] = [[0.0, 0.0], [0.75, 0.25]]
    metrics = backend.forward_backward(Batch([d]), TopKCE()).result()
    (record,) = sent(server, "ForwardBackward")
    assert (record.loss_fn, plain(record)) == (
        "cross_entropy",
        [
            {
                "model_input": [BOS, 4],
                "loss_fn_inputs": {"target_tokens": [[4, 5], [14, 6]], "weights": [[0.0, 0.0], [0.75, 0.25]]},
            }
        ],
    )
    with torch.no_grad():
        logp = torch.log_softmax(base_model(server)(input_ids=torch.tensor([[BOS, 4]])).logits[0], -1)
    assert metrics["loss"] == pytest.approx(-(0.75 * float(logp[1, 14]) + 0.25 * float(logp[1, 6])), abs=1e-5)


# ---------------------------------------------------------------------- exactness of the mapping
def random_batch(seed: int, per_token_adv: bool = True) -> tuple[Batch, torch.Tensor]:
    """Rows of mixed lengths with prompt (weight 0) and completion positions, a row with no
    loss token, sampler logprobs and advantages; plus policy logprobs (B, T) spread around
    the sampler's so that ratios fall on both sides of every clip."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for prompt_len, comp_len in [(3, 4), (2, 1), (4, 5), (2, 3)]:
        n = prompt_len - 1 + comp_len
        weights = [0.0] * (prompt_len - 1) + [1.0] * comp_len
        q = (-torch.rand(n, generator=g) * 3).tolist()
        adv = torch.randn(n, generator=g) if per_token_adv else torch.full((n,), float(torch.randn(1, generator=g)))
        rows.append(
            Datum(
                list(range(n)),
                list(range(1, n + 1)),
                weights,
                [x if w else 0.0 for x, w in zip(q, weights)],
                adv.tolist(),
            )
        )
    rows[3].weights = [0.0] * len(rows[3].weights)  # e.g. a failed sample
    t = Batch(rows).to_tensors()
    lp = t["sampler_logprobs"] + 0.4 * torch.randn(t["sampler_logprobs"].shape, generator=g)
    lp = torch.where(t["weights"] > 0, lp, -torch.rand(lp.shape, generator=g))
    return Batch(rows), lp


def builtin_side(plan, lp: torch.Tensor) -> torch.Tensor:
    """Tinker's documented formula, per datum, summed (what the service computes)."""
    total = lp.new_zeros(())
    for i, inputs in enumerate(plan.inputs):
        n = len(inputs["target_tokens"])
        tensors = {
            k: torch.tensor(v, dtype=torch.int64 if k == "target_tokens" else torch.float32) for k, v in inputs.items()
        }
        total = total + builtin_loss(plan.loss_fn, plan.loss_fn_config, lp[i, :n], tensors)
    return total


def assert_same_loss_and_gradient(loss, batch: Batch, lp: torch.Tensor) -> None:
    plan = plan_loss(loss, batch)
    assert not plan.custom, plan.note
    ours_lp = lp.clone().requires_grad_(True)
    ours = loss(ours_lp, batch.to_tensors()).loss
    ours.backward()
    theirs_lp = lp.clone().requires_grad_(True)
    theirs = builtin_side(plan, theirs_lp)
    theirs.backward()
    assert float(theirs.detach()) == pytest.approx(float(ours.detach()), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(theirs_lp.grad, ours_lp.grad, atol=1e-6, rtol=1e-5)


EXACT = [
    *[
        GRPOLoss(loss_type=t, epsilon_low=lo, epsilon_high=hi)
        for t in ("dapo", "bnpo", "grpo")
        for lo, hi in ((0.2, 0.2), (0.2, 0.28))
    ],
    GRPOLoss(loss_type="dr_grpo", max_completion_length=6),
    GRPOLoss(loss_type="dr_grpo"),  # constant = the padded width
    *[
        GRPOLoss(loss_type=t, importance_sampling_level="sequence", epsilon_high=0.28)
        for t in ("dapo", "grpo", "dr_grpo")
    ],
    ImportanceSamplingLoss(),
    SDFTLoss(mode="sampled_token"),
    CrossEntropyLoss(),
    *OFFPOLICY,
]


@pytest.mark.parametrize(
    "loss",
    EXACT,
    ids=lambda x: f"{type(x).__name__}-{getattr(x, 'loss_type', '')}-{getattr(x, 'importance_sampling_level', '')}",
)
@pytest.mark.parametrize("seed", [0, 1])
def test_builtin_mapping_computes_exactly_our_loss(loss, seed):
    batch, lp = random_batch(seed, per_token_adv=not isinstance(loss, GRPOLoss))
    assert_same_loss_and_gradient(loss, batch, lp)


def test_every_registered_builtin_loss_maps_exactly(fresh_registry):
    """Whatever loss a plugin registers with ``tinker_builtin`` set (built with its defaults)."""
    checked = []
    for comp in fresh_registry.components("loss"):
        try:
            loss = comp.load()()
        except TypeError:
            continue  # needs arguments
        if not getattr(loss, "tinker_builtin", None) or getattr(loss, "needs_logits", False):
            continue
        batch, lp = random_batch(3)
        assert_same_loss_and_gradient(loss, batch, lp)
        checked.append(comp.name)
    assert {"cross_entropy", "importance_sampling"} <= set(checked)


def test_the_exactness_check_detects_a_wrong_normaliser():
    """The same check fails when the fold is wrong (GRPO's per-sequence mean sent with the
    token-mean coefficients): it can tell the four aggregations apart."""
    batch, lp = random_batch(0, per_token_adv=False)
    right = plan_loss(GRPOLoss(loss_type="grpo"), batch)
    wrong = plan_loss(GRPOLoss(loss_type="dapo"), batch)
    a, b = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    builtin_side(right, a).backward()
    builtin_side(wrong, b).backward()
    assert not torch.allclose(a.grad, b.grad, atol=1e-4)


def _model_gradient(model, batch: Batch, loss) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    model.zero_grad(set_to_none=True)
    model.train()
    t = batch.to_tensors()
    rows = []
    for d in batch.data:
        logp = torch.log_softmax(model(input_ids=torch.tensor([d.input_tokens])).logits[0].float(), -1)
        rows.append(logp.gather(-1, torch.tensor(d.target_tokens).unsqueeze(-1)).squeeze(-1))
    lp = torch.stack([torch.nn.functional.pad(r, (0, t["weights"].shape[1] - r.shape[0])) for r in rows])
    loss(lp, t).loss.backward()
    return [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


@pytest.mark.parametrize(
    "loss", [GRPOLoss(epsilon_high=0.28), GRPOLoss(beta=0.04), DPOLoss()], ids=["ppo", "custom-kl", "custom-dpo"]
)
def test_service_gradient_equals_the_local_gradient(server, loss):
    """End to end on the fake's model: the built-in (ppo) and the custom-loss surrogate
    (cross_entropy with weights -dL/dlp) give the service our loss's gradient."""
    backend = make_backend(server)
    batch = grpo_batch()
    for d in batch.data:
        d.extra["ref_logprobs"] = [-2.5] * len(d.target_tokens)
    model = server.service.runs[backend.training_client.model_id].backend.model  # the run's (LoRA) model
    expected = _model_gradient(model, batch, loss)
    backend.forward_backward(batch, loss).result()
    got = [p.grad for p in model.parameters() if p.requires_grad]
    expected = [g for g, p in zip(expected, model.parameters()) if p.requires_grad]
    assert any(float(g.abs().sum()) > 0 for g in expected) and len(got) == len(expected) > 0
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-4)


# ---------------------------------------------------------------------- call order and refresh
def kinds(server, *names):
    return [r.kind for r in server.requests(*names)]


def test_forward_backward_and_optim_step_go_out_before_anything_is_awaited(server):
    backend = make_backend(server)
    first = backend.sample([PROMPT], 1, SamplingParams(max_tokens=2)).result()
    server.paused.set()  # the service holds every result back (try_again, queue paused)
    fb = backend.forward_backward(grpo_batch(), GRPOLoss())
    op = backend.optim_step(AdamParams(learning_rate=1e-2))
    deadline = time.monotonic() + 10
    while len(kinds(server, "ForwardBackward", "OptimStep")) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert kinds(server, "ForwardBackward", "OptimStep") == ["ForwardBackward", "OptimStep"]  # both submitted ...
    assert not fb.done() and not op.done()  # ... before either result came back
    server.paused.clear()
    fb.result(), op.result()
    second = backend.sample([PROMPT], 1, SamplingParams(max_tokens=2)).result()
    assert kinds(server, "SaveWeightsForSampler", "Sample", "ForwardBackward", "OptimStep") == [
        "SaveWeightsForSampler",
        "Sample",
        "ForwardBackward",
        "OptimStep",
        "SaveWeightsForSampler",
        "Sample",
    ]
    assert (first[0][0].policy_version, second[0][0].policy_version, backend.step) == (0, 1, 1)
    sessions = [r.sampling_session_id for r in sent(server, "Sample")]
    assert sessions[0] != sessions[1]  # the second sample used the new weights' session
    seqs = [r.seq_id for r in sent(server, "ForwardBackward") + sent(server, "OptimStep")]
    assert seqs == sorted(seqs) and len(set(seqs)) == 2


def test_sampler_refresh_every_k_steps(server):
    backend = make_backend(server, sampler_refresh_every=2)
    versions = []
    for _ in range(4):
        versions.append(backend.sample([PROMPT], 1, SamplingParams(max_tokens=1)).result()[0][0].policy_version)
        backend.forward_backward(grpo_batch(), GRPOLoss()).result()
        backend.optim_step(AdamParams()).result()
    assert versions == [0, 0, 2, 2]
    assert len(sent(server, "SaveWeightsForSampler")) == 2


def test_sampling_client_for_async_loops(server):
    backend = make_backend(server)
    backend.forward_backward(grpo_batch(), GRPOLoss())
    backend.optim_step(AdamParams())
    client = backend.sampling_client().result()  # queued after the optim step
    assert client.policy_version == 1
    assert client.sample([PROMPT], 2, SamplingParams(max_tokens=2)).result()[0][1].policy_version == 1
    assert kinds(server)[-3:] == ["OptimStep", "SaveWeightsForSampler", "Sample"]
    (save,) = sent(server, "SaveWeightsForSampler")
    assert (save.kind, save.path) == ("snapshot", None)  # the default: fixed weights, exact policy_version


# ---------------------------------------------------------------------- retries
def test_failed_sampling_is_retried_with_backoff(server, monkeypatch):
    """A sample the service fails (RequestFailedError, category server) is sent again; the SDK
    itself does not retry those."""
    delays = []
    monkeypatch.setattr(session_module.time, "sleep", delays.append)  # the session's retry loop waits
    monkeypatch.setattr(session_module.random, "uniform", lambda a, b: 1.0)
    backend = make_backend(server, retry_backoff=0.5)
    server.faults.fail("Sample", times=2)
    groups = backend.sample([PROMPT], 2, SamplingParams(max_tokens=2)).result()
    assert len(groups[0]) == 2 and len(sent(server, "Sample")) == 3
    assert delays == [0.5, 1.0] and backend.retry_count == 2


def test_scoring_retries_until_the_budget_then_fails_in_one_line(server):
    backend = make_backend(server, max_retries=2)
    batch = Batch(grpo_batch().data[:1])  # one request: the retries are per request
    assert len(backend.logprobs(batch, reference=True).result()) == 1  # the base-model sampler exists now
    before = len(sent(server, "Sample"))
    server.faults.fail("Sample")
    assert len(backend.logprobs(batch, reference=True).result()) == 1  # retried once
    assert len(sent(server, "Sample")) == before + 2
    server.faults.fail("Sample", times=3)
    with pytest.raises(TinkerServiceError) as info:
        backend.logprobs(batch, reference=True).result()
    assert "\n" not in str(info.value) and "3 attempt" in str(info.value) and "max_retries" in str(info.value)
    assert len(sent(server, "Sample")) == before + 2 + 3


def test_a_failed_training_call_is_never_simply_sent_again(server):
    """With recovery off, a training call the service failed raises (once, one line); it is not
    re-sent, since the service may already have applied it or what was queued behind it."""
    backend = make_backend(server, max_recoveries=0)
    server.faults.fail("ForwardBackward")
    with pytest.raises(TinkerTrainingError) as info:
        backend.forward_backward(grpo_batch(), GRPOLoss()).result()
    assert len(sent(server, "ForwardBackward")) == 1
    message = str(info.value)
    assert "recovery is off" in message and "resume" in message and "\n" not in message


# ---------------------------------------------------------------------- scoring, snapshots
def _row_logprobs(model, batch: Batch) -> list[list[float]]:
    out = []
    with torch.no_grad():
        for d in batch.data:
            logp = torch.log_softmax(model(input_ids=torch.tensor([d.input_tokens])).logits[0], -1)
            out.append(logp.gather(-1, torch.tensor(d.target_tokens).unsqueeze(-1)).squeeze(-1).tolist())
    return out


def test_logprobs_policy_reference_and_snapshots(server):
    backend = make_backend(server)
    batch = grpo_batch()
    base = _row_logprobs(base_model(server), batch)
    for got, want in zip(backend.logprobs(batch).result(), base):
        assert got == pytest.approx(want, abs=1e-5)
    assert sent(server, "Forward")[0].loss_fn == "cross_entropy"  # the trainer's own forward
    backend.snapshot("start").result()
    backend.forward_backward(batch, GRPOLoss())
    backend.optim_step(AdamParams(learning_rate=5e-2)).result()
    moved = backend.logprobs(batch).result()
    assert moved[0] != pytest.approx(base[0], abs=1e-3)
    for name, kwargs in (("reference", {"reference": True}), ("snapshot", {"weights": "start"})):
        for got, want in zip(backend.logprobs(batch, **kwargs).result(), base):
            assert got == pytest.approx(want, abs=1e-5), name
    sampler = make_backend(server, policy_logprobs="sampler")
    assert sampler.logprobs(batch).result()[1] == pytest.approx(base[1], abs=1e-5)
    with pytest.raises(KeyError, match="no weight snapshot"):
        backend.logprobs(batch, weights="missing")


def test_distributions_topk_and_what_tinker_cannot_do(server):
    backend = make_backend(server)
    batch = grpo_batch()
    (values, ids), _ = backend.distributions(batch, reference=True, topk=3).result()
    assert values.shape == ids.shape == (9, 3)
    with torch.no_grad():
        logp = torch.log_softmax(base_model(server)(input_ids=torch.tensor([batch.data[0].input_tokens])).logits[0], -1)
    top = torch.topk(logp, 3, dim=-1)
    torch.testing.assert_close(values, top.values, atol=1e-5, rtol=0)
    assert torch.equal(ids, top.indices)
    with pytest.raises(NotImplementedError, match="topk"):
        backend.distributions(batch)
    with pytest.raises(NotImplementedError, match="stage_start"):
        backend.ema_update("teacher", 0.05)


# ---------------------------------------------------------------------- checkpoints
def test_save_and_resume_restore_weights_step_snapshots_and_extra(server, tmp_path):
    index = str(tmp_path / "index")
    backend = make_backend(server, checkpoint_index_dir=index)
    batch = grpo_batch()
    backend.snapshot("reference/rl").result()
    backend.forward_backward(batch, GRPOLoss())
    backend.optim_step(AdamParams(learning_rate=5e-2))
    path = backend.save(str(tmp_path / "ckpt" / "step000001"), extra={"state": {"position": 7}})
    record = json.loads((tmp_path / "ckpt" / "step000001" / "tinker_checkpoint.json").read_text())
    assert kinds(server, "SaveWeights") == ["SaveWeights"]
    assert record["tinker_path"] in server.service.states and record["tinker_path"].startswith("tinker://")
    assert (record["step"], record["extra"], sorted(record["snapshots"])) == (
        1,
        {"state": {"position": 7}},
        ["reference/rl"],
    )
    trained, at_start = backend.logprobs(batch).result(), backend.logprobs(batch, weights="reference/rl").result()

    for source in (path, record["tinker_path"]):  # the local folder, or the tinker path via the index
        resumed = make_backend(server, checkpoint_index_dir=index)
        assert resumed.load(source) == {"state": {"position": 7}}
        assert resumed.step == 1 and resumed.snapshot_names() == ["reference/rl"]
        assert resumed.logprobs(batch).result()[0] == pytest.approx(trained[0], abs=1e-6)
        assert resumed.logprobs(batch, weights="reference/rl").result()[0] == pytest.approx(at_start[0], abs=1e-6)
        assert resumed.sample([PROMPT], 1, SamplingParams(max_tokens=1)).result()[0][0].policy_version == 1
    loads = sent(server, "LoadWeights")
    assert [r.path for r in loads] == [record["tinker_path"]] * 2 and all(r.optimizer for r in loads)
    assert len(sent(server, "CreateModel")) == 1  # a resumed backend creates no fresh run
    started = make_backend(server, init_state=record["tinker_path"])  # start a new run from a saved state
    assert started.logprobs(batch).result()[0] == pytest.approx(trained[0], abs=1e-6) and started.step == 0

    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "meta.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="local-backend checkpoint"):
        make_backend(server).load(str(tmp_path / "local"))


# ---------------------------------------------------------------------- one recipe, two backends
RECIPE = """
name: switch
seed: 0
backend:
  name: local
  model: tiny_llama
  model_kwargs: {hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}
  num_threads: 1
loggers: [jsonl]
max_total_steps: 2
checkpoint_every: 1
stages:
  - id: rl
    name: grpo
    dataset: {name: arithmetic, split: train, size: 64}
    reward: exact_match
    loss: {name: grpo, loss_type: dapo, epsilon_high: 0.28}
    steps: 3
    prompts_per_step: 2
    group_size: 2
    max_tokens: 3
    kl_every: 1
    optimizer: {learning_rate: 1.0e-2}
    eval: {dataset: {name: arithmetic, split: test, size: 4}, max_tokens: 3}
"""


def _rl_rows(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["stage"] == "rl" and "reward/mean" in r]


def test_the_same_recipe_runs_on_local_and_on_tinker(server, tmp_path, fresh_registry):
    from tempering.training.recipe import Recipe, read_progress

    recipe = tmp_path / "switch.yaml"
    recipe.write_text(RECIPE)

    Recipe.from_yaml(str(recipe), [f"output_dir={tmp_path / 'local'}"]).run()
    with pytest.warns(UserWarning, match="ignores local-backend keys: model_kwargs, num_threads"):
        Recipe.from_yaml(str(recipe), [f"output_dir={tmp_path / 'tinker'}", "backend.name=tinker"]).run()

    local, remote = _rl_rows(tmp_path / "local"), _rl_rows(tmp_path / "tinker")
    assert [r["step"] for r in local] == [r["step"] for r in remote] == [1, 2]
    backend_only = {"grad_norm", "grad_clipped", "skipped_nonfinite"}
    assert set(local[0]) - backend_only <= set(remote[0])
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["kl_ref"]) for r in remote)
    fbs = sent(server, "ForwardBackward")
    assert [(r.loss_fn, r.loss_fn_config) for r in fbs] == [
        ("ppo", pytest.approx({"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}))
    ] * 2
    assert sent(server, "CreateModel")[0].base_model == "tiny_llama"  # backend.model carried over
    progress = read_progress(str(tmp_path / "tinker"))
    assert progress["current"] == "rl" and progress["global_step"] == 2
    record = json.loads((Path(progress["checkpoint"]) / "tinker_checkpoint.json").read_text())
    assert record["extra"]["state"]["step"] == 2
    assert [r["reason"]["type"] for r in sent(server, "FinishSession")] == ["success"]

    # Resume the interrupted Tinker run: a new session, the state restored, step 3 trained.
    with pytest.warns(UserWarning):
        Recipe.from_yaml(
            str(recipe), [f"output_dir={tmp_path / 'tinker'}", "backend.name=tinker", "max_total_steps=null"]
        ).run()
    assert sent(server, "LoadWeights")[-1].path == record["tinker_path"]
    assert [r["step"] for r in _rl_rows(tmp_path / "tinker")] == [1, 2, 3]
    assert len(sent(server, "ForwardBackward")) == 3
    assert read_progress(str(tmp_path / "tinker"))["completed"] == ["rl"]
    names = [r.path for r in sent(server, "SaveWeights")]
    assert len(names) == len(set(names))  # every checkpoint has its own name


def test_async_offpolicy_stage_samples_from_published_snapshots(server, tmp_path, fresh_registry):
    """The off-policy stage's producer samples through ``sampling_client()`` while training,
    here with ``inflight`` sampling clients (weights shared with the trainer)."""
    from tempering.training.recipe import Recipe

    stage = {
        "name": "offpolicy",
        "steps": 3,
        "prompts_per_step": 2,
        "group_size": 2,
        "max_tokens": 3,
        "stale": {"max_steps_off_policy": 1},
        "optimizer": {"learning_rate": 1e-2},
        "dataset": {"name": "arithmetic", "size": 32},
    }
    Recipe.from_dict(
        {
            "name": "o",
            "output_dir": str(tmp_path / "o"),
            "loggers": ["jsonl"],
            "stages": [stage],
            "backend": {
                "name": "tinker",
                "base_model": "tiny_llama",
                "sampling_client_kind": "inflight",
                "checkpoint_index_dir": str(tmp_path / "i"),
            },
        }
    ).run()
    rows = [
        r
        for r in (json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines())
        if "offpolicy/staleness_mean" in r
    ]
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["offpolicy/staleness_max"] <= 1 for r in rows)
    assert {r.loss_fn for r in sent(server, "ForwardBackward")} == {
        fresh_registry.build("loss", "clipped_is").tinker_builtin
    }
    publishes = [r for r in sent(server, "SaveWeightsForSampler") if r.path is None]
    assert len(publishes) >= 3 and {r.kind for r in publishes} == {"inflight"}  # a publish per step, no copy
