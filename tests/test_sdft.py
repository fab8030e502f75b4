"""SDFT: the losses against TRL 1.16's ``trl.experimental.sdft`` (its loss utilities on the same
logits, and its trainer's alignment + aggregation on the same tiny model and batch), the
backend's weight snapshots / EMA / distributions, and the stage end to end."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch
from tiny_runs import TwoTurns, tiny_recipe

from tempering.algorithms.sdft.algorithm import DEFAULT_TEACHER_TEMPLATE, SDFT, teacher_prompt
from tempering.algorithms.sdft.loss import (
    ImportanceSamplingLoss,
    SDFTLoss,
    add_tail_bucket,
    aggregate,
    divergence,
    fold_normaliser,
    full_logits_loss,
    topk_logits_loss,
)
from tempering.algorithms.sft.loss import CrossEntropyLoss
from tempering.interfaces import Loss
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.training.recipe import Recipe
from tempering.types import AdamParams, Batch, Completion, Datum

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
ALPHAS = (0.0, 0.3, 0.5, 1.0)


@pytest.fixture(scope="module")
def sdft_utils():
    import trl
    import trl.experimental.sdft.loss_utils as lu  # a hard dependency: a missing oracle is a failure

    assert trl.__version__.startswith("1.16"), trl.__version__
    return lu


def random_logits(seed: int, shape=(3, 5, 11), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


# --------------------------------------------------------------------------- pure functions vs TRL
@pytest.mark.parametrize("alpha", ALPHAS)
def test_divergence_matches_trl(sdft_utils, alpha):
    s = torch.log_softmax(random_logits(0), -1)
    t = torch.log_softmax(random_logits(1), -1)
    ours, theirs = divergence(s, t, alpha), sdft_utils.compute_divergence(s, t, alpha)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    assert (ours > 0).all()
    # the end points by hand: forward KL(T || S) and reverse KL(S || T)
    if alpha == 0.0:
        torch.testing.assert_close(ours, (t.exp() * (t - s)).sum(-1))
    if alpha == 1.0:
        torch.testing.assert_close(ours, (s.exp() * (s - t)).sum(-1))
    assert divergence(s, s, alpha).abs().max() < 1e-12


@pytest.mark.parametrize("add_tail", [False, True])
@pytest.mark.parametrize("alpha", ALPHAS)
def test_topk_and_full_logit_losses_match_trl(sdft_utils, alpha, add_tail):
    s, t = random_logits(2), random_logits(3)
    ours = topk_logits_loss(s, alpha, 4, add_tail, teacher_logits=t)
    theirs = sdft_utils.compute_topk_self_distillation_loss(
        s, t, distillation_topk=4, distillation_alpha=alpha, distillation_add_tail=add_tail
    )
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)
    full = full_logits_loss(s, t, alpha)
    torch.testing.assert_close(
        full, sdft_utils.compute_full_logit_self_distillation_loss(s, t, distillation_alpha=alpha), atol=1e-12, rtol=0
    )
    # k = V with a tail is the full divergence (the tail bucket is empty)
    torch.testing.assert_close(
        topk_logits_loss(s, alpha, s.size(-1), False, teacher_logits=t), full, atol=1e-10, rtol=0
    )


def test_tail_bucket_matches_trl(sdft_utils):
    lp = torch.log_softmax(random_logits(4), -1)[..., :5]
    torch.testing.assert_close(add_tail_bucket(lp), sdft_utils.add_tail_bucket(lp), atol=1e-12, rtol=0)
    assert torch.logsumexp(add_tail_bucket(lp), -1).abs().max() < 1e-9  # sums to one


def test_sampled_token_gradient_matches_trl(sdft_utils):
    """Our sampled-token loss is Tinker's importance_sampling with A = -(q - lp_teacher) times
    the seq-mean normaliser; on-policy (q = lp) its gradient w.r.t. the student logits is that
    of TRL's ``compute_sampled_token_self_distillation_loss`` aggregated per sequence."""
    s = random_logits(5).float().requires_grad_(True)
    t = random_logits(6).float()
    ids = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(7))
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.float32)
    per_token = sdft_utils.compute_sampled_token_self_distillation_loss(s, t, ids, distillation_alpha=1.0)
    ((per_token * mask).sum(-1) / mask.sum(-1)).mean().backward()
    trl_grad = s.grad.clone()

    s.grad = None
    lp = torch.log_softmax(s, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    q = lp.detach()
    lp_t = torch.log_softmax(t, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    norm = torch.tensor(fold_normaliser(mask.tolist(), "seq_mean"))
    adv = -(q - lp_t) * norm
    out = SDFTLoss(mode="sampled_token")(
        lp, {"weights": mask, "sampler_logprobs": q, "advantages": adv, "teacher_token_logprobs": lp_t}
    )
    out.loss.backward()
    torch.testing.assert_close(s.grad, trl_grad, atol=1e-6, rtol=0)
    # its value on-policy is the seq-mean sampled reverse KL
    expected = (((q - lp_t) * mask).sum(-1) / mask.sum(-1)).mean()
    assert out.loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert out.metrics["sdft/distill_loss"] == pytest.approx(
        ((q - lp_t) * mask).sum().item() / mask.sum().item(), abs=1e-6
    )


def test_importance_sampling_is_tinkers_sum_and_masks():
    lp = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 9.0]], requires_grad=True)
    q = torch.tensor([[5.0, -1.5, -2.0], [5.0, -0.5, 0.0]])
    adv = torch.tensor([[7.0, 2.0, -1.0], [7.0, 3.0, 100.0]])
    w = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    out = ImportanceSamplingLoss()(lp, {"weights": w, "sampler_logprobs": q, "advantages": adv})
    assert out.loss.item() == pytest.approx(-(math.exp(0.5) * 2 - 1 + 3), abs=1e-6)
    assert isinstance(ImportanceSamplingLoss(), Loss) and ImportanceSamplingLoss.tinker_builtin == "importance_sampling"


def test_aggregations_and_fold_normaliser_agree():
    per = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    m = torch.tensor(mask)
    assert aggregate(per, m, "seq_mean").item() == pytest.approx(((2 + 3) / 2 + 4) / 2)
    assert aggregate(per, m, "token_mean").item() == pytest.approx((2 + 3 + 4) / 3)
    for agg in ("seq_mean", "token_mean"):
        folded = (per * torch.tensor(fold_normaliser(mask, agg))).sum()
        assert folded.item() == pytest.approx(aggregate(per, m, agg).item())


def test_loss_config_validation():
    assert SDFTLoss().alpha == 0.5 and SDFTLoss(mode="sampled_token").alpha == 1.0
    assert SDFTLoss(mode="full_logits").needs_logits and not SDFTLoss(mode="sampled_token").needs_logits
    assert SDFTLoss(mode="sampled_token").tinker_builtin == "importance_sampling" and SDFTLoss().tinker_builtin is None
    for bad in (
        {"mode": "sampled_token", "alpha": 0.5},
        {"mode": "kl"},
        {"alpha": 1.5},
        {"topk": 0},
        {"topk_support": "both"},
        {"aggregation": "sum"},
        {"is_clip": 0.0},
    ):
        with pytest.raises(ValueError):
            SDFTLoss(**bad)


# --------------------------------------------------------------------------- trainer-level oracle
def _trl_stub(tmp_path, **cfg):
    """The real ``SDFTTrainer`` methods that align teacher/student logits and aggregate the
    loss, bound to a minimal object (building a whole trainer would generate completions)."""
    from trl.experimental.sdft import SDFTConfig, SDFTTrainer

    args = SDFTConfig(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=1,
        **cfg,
    )
    stub = SimpleNamespace(
        args=args,
        num_loss_tokens_to_skip=args.num_loss_tokens_to_skip,
        model_kwarg_keys=set(),
        temperature=1.0,
        accelerator=SimpleNamespace(gather=lambda x: x, wait_for_everyone=lambda: None),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _name="SDFT",
        state=SimpleNamespace(global_step=0),
        _last_loaded_step=0,
        _get_teacher_context_for_self_distillation=nullcontext,
    )
    for name in (
        "_forward_logits",
        "_compute_teacher_student_logits",
        "_compute_self_distillation_loss",
        "_compute_server_distillation_loss",
        "_log_self_distillation_metric",
    ):
        setattr(stub, name, getattr(SDFTTrainer, name).__get__(stub))
    return stub


TEMPLATE = "{demonstration} {prompt}"  # the tiny tokenizer has digits, '+', '=', ' '
PROMPTS = [("12+34=", "46"), ("50+7=", "57"), ("9+9=", "18"), ("3+40=", "43")]
COMPLETIONS = [[5, 6, 2], [9, 3, 13, 7, 2], [4, 4], [11, 12, 6, 8]]


@pytest.fixture(scope="module")
def trained_backend():
    """A tiny model with peaked distributions (a few SFT steps), so divergences are not ~0."""
    b = LocalBackend(model="tiny_llama", model_kwargs=SMALL, num_threads=1, threaded=False)
    tok = b.tokenizer
    rows = []
    for p, a in PROMPTS * 4:
        ids = tok(p + a)["input_ids"] + [tok.eos_token_id]
        n_prompt = len(tok(p)["input_ids"])
        rows.append(Datum(ids[:-1], ids[1:], [0.0] * (n_prompt - 1) + [0.1] * (len(ids) - n_prompt)))
    for _ in range(15):
        b.forward_backward(Batch(rows), CrossEntropyLoss()).result()
        b.optim_step(AdamParams(learning_rate=2e-2)).result()
    b.model.zero_grad(set_to_none=True)
    return b


def _equal_length_prompts(tok):
    """Student and teacher prompts padded (with spaces) to one length each: TRL left-pads
    prompts, which shifts positions; equal lengths keep both layouts identical."""
    student = [p for p, _ in PROMPTS]
    teacher = [teacher_prompt(TEMPLATE, p, d) for p, d in PROMPTS]
    ws, wt = max(map(len, student)), max(map(len, teacher))
    student = [" " * (ws - len(p)) + p for p in student]
    teacher = [" " * (wt - len(t)) + t for t in teacher]
    return [tok(p)["input_ids"] for p in student], [tok(t)["input_ids"] for t in teacher]


def _our_and_trl_inputs(backend, skip, off_policy=0.0):
    """Our stage's student/teacher batches and TRL's input dict for the same completions.
    ``off_policy`` shifts the sampler logprobs by +-off_policy (alternating), so that
    importance-ratio clipping has something to clip."""
    tok = backend.tokenizer
    s_ids, t_ids = _equal_length_prompts(tok)
    groups = [[Completion(prompt_tokens=p, tokens=c, logprobs=[0.0] * len(c))] for p, c in zip(s_ids, COMPLETIONS)]
    stage = SDFT(dataset=[{}], skip_first_tokens=skip, teacher_template=TEMPLATE)
    batch, teacher_batch, _ = stage.build_batches(t_ids, groups)
    for d, lp in zip(batch.data, backend.logprobs(batch).result()):  # on-policy sampler logprobs (+ shift)
        first = len(d.weights) - d.extra["completion_len"]
        d.sampler_logprobs = [x + off_policy * (-1) ** i if i >= first else 0.0 for i, x in enumerate(lp)]
    width = max(map(len, COMPLETIONS))
    pad = tok.pad_token_id
    completion_ids = torch.tensor([c + [pad] * (width - len(c)) for c in COMPLETIONS])
    completion_mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in COMPLETIONS])
    old = torch.tensor(
        [
            d.sampler_logprobs[-d.extra["completion_len"] :] + [0.0] * (width - d.extra["completion_len"])
            for d in batch.data
        ]
    )
    inputs = {
        "prompt_ids": torch.tensor(s_ids),
        "prompt_mask": torch.ones(len(s_ids), len(s_ids[0]), dtype=torch.long),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "teacher_input_ids": torch.cat([torch.tensor(t_ids), completion_ids], 1),
        "teacher_attention_mask": torch.cat(
            [torch.ones(len(t_ids), len(t_ids[0]), dtype=torch.long), completion_mask], 1
        ),
        "old_per_token_logps": old,
    }
    return stage, batch, teacher_batch, inputs


TRAINER_CASES = {
    "topk_jsd": ({"distillation_mode": "topk_logits", "distillation_topk": 5, "distillation_alpha": 0.5}, {}),
    "topk_tail_fwd": (
        {
            "distillation_mode": "topk_logits",
            "distillation_topk": 5,
            "distillation_alpha": 0.0,
            "distillation_add_tail": True,
        },
        {},
    ),
    "topk_teacher_support": (
        {"distillation_mode": "topk_logits", "distillation_topk": 5, "distillation_alpha": 0.3},
        {"topk_support": "teacher"},
    ),
    "full_rev": ({"distillation_mode": "full_logits", "distillation_alpha": 1.0}, {}),
    "full_jsd_clip": ({"distillation_mode": "full_logits", "distillation_alpha": 0.5, "distillation_is_clip": 2.0}, {}),
    "sampled_token": (
        {"distillation_mode": "sampled_token", "distillation_alpha": 1.0, "distillation_is_clip": None},
        {},
    ),
}


@pytest.mark.parametrize("skip", [0, 2])
@pytest.mark.parametrize("case", sorted(TRAINER_CASES))
def test_stage_batch_and_loss_match_trl_sdft_trainer(sdft_utils, tmp_path, trained_backend, case, skip):
    cfg, extra = TRAINER_CASES[case]
    cfg = {"distillation_is_clip": None, **cfg, "num_loss_tokens_to_skip": skip}
    backend = trained_backend
    loss = SDFTLoss(
        mode=cfg["distillation_mode"],
        alpha=cfg["distillation_alpha"],
        topk=cfg.get("distillation_topk") or 100,
        add_tail=cfg.get("distillation_add_tail", False),
        is_clip=cfg["distillation_is_clip"],
        **extra,
    )
    stage, batch, teacher_batch, inputs = _our_and_trl_inputs(
        backend, skip, 1.0 if cfg["distillation_is_clip"] else 0.0
    )
    stage.attach_teacher(backend, batch, teacher_batch, loss.teacher_input, loss.topk)  # teacher = the live policy
    if loss.mode == "sampled_token":
        norm = fold_normaliser([d.weights for d in batch.data], loss.aggregation)
        for d, n in zip(batch.data, norm):
            d.advantages = [-(q - t) * w for q, t, w in zip(d.sampler_logprobs, d.extra["teacher_token_logprobs"], n)]
    backend.model.zero_grad(set_to_none=True)
    ours = backend.forward_backward(batch, loss).result()
    our_grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    backend.model.zero_grad(set_to_none=True)

    model = copy.deepcopy(backend.model)
    model.train()
    stub = _trl_stub(tmp_path, **cfg)
    if extra.get("topk_support") == "teacher":  # TRL's server path: the teacher's own top-k support
        with torch.no_grad():
            t_logits = stub._forward_logits(
                model, inputs["teacher_input_ids"], inputs["teacher_attention_mask"], inputs["completion_ids"].size(1)
            )
        t_lp = torch.log_softmax(t_logits, -1)
        values, ids = t_lp.topk(5, -1)
        live = inputs["completion_mask"].bool()
        actual = t_lp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1)
        served = {
            "actual_logprobs": torch.where(live, actual, float("-inf")),
            "topk_logprobs": torch.where(live.unsqueeze(-1), values, float("-inf")),
            "topk_token_ids": torch.where(live.unsqueeze(-1), ids, 0),
        }
        stub._get_teacher_token_logprobs_from_server = lambda inputs, n: served
        trl_loss = stub._compute_server_distillation_loss(model, inputs)
    else:
        logits = stub._compute_teacher_student_logits(model, model, inputs)
        trl_loss = stub._compute_self_distillation_loss(model, inputs, logits)
    trl_loss.backward()
    trl_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grad_diff = max((our_grads[n] - trl_grads[n]).abs().max().item() for n in trl_grads)
    grad_scale = max(g.abs().max().item() for g in trl_grads.values())
    print(
        f"{case}/skip{skip}: loss {ours['loss']:.8f} vs TRL {trl_loss.item():.8f}, max |grad diff| {grad_diff:.1e} "
        f"(max |grad| {grad_scale:.1e})"
    )
    assert set(our_grads) == set(trl_grads)
    assert grad_scale > 1e-4  # a real signal, not two zeros
    assert grad_diff < 1e-5 * max(1.0, grad_scale)
    if loss.mode != "sampled_token":  # TRL's sampled-token *value* is a surrogate, not the KL
        assert ours["loss"] == pytest.approx(trl_loss.item(), abs=1e-5)
        assert ours["sdft/distill_loss"] == pytest.approx(
            stub._metrics["train"]["self_distillation/distillation_loss"][-1], abs=1e-5
        )


# --------------------------------------------------------------------------- backend additions
def test_to_tensors_pads_per_position_tensors_and_nested_lists():
    a = Datum([1, 2], [2, 3], [0.0, 1.0], extra={"topk": torch.ones(2, 3), "nested": [[1.0, 2.0], [3.0, 4.0]]})
    b = Datum(
        [1, 2, 3], [2, 3, 4], [0.0, 1.0, 1.0], extra={"topk": torch.full((3, 3), 2.0), "nested": [[5.0, 6.0]] * 3}
    )
    t = Batch([a, b]).to_tensors()
    assert t["topk"].shape == (2, 3, 3) and t["topk"][0, 2].tolist() == [0.0, 0.0, 0.0] and t["topk"][1, 2, 0] == 2.0
    assert t["nested"].shape == (2, 3, 2) and t["nested"][0].tolist() == [[1.0, 2.0], [3.0, 4.0], [0.0, 0.0]]
    ids = Batch([Datum([1], [2], [1.0], extra={"ids": torch.tensor([[4, 5]])})]).to_tensors()["ids"]
    assert ids.dtype == torch.long


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}], ids=["full", "lora"])
def test_snapshots_ema_distributions_and_checkpoints(tmp_path, lora):
    b = LocalBackend(model="tiny_llama", model_kwargs=SMALL, lora=lora, num_threads=1, threaded=False)
    tok = b.tokenizer
    ids = tok("12+34=46")["input_ids"]
    batch = Batch([Datum(ids[:-1], ids[1:], [1.0] * (len(ids) - 1))])
    step = lambda: (
        b.forward_backward(batch, CrossEntropyLoss()).result(),
        b.optim_step(AdamParams(learning_rate=3e-2)).result(),
    )
    lp0 = torch.tensor(b.logprobs(batch).result())
    b.snapshot("start").result()
    b.ema_update("ema", 0.5).result()  # starts as a copy
    step()
    lp1 = torch.tensor(b.logprobs(batch).result())
    assert (lp1 - lp0).abs().max() > 1e-2
    torch.testing.assert_close(torch.tensor(b.logprobs(batch, weights="start").result()), lp0, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.tensor(b.logprobs(batch).result()), lp1, atol=0, rtol=0)  # swapped back exactly
    b.ema_update("ema", 0.5).result()
    live = {n: p.detach().clone() for n, p in b._trainable_named}
    b.snapshot("now").result()
    with torch.no_grad():  # the EMA is the midpoint of the start and current weights
        for n, _p in b._trainable_named:
            torch.testing.assert_close(
                b._snapshots["ema"][n], 0.5 * b._snapshots["start"][n].float() + 0.5 * live[n].float()
            )
    dist = b.distributions(batch).result()[0]
    torch.testing.assert_close(
        dist.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1), lp1[0], atol=1e-6, rtol=0
    )
    values, _top = b.distributions(batch, weights="start", topk=3).result()[0]
    assert values.shape == (len(ids) - 1, 3) and (values[:, :-1] >= values[:, 1:]).all()
    ref = b.distributions(batch, reference=True).result()[0]
    torch.testing.assert_close(
        ref.gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1), lp0[0], atol=1e-6, rtol=0
    )
    with pytest.raises(KeyError, match="no weight snapshot"):
        b.logprobs(batch, weights="nope").result()
    with pytest.raises(ValueError, match="not both"):
        b.logprobs(batch, reference=True, weights="start").result()
    # checkpoints carry snapshots; a checkpoint without them clears them
    b.save(str(tmp_path / "ck"))
    b.drop_snapshot("start").result()
    assert b.snapshot_names() == ["ema", "now"]
    b.load(str(tmp_path / "ck"))
    assert b.snapshot_names() == ["ema", "now", "start"]
    torch.testing.assert_close(torch.tensor(b.logprobs(batch, weights="start").result()), lp0, atol=1e-6, rtol=0)
    fresh = LocalBackend(model="tiny_llama", model_kwargs=SMALL, lora=lora, num_threads=1, threaded=False)
    fresh.save(str(tmp_path / "none"))
    b.load(str(tmp_path / "none"))
    assert b.snapshot_names() == []


# --------------------------------------------------------------------------- the stage
def test_teacher_template_default_and_aliases():
    assert DEFAULT_TEACHER_TEMPLATE.startswith(
        "{prompt} This is an example for a response to the question: {demonstration}"
    )
    assert teacher_prompt("{question}|{demo}|{privileged_context}", "q", "d") == "q|d|d"


def _sdft_recipe(tmp_path, name, **stage):
    rows = [
        {"prompt": f"{a}+{b}=", "demonstration": str(a + b), "answer": str(a + b)} for a in range(10) for b in range(10)
    ]
    spec = {
        "name": "sdft",
        "dataset": rows,
        "steps": 2,
        "prompts_per_step": 4,
        "max_tokens": 4,
        "teacher_template": "{demonstration} {prompt}",
        "optimizer": {"learning_rate": 1e-2},
        **stage,
    }
    return tiny_recipe(tmp_path, name, spec, SMALL)


@pytest.mark.parametrize(
    "teacher, loss",
    [
        ("ema", {"name": "sdft", "mode": "topk_logits", "topk": 4}),
        ("base", {"name": "sdft", "mode": "full_logits", "alpha": 0.0}),
        ("stage_start", {"name": "sdft", "mode": "sampled_token"}),
        ("live", {"name": "sdft", "mode": "topk_logits", "topk": 4, "topk_support": "teacher", "add_tail": True}),
    ],
)
def test_stage_runs_with_every_teacher_and_mode(tmp_path, teacher, loss):
    res = _sdft_recipe(
        tmp_path, f"{teacher}_{loss['mode']}", teacher=teacher, loss=loss, skip_first_tokens=1, temperature=0.8
    ).run()
    rows = [r for r in res.history if "loss" in r]
    assert len(rows) == 2
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["sdft/reverse_kl_sampled"]) and r["grad_norm"] > 0


def test_demonstration_metrics_measure_what_the_teacher_knows_that_the_student_does_not(tmp_path):
    """``demonstration_metrics``: the demonstration's log-probability under the student and the
    teacher each step. A teacher that sees nothing more than the student (live weights, the
    template ``{prompt}``) scores it exactly as the student does; shown the demonstration
    (``{demonstration} {prompt}``) it is another number. Both are sums over the demonstration's
    tokens, so negative, and the first token's probability is in (0, 1)."""
    same = _sdft_recipe(tmp_path, "same", teacher="live", teacher_template="{prompt}", demonstration_metrics=True).run()
    shown = _sdft_recipe(tmp_path, "shown", teacher="base", demonstration_metrics=True).run()
    for result in (same, shown):
        rows = [r for r in result.history if "loss" in r]
        assert len(rows) == 2
        for r in rows:
            assert r["sdft/demo_logprob_student"] < 0 and r["sdft/demo_logprob_teacher"] < 0
            assert 0 < r["sdft/demo_first_prob_student"] < 1 and 0 < r["sdft/demo_first_prob_teacher"] < 1
    for r in (r for r in same.history if "loss" in r):
        assert r["sdft/demo_logprob_teacher"] == pytest.approx(r["sdft/demo_logprob_student"], abs=1e-6)
    first = next(r for r in shown.history if "loss" in r)
    # a random tiny model barely reads its context: measured 3.1e-4 apart, against exactly 0 above
    assert abs(first["sdft/demo_logprob_teacher"] - first["sdft/demo_logprob_student"]) > 1e-4
    assert not any("sdft/demo_logprob_student" in r for r in _sdft_recipe(tmp_path, "off").run().history)


def test_stage_config_errors(tmp_path):
    for bad, match in (
        ({"teacher": "frozen"}, r"stages\[0\].teacher"),
        ({"ema_rate": 0.0}, "ema_rate"),
        ({"teacher_template": "{prompt} {answer}"}, "teacher_template"),
        ({"demonstration_key": "demo"}, "demo"),
        ({"demonstration_placement": "system"}, r"stages\[0\].demonstration_placement"),
        ({"demonstration_placement": "earlier_turn", "renderer": "raw"}, "earlier_turn needs chat turns"),
    ):
        with pytest.raises((ValueError, KeyError), match=match):
            _sdft_recipe(tmp_path, "bad", **bad).run()


# --------------------------------------------------------------------------- multi-turn students


def test_sdft_distils_multi_turn_trajectories(tmp_path):
    """The same trajectories that feed RL feed SDFT: the student row is the episode's row (tool
    results inside at weight 0), the teacher row the demonstration-conditioned prompt followed
    by exactly the same tokens, and the stage trains through the environment sampler."""
    from tempering.plugins.backends.local.backend import LocalBackend

    kwargs = {
        "hidden_size": 32,
        "num_layers": 1,
        "num_heads": 2,
        "intermediate_size": 64,
        "chat": True,
        "max_position_embeddings": 256,
    }
    backend = LocalBackend(model="tiny_llama", model_kwargs=kwargs, seed=0, num_threads=1, threaded=False)
    rows = [{"prompt": f"what is {i}+{i}?", "demonstration": str(2 * i)} for i in range(4)]
    stage = {
        "name": "sdft",
        "dataset": rows,
        "steps": 2,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "max_tokens": 6,
        "teacher": "live",
        "loss": {"name": "sdft", "mode": "sampled_token"},
        "skip_first_tokens": 1,
        "sampler": {"name": "environment", "environment": TwoTurns, "max_turns": 2},
        "optimizer": {"learning_rate": 1e-2},
    }
    result = Recipe(name="s", output_dir=str(tmp_path), loggers=[], stages=[stage]).run(backend=backend)
    rows_logged = [h for h in result.history if "loss" in h]
    assert len(rows_logged) == 2 and all(math.isfinite(h["loss"]) for h in rows_logged)

    sdft = Recipe(name="s", output_dir=str(tmp_path / "b"), loggers=[], stages=[stage]).stages[0]
    from tempering.registry import get_registry

    built = get_registry().build("algorithm", sdft, "stages[0]")
    from tempering.training.recipe import RunContext

    ctx = RunContext(get_registry(), backend, {}, str(tmp_path / "b"), [], 0)
    built.setup(ctx, {})
    from tempering.rollouts.rollout import collect

    rollout = collect(
        built.student_sampler, backend, [built.student_example(r) for r in rows[:2]], 2, built.sampling_params()
    )
    samples = [s for g in rollout.groups for s in g.samples]
    assert all(len(s.trajectory.turns) == 2 for s in samples)
    pairs = [(built.teacher_prefix(backend, rows[i // 2], s), s) for i, s in enumerate(samples)]
    batch, teacher, info = built.build_pairs(pairs)
    # one student row per episode; rows after a split (a random turn that re-renders differently) are left out
    assert len(batch.data) == len(teacher.data) == 4
    assert info["sdft/rows_skipped"] == sum(len(s.segments()) - 1 for s in samples)
    renderer = built.student_sampler.context.renderer()
    tool_id = renderer.role_ids["tool"]
    assert any(len(s.segments()) == 1 and s.segments()[0].tokens.count(tool_id) == 1 for s in samples)
    for d, t in zip(batch.data, teacher.data):
        n = d.extra["completion_len"]
        assert d.target_tokens[-n:] == t.target_tokens[-n:]  # the same continuation
        assert "this is an example for a response" in renderer.decode(t.input_tokens[: len(t.input_tokens) - n + 1])
        tool_pos = [i for i in range(len(d.target_tokens)) if d.target_tokens[i] == renderer.role_ids["tool"]]
        assert all(d.weights[i] == 0.0 for i in tool_pos)  # a tool's answer inside a row is at weight 0
        assert sum(w > 0 for w in d.weights) == sum(w > 0 for w in t.weights[-n:]) - 1  # skip_first_tokens: 1
