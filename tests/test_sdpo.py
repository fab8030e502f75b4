"""SDPO against TRL 1.16's ``trl.experimental.sdpo``: the loss (every mode, IS clip on/off, the
blend with the policy loss, ragged and fully masked batches) against ``SDPOTrainer``'s own
``compute_loss`` / ``_compute_self_distillation_loss`` / ``_compute_policy_loss``; the teacher
context (solution choice, self-success rule, templates, truncation) against its
``SuccessfulRolloutTeacherContextBuilder`` and on token ids with the tiny and Qwen3 renderers;
the stage end to end on the local backend (YAML and Python recipes, multi-turn, feedback); and
the config errors, one line each, before anything trains."""

from __future__ import annotations

import copy
import math
import os
import string
from collections import defaultdict
from contextlib import nullcontext
from types import SimpleNamespace
from typing import Any

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from sdpo_blocks import sdpo_keys, term
from tiny_runs import TwoTurns, tiny_recipe

from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.algorithms.sdpo.context import (
    DEFAULT_FEEDBACK_TEMPLATE,
    DEFAULT_REPROMPT_TEMPLATE,
    DEFAULT_SOLUTION_TEMPLATE,
    RepromptRules,
    TeacherSignal,
    choose_signals,
    demonstration_text,
    reprompt_text,
    template_problem,
    truncate_prompt,
)
from tempering.algorithms.sdpo.distillation import SelfDistillation
from tempering.algorithms.sdpo.loss import SDPOLoss
from tempering.rlmath.advantages import GroupNormAdvantage
from tempering.training.recipe import Recipe
from tempering.training.rl import build_group_batch
from tempering.types import Completion, Group, Sample

#: A tiny Llama whose character vocabulary covers TRL's default templates.
CHARS = string.digits + string.ascii_letters + " +=:,.\n"
SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "chars": CHARS}


@pytest.fixture(scope="module")
def trl_sdpo():
    import trl
    from trl.experimental.sdpo import SDPOConfig, SDPOTrainer, sdpo_trainer

    assert trl.__version__.startswith("1.16"), trl.__version__
    return SimpleNamespace(Config=SDPOConfig, Trainer=SDPOTrainer, module=sdpo_trainer)


def trl_stub(trl_sdpo, tmp_path, logits: dict[str, torch.Tensor] | None = None, served: Any = None, **cfg: Any) -> Any:
    """The real ``SDPOTrainer`` loss methods bound to a minimal object (a whole trainer would
    load a model and generate). ``logits`` stands in for the forward passes: the student's and
    the teacher's logits over the completion positions."""
    args = trl_sdpo.Config(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=4,
        num_generations=2,
        **cfg,
    )
    stub = SimpleNamespace(
        args=args,
        epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high,
        loss_type=args.loss_type,
        importance_sampling_level=args.importance_sampling_level,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        model=SimpleNamespace(training=True),
        teacher_model=None,
        current_gradient_accumulation_steps=1,
        accelerator=SimpleNamespace(gather=lambda x: x),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _name="SDPO",
        use_teacher_server=served is not None,
        state=SimpleNamespace(global_step=0),
        _last_loaded_step=0,
        model_kwarg_keys=set(),
        _get_teacher_context_for_self_distillation=nullcontext,
    )
    for name in (
        "compute_loss",
        "_compute_policy_loss",
        "_compute_self_distillation_loss",
        "_forward_logits",
        "_compute_teacher_student_logits",
        "_compute_server_distillation_loss",
        "_log_self_distillation_metric",
    ):
        setattr(stub, name, getattr(trl_sdpo.Trainer, name).__get__(stub))
    if logits is not None:
        stub._forward_logits = lambda model, input_ids, attention_mask, logits_to_keep: logits["student"]
        stub._compute_teacher_student_logits = lambda model, teacher, inputs: trl_sdpo.module.DistillationLogits(
            inputs["completion_ids"],
            inputs["completion_mask"],
            inputs["completion_mask"] * inputs["self_distillation_mask"].unsqueeze(1),
            logits["student"],
            logits["teacher"],
        )
    if served is not None:
        stub._get_teacher_token_logprobs_from_server = lambda inputs, n: served
    return stub


# --------------------------------------------------------------------------- the loss vs TRL
B, T, V = 4, 5, 11
LENGTHS = [5, 3, 1, 4]  # ragged completions
SD_MASK = [1.0, 0.0, 1.0, 1.0]  # the second sample has no teacher signal


DTYPE = torch.float64  # the logit modes compute in float32 (as the backend does): the 1e-6 tolerance is theirs


def loss_inputs(seed: int, sd_mask: list[float], off_policy: float) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    student = (torch.randn(B, T, V, generator=g, dtype=DTYPE) * 2.0).requires_grad_(True)
    teacher = torch.randn(B, T, V, generator=g, dtype=DTYPE) * 2.0
    ids = torch.randint(0, V, (B, T), generator=g)
    cmask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in LENGTHS], dtype=DTYPE)
    adv = torch.randn(B, generator=g, dtype=DTYPE)
    with torch.no_grad():  # behaviour logprobs: the student's, shifted by +-off_policy
        lp = torch.log_softmax(student, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        old = lp + off_policy * torch.tensor([(-1.0) ** (i + j) for i in range(B) for j in range(T)]).view(B, T)
    return {
        "student": student,
        "teacher": teacher,
        "ids": ids,
        "cmask": cmask,
        "adv": adv,
        "old": old,
        "sd": torch.tensor(sd_mask, dtype=DTYPE),
    }


def ours(x: dict[str, torch.Tensor], with_old: bool, topk_teacher: int = 0, **loss: Any) -> Any:
    """Our SDPOLoss on the batch tensors a backend would hand it."""
    lp = torch.log_softmax(x["student"], -1).gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1)
    t_lp = torch.log_softmax(x["teacher"], -1)
    batch = {
        "weights": x["cmask"],
        "advantages": x["adv"].unsqueeze(-1).expand(B, T).contiguous(),
        "distill_weights": x["cmask"] * x["sd"].unsqueeze(-1),
        "logits": x["student"],
        "teacher_logits": t_lp,
        "teacher_token_logprobs": t_lp.gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1),
    }
    if topk_teacher:
        batch["teacher_topk_logprobs"], batch["teacher_topk_ids"] = t_lp.topk(topk_teacher, -1)
    if with_old:
        batch["sampler_logprobs"] = x["old"]
    return SDPOLoss(policy=GRPOLoss(), **loss)(lp, batch)


def trl_inputs(x: dict[str, torch.Tensor], with_old: bool) -> dict[str, torch.Tensor]:
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": x["ids"],
        "completion_mask": x["cmask"],
        "advantages": x["adv"],
        "self_distillation_mask": x["sd"],
    }
    if with_old:
        inputs["old_per_token_logps"] = x["old"]
    return inputs


LOSS_MODES = {
    "sampled_token": ({"distillation_mode": "sampled_token", "distillation_alpha": 1.0}, {"mode": "sampled_token"}),
    **{
        f"full_a{a}": (
            {"distillation_mode": "full_logits", "distillation_alpha": a},
            {"mode": "full_logits", "alpha": a},
        )
        for a in (0.0, 0.5, 1.0)
    },
    **{
        f"topk{'_tail' if tail else ''}_a{a}": (
            {
                "distillation_mode": "topk_logits",
                "distillation_topk": 4,
                "distillation_alpha": a,
                "distillation_add_tail": tail,
            },
            {"mode": "topk_logits", "topk": 4, "alpha": a, "add_tail": tail},
        )
        for a in (0.0, 0.5, 1.0)
        for tail in (False, True)
    },
}


@pytest.mark.parametrize("weight", [1.0, 0.5])
@pytest.mark.parametrize("is_clip", [2.0, None], ids=["clip", "noclip"])
@pytest.mark.parametrize("case", sorted(LOSS_MODES))
def test_loss_and_gradient_equal_trl(trl_sdpo, tmp_path, case, is_clip, weight):
    """Our loss and its gradient w.r.t. the student's logits equal TRL's ``compute_loss`` (which
    blends ``_compute_policy_loss`` and ``_compute_self_distillation_loss``) on a ragged batch
    with a sample without a teacher, off-policy by +-1 nat so the IS clip at 2 engages."""
    trl_cfg, our_cfg = LOSS_MODES[case]
    x = loss_inputs(0, SD_MASK, 1.0)
    out = ours(x, True, **our_cfg, is_clip=is_clip, weight=weight)
    out.loss.backward()
    our_grad = x["student"].grad.clone()
    x["student"].grad = None
    stub = trl_stub(
        trl_sdpo,
        tmp_path,
        {"student": x["student"], "teacher": x["teacher"]},
        **trl_cfg,
        distillation_is_clip=is_clip,
        distillation_weight=weight,
    )
    theirs = stub.compute_loss(stub.model, trl_inputs(x, True))
    theirs.backward()
    assert out.loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    torch.testing.assert_close(our_grad, x["student"].grad, atol=1e-6, rtol=0)
    assert our_grad.abs().max() > 1e-3  # a real signal
    assert (
        our_grad[1, : LENGTHS[1]].abs().max() > 0 if weight < 1 else our_grad[1].abs().max() == 0
    )  # no teacher: PG only
    assert our_grad[:, :, :][x["cmask"] == 0].abs().max() == 0  # padding never moves
    logged = stub._metrics["train"]
    assert out.metrics["sdpo/distill_loss"] == pytest.approx(
        logged["self_distillation/distillation_loss"][-1], abs=1e-6
    )
    if weight < 1:
        assert out.metrics["sdpo/policy_loss"] == pytest.approx(logged["self_distillation/policy_loss"][-1], abs=1e-6)
    if is_clip is not None:  # +-1 nat: every other masked token's ratio e > 2 is clipped
        on = (x["cmask"] * x["sd"].unsqueeze(-1)) > 0
        ratio = (torch.log_softmax(x["student"], -1).gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1) - x["old"]).exp()
        assert out.metrics["sdpo/is_clip_frac"] == pytest.approx(float((ratio[on] > 2.0).float().mean()), abs=1e-9)
        assert 0 < out.metrics["sdpo/is_clip_frac"] < 1


@pytest.mark.parametrize("case", ["sampled_token", "full_a0.5", "topk_tail_a0.0"])
def test_policy_only_and_on_policy_batches_equal_trl(trl_sdpo, tmp_path, case):
    """distillation_weight 0 is the policy loss alone (TRL's weight-0 branch); on-policy
    (old = current) without old logprobs the IS clip is 1 and both agree too."""
    trl_cfg, our_cfg = LOSS_MODES[case]
    for weight, with_old, off in ((0.0, True, 1.0), (1.0, False, 0.0), (0.5, False, 0.0)):
        x = loss_inputs(1, SD_MASK, off)
        out = ours(x, with_old, **our_cfg, weight=weight)
        out.loss.backward()
        our_grad = x["student"].grad.clone()
        x["student"].grad = None
        stub = trl_stub(
            trl_sdpo,
            tmp_path,
            {"student": x["student"], "teacher": x["teacher"]},
            **trl_cfg,
            distillation_weight=weight,
        )
        theirs = stub.compute_loss(stub.model, trl_inputs(x, with_old))
        theirs.backward()
        assert out.loss.item() == pytest.approx(theirs.item(), abs=1e-6), (weight, with_old)
        torch.testing.assert_close(our_grad, x["student"].grad, atol=1e-6, rtol=0)
        assert ("sdpo/distill_loss" in out.metrics) == (weight > 0)


@pytest.mark.parametrize("case", sorted(LOSS_MODES))
def test_fully_masked_batch_is_a_zero_distillation_loss(trl_sdpo, tmp_path, case):
    """No sample has a teacher: TRL returns ``0 * logits.sum()``; so do we (no NaN), and a
    blended loss is then (1 - w) x the policy loss exactly."""
    trl_cfg, our_cfg = LOSS_MODES[case]
    x = loss_inputs(2, [0.0] * B, 1.0)
    out = ours(x, True, **our_cfg)
    out.loss.backward()
    assert out.loss.item() == 0.0 and x["student"].grad.abs().max() == 0
    x["student"].grad = None
    stub = trl_stub(trl_sdpo, tmp_path, {"student": x["student"], "teacher": x["teacher"]}, **trl_cfg)
    assert stub.compute_loss(stub.model, trl_inputs(x, True)).item() == 0.0
    blended = ours(x, True, **our_cfg, weight=0.25)
    policy = GRPOLoss()(
        torch.log_softmax(x["student"], -1).gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1),
        {"weights": x["cmask"], "advantages": x["adv"].unsqueeze(-1).expand(B, T), "sampler_logprobs": x["old"]},
    )
    assert blended.loss.item() == pytest.approx(0.75 * policy.loss.item(), abs=1e-7)


@pytest.mark.parametrize("case", sorted(LOSS_MODES))
def test_nan_sampler_logprobs_at_masked_positions_change_nothing(case):
    """Masked positions may hold anything (rlmath's convention): NaN (or inf) sampler logprobs
    at padding give the same loss and the same finite gradients (torch.autograd) as zeros
    there -- the IS weight is selected at masked positions, not multiplied in."""
    _, our_cfg = LOSS_MODES[case]
    x = loss_inputs(3, SD_MASK, 0.5)
    out = ours(x, True, **our_cfg, weight=1.0)
    (clean,) = torch.autograd.grad(out.loss, x["student"])
    pad = x["cmask"] == 0
    assert pad.any()
    for junk in (float("nan"), float("inf")):
        x["old"] = torch.where(pad, torch.full_like(x["old"], junk), x["old"])
        dirty = ours(x, True, **our_cfg, weight=1.0)
        (grad,) = torch.autograd.grad(dirty.loss, x["student"])
        assert torch.isfinite(grad).all(), junk
        torch.testing.assert_close(grad, clean, atol=0, rtol=0)
        assert dirty.loss.item() == out.loss.item()


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0])
def test_topk_on_the_teachers_support_equals_trls_server_path(trl_sdpo, tmp_path, alpha, tail):
    """``distillation_topk_support: teacher`` (what a service such as Tinker can return) is TRL's
    teacher-server path: the student projected onto the teacher's own top-k."""
    x = loss_inputs(3, SD_MASK, 1.0)
    out = ours(x, True, topk_teacher=4, mode="topk_logits", topk=4, topk_support="teacher", alpha=alpha, add_tail=tail)
    out.loss.backward()
    our_grad = x["student"].grad.clone()
    x["student"].grad = None
    t_lp = torch.log_softmax(x["teacher"], -1)
    values, ids = t_lp.topk(4, -1)
    live = x["cmask"].bool()
    served = {
        "actual_logprobs": torch.where(live, t_lp.gather(-1, x["ids"].unsqueeze(-1)).squeeze(-1), float("-inf")),
        "topk_logprobs": torch.where(live.unsqueeze(-1), values, float("-inf")),
        "topk_token_ids": torch.where(live.unsqueeze(-1), ids, 0),
    }
    stub = trl_stub(
        trl_sdpo,
        tmp_path,
        {"student": x["student"], "teacher": x["teacher"]},
        served,
        distillation_mode="topk_logits",
        distillation_topk=4,
        distillation_alpha=alpha,
        distillation_add_tail=tail,
    )
    theirs = stub.compute_loss(stub.model, trl_inputs(x, True))
    theirs.backward()
    assert out.loss.item() == pytest.approx(theirs.item(), abs=1e-6)
    torch.testing.assert_close(our_grad, x["student"].grad, atol=1e-6, rtol=0)


def test_loss_config_is_checked():
    for bad, match in (
        ({"mode": "kl"}, "unknown mode 'kl'"),
        ({"mode": "full_logits", "alpha": 1.5}, r"\[0, 1\]"),
        ({"alpha": 0.5}, "must be 1 with mode 'sampled_token'"),
        ({"mode": "topk_logits"}, "needs topk"),
        ({"topk": 4}, "only read by"),
        ({"is_clip": 0.0}, "> 0"),
        ({"weight": 1.5}, r"\[0, 1\]"),
        ({"weight": 0.5}, "policy="),
    ):
        with pytest.raises(ValueError, match=match):
            SDPOLoss(**bad)
    assert SDPOLoss().teacher_input == "token" and not SDPOLoss().needs_logits
    assert SDPOLoss(mode="topk_logits", topk=3, topk_support="teacher").teacher_input == "topk"
    assert SDPOLoss(mode="full_logits", alpha=0.0).needs_logits and SDPOLoss(mode="full_logits").teacher_input == "full"
    assert SDPOLoss(policy=GRPOLoss(), weight=0.0).teacher_input is None


# --------------------------------------------------------------------------- the teacher context
RULES = RepromptRules()


def test_solution_choice_and_the_self_success_rule():
    """The first successful sibling is the solution; a sample is never its own (a lone success
    gets none); below the threshold or ineligible (failed) samples are nobody's solution."""
    rewards = [0.0, 1.0, 0.5, 1.0]
    assert [s.solution for s in choose_signals(rewards, [None] * 4, RULES)] == [1, 3, 1, 1]
    assert [s.solution for s in choose_signals([0.0, 1.0, 0.0], [None] * 3, RULES)] == [1, None, 1]
    own = RepromptRules(dont_reprompt_on_self_success=False)
    assert [s.solution for s in choose_signals([0.0, 1.0, 0.0], [None] * 3, own)] == [1, 1, 1]
    low = RepromptRules(success_reward_threshold=0.5)
    assert [s.solution for s in choose_signals(rewards, [None] * 4, low)] == [1, 2, 1, 1]
    assert [s.solution for s in choose_signals(rewards, [None] * 4, RULES, [True, False, True, True])] == [
        3,
        3,
        3,
        None,
    ]
    assert [s.solution for s in choose_signals([0.0, float("nan")], [None] * 2, RULES)] == [None, None]
    off = RepromptRules(use_successful_as_teacher=False)
    assert not any(s.active for s in choose_signals(rewards, [None] * 4, off))


def test_feedback_rules():
    fb = ["expected 5, got 6", "  ", None, "wrong"]
    rewards = [0.0, 0.0, 1.0, 0.0]
    assert choose_signals(rewards, fb, RULES) == [
        TeacherSignal(2, "expected 5, got 6"),
        TeacherSignal(2, None),
        TeacherSignal(None, None),
        TeacherSignal(2, "wrong"),
    ]
    only = RepromptRules(environment_feedback_only_without_solution=True)
    assert [s.feedback for s in choose_signals([0.0, 0.0], ["a", "b"], only)] == ["a", "b"]
    assert [s.feedback for s in choose_signals([1.0, 0.0, 1.0], ["a", "b", "c"], only)] == [None, None, None]
    assert [s.feedback for s in choose_signals([1.0, 0.0], ["a", "b"], only)] == [
        "a",
        None,
    ]  # a lone success: no solution
    none = RepromptRules(include_environment_feedback=False)
    assert [s.feedback for s in choose_signals([0.0, 0.0], ["a", "b"], none)] == [None, None]


def test_templates_text_and_truncation():
    text = reprompt_text(
        DEFAULT_REPROMPT_TEMPLATE, DEFAULT_SOLUTION_TEMPLATE, DEFAULT_FEEDBACK_TEMPLATE, "2+3=", "5", "got 6"
    )
    assert text == (
        "2+3=\nCorrect solution:\n\n5\n\n\nThe following is feedback from your unsuccessful earlier "
        "attempt:\n\ngot 6\n\n\n\nCorrectly solve the original question.\n"
    )
    assert (
        reprompt_text(
            "{prompt}|{solution}|{feedback}", "S{successful_previous_attempt}", "F{feedback_raw}", "p", None, "{x}"
        )
        == "p||F{x}"
    )
    assert template_problem("{solution}{feedback}", ["prompt", "solution"], ["prompt", "solution", "feedback"]) == (
        "has no {prompt} placeholder, so the teacher would never see it"
    )
    assert "unknown placeholder {answer}" in template_problem("{prompt}{answer}", ["prompt"], ["prompt"])
    assert "not a format template" in template_problem("{prompt", ["prompt"], ["prompt"])
    assert template_problem("{{literal}} {prompt}", ["prompt"], ["prompt"]) is None
    assert truncate_prompt([1, 2, 3, 4, 5], 3) == ([3, 4, 5], True) and truncate_prompt([1, 2], 3) == ([1, 2], False)


def test_demonstration_text_single_and_multi_turn():
    from tempering.plugins.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer("0123456789abcdefghijklmnopqrstuvwxyz<>/ ")
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]
    single = Sample({}, Completion([], enc("<think>hm</think> 12") + [tok.eos_token_id], [0.0] * 21))
    assert demonstration_text(tok, single) == "<think>hm</think> 12"
    assert demonstration_text(tok, single, remove_thinking=True) == "12"
    turns = [
        SimpleNamespace(completion=Completion([], enc("call add"), []), observation=[{"role": "tool", "content": "5"}]),
        SimpleNamespace(completion=Completion([], enc("it is 5"), []), observation=[]),
    ]
    multi = Sample({}, turns[-1].completion, trajectory=SimpleNamespace(turns=turns))
    assert demonstration_text(tok, multi) == "call add\n5\nit is 5"


# --------------------------------------------------------------------------- teacher rows vs TRL's builder
PROMPTS = ["12+34=", "5+7="]
#: Completions (char ids of the tiny tokenizer + EOS), rewards and feedback, group by group.
ANSWERS = [["4", "46", "40", "46 "], ["12", "13", "1", "21"]]
REWARDS = [[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]]
FEEDBACK = [[None, None, "too short", None], [None, "expected 12, got 13", "expected 12, got 1", None]]


def sdpo_groups(tok: Any, off_policy: float = 0.0) -> list[Group]:
    groups = []
    for gi, (prompt, answers) in enumerate(zip(PROMPTS, ANSWERS)):
        p_ids = tok(prompt)["input_ids"]
        samples = []
        for i, a in enumerate(answers):
            c = tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            samples.append(
                Sample(
                    {"prompt": prompt},
                    Completion(p_ids, c, [0.0] * len(c), "stop"),
                    REWARDS[gi][i],
                    feedback=FEEDBACK[gi][i],
                )
            )
        groups.append(Group({"prompt": prompt}, samples, group_id=gi))
    return groups


def raw_context() -> Any:
    return SimpleNamespace(chat_prompts=False, renderer=None)


def trl_builder(trl_sdpo, tmp_path, tok: Any, tokenize: Any = None, **cfg: Any) -> Any:
    """TRL's ``SuccessfulRolloutTeacherContextBuilder`` on a one-process stub trainer; text
    prompts are tokenized by TRL's own ``_tokenize_prompts_untruncated``."""
    args = trl_sdpo.Config(
        output_dir=str(tmp_path / "trl"),
        bf16=False,
        use_cpu=True,
        report_to="none",
        per_device_train_batch_size=8,
        num_generations=4,
        **cfg,
    )
    trainer = SimpleNamespace(
        args=args,
        model=SimpleNamespace(training=True),
        num_generations=4,
        _tokenizer=tok,
        processing_class=tok,
        accelerator=SimpleNamespace(
            device="cpu", process_index=0, gather=lambda x: x, pad_across_processes=lambda t, dim, pad_index: t
        ),
    )
    trainer._tokenize_prompts_untruncated = tokenize or trl_sdpo.Trainer._tokenize_prompts_untruncated.__get__(trainer)
    return trl_sdpo.module.SuccessfulRolloutTeacherContextBuilder(trainer)


def trl_teacher_prompts(
    builder: Any, groups: list[Group], prompts: list[Any], pad: int
) -> tuple[list[list[int]], list[float]]:
    """Each sample's teacher prompt ids (left padding removed) and TRL's distillation mask."""
    comps = [s.completion.tokens for g in groups for s in g.samples]
    width = max(map(len, comps))
    ids = torch.tensor([c + [pad] * (width - len(c)) for c in comps])
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in comps])
    rewards = torch.tensor([s.reward for g in groups for s in g.samples])
    out = builder.build(
        {"completion_ids": ids, "completion_mask": mask},
        prompts,
        rewards,
        [s.feedback for g in groups for s in g.samples],
    )
    pw = out["teacher_input_ids"].shape[1] - width
    rows = [r[:pw][m[:pw] == 1].tolist() for r, m in zip(out["teacher_input_ids"], out["teacher_attention_mask"])]
    return rows, out["self_distillation_mask"].tolist()


def our_teacher_prompts(
    distiller: SelfDistillation, tok: Any, groups: list[Group], context: Any
) -> tuple[list[list[int] | None], list[float], Any]:
    batch, _ = build_group_batch(groups, GroupNormAdvantage())
    rows = distiller.build_teachers(tok, batch, groups, context)
    prefixes: list[list[int] | None] = []
    taught = iter(rows.teacher)
    for d in batch.data:
        if any(d.extra["distill_weights"]):
            t = next(taught)
            full = [*t.input_tokens, t.target_tokens[-1]]
            prefixes.append(full[: len(full) - d.extra["completion_len"]])
        else:
            prefixes.append(None)
    return prefixes, [float(any(d.extra["distill_weights"])) for d in batch.data], rows


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"max_reprompt_len": 9},
        {"dont_reprompt_on_self_success": False, "remove_thinking_from_demonstration": True},
        {"environment_feedback_only_without_solution": True, "success_reward_threshold": 0.5},
        {"include_environment_feedback": False},
        {"use_successful_as_teacher": False},
    ],
    ids=["defaults", "truncated", "own_success", "feedback_only_without_solution", "no_feedback", "feedback_only"],
)
def test_teacher_prompts_equal_trls_context_builder(trl_sdpo, tmp_path, cfg):
    """The same rollouts through TRL's builder and ours give the same teacher prompt token ids
    and the same distillation mask (raw text prompts, TRL's default templates)."""
    from tempering.plugins.models.tiny import build_char_tokenizer

    tok = build_char_tokenizer(CHARS)
    groups = sdpo_groups(tok)
    trl_cfg = {"include_environment_feedback": True, **cfg}
    ours_cfg = {k: v for k, v in cfg.items()}
    distiller = term(
        reprompt_template=DEFAULT_REPROMPT_TEMPLATE
        if cfg.get("use_successful_as_teacher", True)
        else "{prompt}{feedback}",
        **ours_cfg,
    )
    builder = trl_builder(
        trl_sdpo,
        tmp_path,
        tok,
        **trl_cfg,
        **({"reprompt_template": distiller.rules.reprompt_template} if "use_successful_as_teacher" in cfg else {}),
    )
    theirs, their_mask = trl_teacher_prompts(
        builder, groups, [g.example["prompt"] for g in groups for _ in g.samples], tok.pad_token_id
    )
    prefixes, mask, rows = our_teacher_prompts(distiller, tok, groups, raw_context())
    assert mask == their_mask
    assert [p for p, m in zip(prefixes, mask) if m] == [t for t, m in zip(theirs, their_mask) if m]
    assert sum(mask) > 0
    if cfg == {}:  # the rules, spelled out: group 0: solutions 1, 3, 1, 1; group 1: a lone success has nothing
        assert mask == [1, 1, 1, 1, 0, 1, 1, 1]
        assert tok.decode(prefixes[5], skip_special_tokens=True) == reprompt_text(
            DEFAULT_REPROMPT_TEMPLATE,
            DEFAULT_SOLUTION_TEMPLATE,
            DEFAULT_FEEDBACK_TEMPLATE,
            "5+7=",
            "12",
            "expected 12, got 13",
        )
        assert (
            prefixes[0]
            == tok(
                reprompt_text(
                    DEFAULT_REPROMPT_TEMPLATE,
                    DEFAULT_SOLUTION_TEMPLATE,
                    DEFAULT_FEEDBACK_TEMPLATE,
                    "12+34=",
                    "46",
                    None,
                )
            )["input_ids"]
        )
        assert rows.metrics["sdpo/signal_frac"] == 7 / 8 and rows.metrics["sdpo/solution_frac"] == 7 / 8
        assert rows.metrics["sdpo/feedback_frac"] == 3 / 8 and rows.metrics["sdpo/no_signal_samples"] == 1.0
        assert rows.metrics["sdpo/success_group_frac"] == 1.0
    if cfg.get("max_reprompt_len"):
        assert (
            all(len(p) == 9 for p in prefixes if p is not None) and rows.metrics["sdpo/reprompt_truncated_frac"] == 1.0
        )


#: Lower-case templates: the tiny chat model's characters have no capitals.
TINY_TEMPLATES = {
    "reprompt_template": "{prompt}{solution}{feedback}\nsolve it again.",
    "solution_template": "\nright answer: {successful_previous_attempt}",
    "feedback_template": "\nfeedback: {feedback_raw}",
}


def chat_setup(name: str) -> tuple[Any, Any, dict[str, str]]:
    from tempering.registry import get_registry

    if name == "qwen3_instruct":
        from tempering.plugins.models.qwen3 import qwen3_tokenizer

        tok, templates = qwen3_tokenizer(), {}
    else:
        from tempering.plugins.models.tiny import CHAT_CHARS, CHAT_TOKENS, build_char_tokenizer

        tok, templates = build_char_tokenizer(CHAT_CHARS, extra_special=CHAT_TOKENS), TINY_TEMPLATES
    return tok, get_registry().build("renderer", {"name": name}, "renderer", tokenizer=tok), templates


@pytest.mark.parametrize("system", [False, True], ids=["prompt", "messages_with_system"])
@pytest.mark.parametrize("name", ["tiny_chat", "qwen3_instruct"])
def test_teacher_prompts_in_chat_formats(trl_sdpo, tmp_path, name, system):
    """A chat student's teacher sees the re-prompt as its last user turn, rendered by the same
    renderer (system message kept): token ids equal to the renderer's rendering of TRL's
    teacher messages, and, for Qwen3, the exact chat text."""
    tok, renderer, templates = chat_setup(name)
    user = "what is 12+34?"
    head = [{"role": "system", "content": "be brief."}] if system else []
    messages = [*head, {"role": "user", "content": user}]
    example = {"messages": messages} if system else {"prompt": user}
    p_ids = renderer.render_prompt(messages).tokens
    answers, rewards, feedback = (
        ["46", "45", "46", "4"],
        [1.0, 0.0, 1.0, 0.0],
        [None, "expected 46, got 45", None, None],
    )
    comps = [tok(a, add_special_tokens=False)["input_ids"] + renderer.stop() for a in answers]
    samples = [
        Sample(dict(example), Completion(p_ids, c, [0.0] * len(c), "stop"), r, feedback=f)
        for c, r, f in zip(comps, rewards, feedback)
    ]
    groups = [Group(dict(example), samples)]
    distiller = term(**templates)
    context = SimpleNamespace(chat_prompts=True, renderer=lambda: renderer)
    prefixes, mask, _ = our_teacher_prompts(distiller, tok, groups, context)
    builder = trl_builder(
        trl_sdpo,
        tmp_path,
        tok,
        lambda prompts: [renderer.render_prompt(p).tokens for p in prompts],
        include_environment_feedback=True,
        **templates,
    )
    theirs, their_mask = trl_teacher_prompts(builder, groups, [messages] * 4, tok.pad_token_id or 0)
    assert mask == their_mask == [1.0, 1.0, 1.0, 1.0]
    assert prefixes == theirs
    text = reprompt_text(
        distiller.rules.reprompt_template,
        distiller.rules.solution_template,
        distiller.rules.feedback_template,
        user,
        "46",
        "expected 46, got 45",
    )
    assert prefixes[1] == renderer.render_prompt([*head, {"role": "user", "content": text}]).tokens
    if name == "qwen3_instruct":
        sys_part = "<|im_start|>system\nbe brief.<|im_end|>\n" if system else ""
        assert tok.decode(prefixes[1]) == (
            f"{sys_part}<|im_start|>user\nwhat is 12+34?\nCorrect solution:\n\n46\n\n\nThe "
            "following is feedback from your unsuccessful earlier attempt:\n\nexpected 46, got 45"
            "\n\n\n\nCorrectly solve the original question.\n<|im_end|>\n<|im_start|>assistant\n"
        )
        assert prefixes[1][-3:] == [151644, 77091, 198] and prefixes[1].count(151644) == 2 + system
    else:
        assert renderer.decode(prefixes[0]).endswith("what is 12+34?\nright answer: 46\nsolve it again.<|assistant|>")


# --------------------------------------------------------------------------- the stage's batch vs TRL's trainer
@pytest.fixture(scope="module")
def trained_backend():
    """A tiny model with peaked distributions (a few SFT steps on sums and TRL's reprompt
    text), so the teacher's context changes its predictions and divergences are not ~0."""
    from tempering.algorithms.sft.loss import CrossEntropyLoss
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.types import AdamParams, Batch, Datum

    b = LocalBackend(model="tiny_llama", model_kwargs=SMALL, num_threads=1, threaded=False)
    tok = b.tokenizer
    texts = [
        reprompt_text(DEFAULT_REPROMPT_TEMPLATE, DEFAULT_SOLUTION_TEMPLATE, DEFAULT_FEEDBACK_TEMPLATE, p, a, None) + a
        for p, a in (("12+34=", "46"), ("5+7=", "12"), ("9+9=", "18"))
    ] + ["12+34=46", "5+7=12", "9+9=18"]
    rows = []
    for text in texts:
        ids = tok(text)["input_ids"] + [tok.eos_token_id]
        rows.append(Datum(ids[:-1], ids[1:], [1.0 / len(ids)] * (len(ids) - 1)))
    for _ in range(12):
        b.forward_backward(Batch(rows), CrossEntropyLoss()).result()
        b.optim_step(AdamParams(learning_rate=2e-2)).result()
    b.model.zero_grad(set_to_none=True)
    return b


STAGE_CASES = {
    "sampled_token_clip": ({"distillation_mode": "sampled_token"}, {}),
    "full_jsd_clip": ({"distillation_mode": "full_logits", "distillation_alpha": 0.5}, {}),
    "topk_tail_fwd": (
        {
            "distillation_mode": "topk_logits",
            "distillation_topk": 5,
            "distillation_alpha": 0.0,
            "distillation_add_tail": True,
            "distillation_is_clip": None,
        },
        {},
    ),
    "topk_teacher_support": (
        {"distillation_mode": "topk_logits", "distillation_topk": 5, "distillation_alpha": 1.0},
        {"distillation_topk_support": "teacher"},
    ),
}


@pytest.mark.parametrize("case", sorted(STAGE_CASES))
def test_stage_teachers_and_loss_equal_trls_trainer(trl_sdpo, tmp_path, trained_backend, case):
    """The stage's teacher rows, scored on the local backend and trained through its
    forward_backward, give TRL's ``SDPOTrainer`` loss and gradients on the same model: TRL's
    builder makes the teacher prompts, its ``_compute_teacher_student_logits`` and
    ``_compute_self_distillation_loss`` (or the teacher-server path) run per row -- unpadded,
    as our rows are -- and the seq-mean over the batch is the mean of the rows' losses."""
    cfg, extra = STAGE_CASES[case]
    backend = trained_backend
    tok = backend.tokenizer
    groups = sdpo_groups(tok)
    batch, _ = build_group_batch(groups, GroupNormAdvantage())
    for d, lp in zip(batch.data, backend.logprobs(batch).result()):  # behaviour logprobs: +-1 nat off-policy
        d.sampler_logprobs = [x + (-1.0) ** i if w else 0.0 for i, (x, w) in enumerate(zip(lp, d.weights))]
    distiller = term(teacher="live", **cfg, **extra)
    metrics = distiller.attach_teachers(backend, batch, groups, raw_context())
    config = distiller.config
    loss = SDPOLoss(
        policy=GRPOLoss(),
        mode=config.mode,
        alpha=config.alpha,
        topk=config.topk,
        topk_support=config.topk_support,
        add_tail=config.add_tail,
        is_clip=config.is_clip,
    )
    backend.model.zero_grad(set_to_none=True)
    ours = backend.forward_backward(batch, loss).result()
    our_grads = {n: p.grad.clone() for n, p in backend.model.named_parameters() if p.grad is not None}
    backend.model.zero_grad(set_to_none=True)
    assert metrics["sdpo/signal_frac"] == 7 / 8

    trl_cfg = {"distillation_is_clip": 2.0, **cfg, "include_environment_feedback": True}
    builder = trl_builder(trl_sdpo, tmp_path, tok, include_environment_feedback=True)
    teacher_prompts, sd_mask = trl_teacher_prompts(
        builder, groups, [g.example["prompt"] for g in groups for _ in g.samples], 0
    )
    model = copy.deepcopy(backend.model)
    model.train()
    server = extra.get("distillation_topk_support") == "teacher"
    stub = trl_stub(trl_sdpo, tmp_path, served={} if server else None, **trl_cfg)
    total = 0.0
    samples = [s for g in groups for s in g.samples]
    for s, d, t_prompt, sd in zip(samples, batch.data, teacher_prompts, sd_mask):
        c = s.completion.tokens
        one = lambda ids: torch.tensor([ids])
        inputs = {
            "prompt_ids": one(s.completion.prompt_tokens),
            "prompt_mask": torch.ones(1, len(s.completion.prompt_tokens), dtype=torch.long),
            "completion_ids": one(c),
            "completion_mask": torch.ones(1, len(c), dtype=torch.long),
            "teacher_input_ids": one(t_prompt + c),
            "teacher_attention_mask": torch.ones(1, len(t_prompt) + len(c), dtype=torch.long),
            "self_distillation_mask": torch.tensor([sd]),
            "old_per_token_logps": torch.tensor([d.sampler_logprobs[-len(c) :]]),
        }
        if server:
            with torch.no_grad():
                t_lp = torch.log_softmax(
                    stub._forward_logits(model, inputs["teacher_input_ids"], inputs["teacher_attention_mask"], len(c)),
                    -1,
                )
            values, ids = t_lp.topk(5, -1)
            stub._get_teacher_token_logprobs_from_server = lambda inputs, n, t_lp=t_lp, values=values, ids=ids: {
                "actual_logprobs": t_lp.gather(-1, inputs["completion_ids"].unsqueeze(-1)).squeeze(-1),
                "topk_logprobs": values,
                "topk_token_ids": ids,
            }
            row_loss = stub._compute_server_distillation_loss(model, inputs)
        else:
            logits = stub._compute_teacher_student_logits(model, model, inputs)
            row_loss = stub._compute_self_distillation_loss(model, inputs, logits)
        (row_loss / len(samples)).backward()
        total += row_loss.item() / len(samples)
    trl_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grad_diff = max((our_grads[n] - trl_grads[n]).abs().max().item() for n in trl_grads)
    grad_scale = max(g.abs().max().item() for g in trl_grads.values())
    print(
        f"{case}: loss {ours['loss']:.8f} vs TRL {total:.8f}, "
        f"max |grad diff| {grad_diff:.1e} (max |grad| {grad_scale:.1e})"
    )
    assert set(our_grads) == set(trl_grads)
    assert grad_scale > 1e-3  # a real signal
    assert ours["loss"] == pytest.approx(total, abs=1e-6)
    assert grad_diff < 1e-6 * max(1.0, grad_scale)


# --------------------------------------------------------------------------- the stage end to end
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "sdpo", "recipe.yaml")
TINY_YAML = "{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}"


def sdpo_rows(result: Any) -> list[dict[str, Any]]:
    return [h for h in result.history if "sdpo/signal_frac" in h]


def test_the_yaml_recipe_runs(tmp_path):
    """examples/sdpo/recipe.yaml, shortened: the SFT warmup, then SDPO with its digit-only
    templates. Every reward clears a threshold of 0, so every sample is shown a sibling."""
    overrides = [
        f"output_dir={tmp_path}",
        "loggers=[]",
        f"backend.model_kwargs={TINY_YAML}",
        "stages.warmup.steps=2",
        "stages.warmup.eval.dataset=null",
        "stages.rl.eval.dataset=null",
        "stages.rl.steps=2",
        "stages.rl.prompts_per_step=2",
        "stages.rl.group_size=3",
        "stages.rl.reprompt.success_reward_threshold=0.0",
    ]
    result = Recipe.from_yaml(EXAMPLE, overrides).run()
    rows = sdpo_rows(result)
    assert len(rows) == 2
    for r in rows:
        assert r["sdpo/signal_frac"] == 1.0 and r["sdpo/solution_frac"] == 1.0 and r["sdpo/no_signal_samples"] == 0.0
        assert r["sdpo/distill_loss"] != 0.0 and math.isfinite(r["sdpo/teacher_kl"]) and r["grad_norm"] > 0
        assert "sdpo/policy_loss" in r  # distillation_weight 0.5: both parts


def digit_reward(completion: str, example: dict) -> float:
    """1 for a completion that starts with a digit (an untrained tiny model does, now and then)."""
    return 1.0 if completion[:1].isdigit() else 0.0


def sdpo_recipe(tmp_path: Any, name: str, **stage: Any) -> Recipe:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    spec = {
        "name": "sdpo",
        "dataset": rows,
        "reward": digit_reward,
        "steps": 2,
        "prompts_per_step": 4,
        "group_size": 4,
        "max_tokens": 3,
        "optimizer": {"learning_rate": 1e-2},
        **sdpo_keys(**stage),
    }
    return tiny_recipe(tmp_path, name, spec, SMALL)


@pytest.mark.parametrize(
    "teacher, mode",
    [
        ("ema", {"distillation_mode": "sampled_token"}),
        ("base", {"distillation_mode": "full_logits", "distillation_alpha": 0.0, "distillation_weight": 0.5}),
        ("stage_start", {"distillation_mode": "topk_logits", "distillation_topk": 4, "distillation_add_tail": True}),
        (
            "live",
            {
                "distillation_mode": "topk_logits",
                "distillation_topk": 4,
                "distillation_topk_support": "teacher",
                "distillation_alpha": 0.5,
            },
        ),
    ],
)
def test_python_recipe_runs_every_teacher_and_mode(tmp_path, teacher, mode):
    result = sdpo_recipe(
        tmp_path, f"{teacher}_{mode['distillation_mode']}", teacher=teacher, temperature=0.9, **mode
    ).run()
    rows = sdpo_rows(result)
    assert len(rows) == 2 and any(r["sdpo/signal_frac"] > 0 for r in rows)
    for r in rows:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert r["sdpo/no_signal_samples"] == round(16 * (1 - r["sdpo/signal_frac"]))
        if r["sdpo/signal_frac"] > 0:
            assert r["sdpo/distill_loss"] != 0.0
            # on the teacher's own top-4 a sampled token may be outside it everywhere: no KL estimate
            assert math.isfinite(r["sdpo/teacher_kl"]) if "distillation_topk_support" not in mode else True


def test_ema_teacher_moves_after_each_step_and_is_dropped(tmp_path):
    """The EMA teacher is a snapshot taken as the stage starts, moved by ema_rate every
    ema_every optimizer steps and scored with; it is dropped when the stage finishes."""
    from tempering.plugins.backends.local.backend import LocalBackend

    backend = LocalBackend(model="tiny_llama", model_kwargs=SMALL, num_threads=1, threaded=False)
    calls: list[tuple[str, float]] = []
    scored: list[Any] = []
    ema, logprobs = backend.ema_update, backend.logprobs
    backend.ema_update = lambda name, rate: calls.append((name, rate)) or ema(name, rate)
    backend.logprobs = lambda batch, **kw: scored.append(kw) or logprobs(batch, **kw)
    sdpo_recipe(tmp_path, "ema", steps=4, ema_rate=0.1, ema_every=2, success_reward_threshold=0.0, log_kl=False).run(
        backend=backend
    )
    assert calls == [("sdpo/sdpo_teacher", 0.1)] * 2
    assert {"weights": "sdpo/sdpo_teacher"} in scored
    assert backend.snapshot_names() == []


def test_feedback_is_the_teacher_signal(tmp_path, monkeypatch):
    """With no success anywhere, feedback alone makes teachers: every sample's teacher prompt
    holds its own feedback through feedback_template."""
    from tempering.plugins.samplers.completion import CompletionSampler

    sample = CompletionSampler.sample

    async def with_feedback(self, *args, **kwargs):
        rollout = await sample(self, *args, **kwargs)
        for g in rollout.groups:
            for s in g.samples:
                s.feedback = f"want {g.example['answer']}"
        return rollout

    monkeypatch.setattr(CompletionSampler, "sample", with_feedback)
    from tempering.plugins.backends.local.backend import LocalBackend

    backend = LocalBackend(model="tiny_llama", model_kwargs=SMALL, num_threads=1, threaded=False)
    teacher_texts: list[str] = []
    logprobs = backend.logprobs
    backend.logprobs = lambda batch, **kw: (
        (
            teacher_texts.extend(backend.tokenizer.decode(d.input_tokens) for d in batch.data)
            if "weights" in kw
            else None
        )
        or logprobs(batch, **kw)
    )
    result = sdpo_recipe(
        tmp_path,
        "fb",
        reward=lambda c, e: 0.0,
        teacher="stage_start",
        log_kl=False,
        feedback_template="\nfeedback: {feedback_raw}\n",
    ).run(backend=backend)
    for r in sdpo_rows(result):
        assert r["sdpo/feedback_frac"] == r["sdpo/signal_frac"] == r["sdpo/feedback_available_frac"] == 1.0
        assert r["sdpo/solution_frac"] == 0.0 and r["sdpo/distill_loss"] != 0.0
    assert len(teacher_texts) == 32
    assert all(
        t.split("feedback: want ")[1].split("\n")[0] == str(eval(t.split("\n")[0].removeprefix("<bos>").rstrip("=")))
        for t in teacher_texts
    )


def test_multi_turn_samples_are_distilled_on_their_first_row(tmp_path):
    """An episode's teacher row is the re-prompted first messages followed by exactly the
    student's row after its prompt (every turn, the tool results between at weight 0); rows
    after a history rewrite get the policy gradient only, counted. The stage trains through
    the environment sampler."""
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.registry import get_registry
    from tempering.rollouts.rollout import collect
    from tempering.training.recipe import RunContext

    kwargs = {
        "hidden_size": 32,
        "num_layers": 1,
        "num_heads": 2,
        "intermediate_size": 64,
        "chat": True,
        "max_position_embeddings": 512,
    }
    backend = LocalBackend(model="tiny_llama", model_kwargs=kwargs, seed=0, num_threads=1, threaded=False)
    rows = [{"prompt": f"what is {i}+{i}?"} for i in range(4)]
    stage = {
        "name": "sdpo",
        "dataset": rows,
        "steps": 2,
        "prompts_per_step": 2,
        "group_size": 3,
        "max_tokens": 6,
        "distillation": {"teacher": "live"},
        "reprompt": {"success_reward_threshold": 0.0, **TINY_TEMPLATES},
        "sampler": {"name": "environment", "environment": TwoTurns, "max_turns": 2},
        "optimizer": {"learning_rate": 1e-2},
    }
    result = Recipe(name="s", output_dir=str(tmp_path), loggers=[], stages=[stage]).run(backend=backend)
    logged = sdpo_rows(result)
    assert len(logged) == 2 and all(r["sdpo/signal_frac"] == 1.0 and math.isfinite(r["loss"]) for r in logged)

    built = get_registry().build(
        "algorithm", Recipe(name="s", output_dir=str(tmp_path / "b"), loggers=[], stages=[stage]).stages[0], "stages[0]"
    )
    built.setup(RunContext(get_registry(), backend, {}, str(tmp_path / "b"), [], 0), {})
    rollout = collect(built.rollout_sampler, backend, rows[:2], 3, built.sampling_params())
    groups = rollout.groups
    batch, _ = build_group_batch(groups, GroupNormAdvantage())
    teachers = built.distiller.build_teachers(backend.tokenizer, batch, groups, built.rollout_sampler.context)
    samples = [s for g in groups for s in g.samples]
    assert all(len(s.trajectory.turns) == 2 for s in samples)
    assert len(teachers.student) == len(samples)  # one distilled row per episode: its first
    assert teachers.metrics["sdpo/rows_without_teacher"] == sum(len(s.segments()) - 1 for s in samples)
    renderer = built.rollout_sampler.context.renderer()
    for d, t in zip(teachers.student, teachers.teacher):
        n = d.extra["completion_len"]
        assert (
            d.target_tokens[-n:] == t.target_tokens[-n:] and d.weights[-n:] == t.weights[-n:]
        )  # the same continuation
        assert "right answer: " in renderer.decode(t.input_tokens[: len(t.input_tokens) - n + 1])
        assert renderer.role_ids["tool"] in d.target_tokens[-n:] or len(d.target_tokens) < 40


# --------------------------------------------------------------------------- bad input: one line, before training
BAD_RECIPE = """\
name: bad
output_dir: {out}
backend: {{name: local, model: tiny_llama,
          model_kwargs: {{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}, num_threads: 1}}
loggers: []
stages:
  - {{id: rl, name: sdpo, dataset: {{name: arithmetic, split: train}}, steps: 1, prompts_per_step: 2,
      group_size: 2, max_tokens: 2}}
"""

BAD_INPUT = [
    (
        "stages.rl.distillation.mode=kl",
        "stages[0].distillation.mode: unknown mode 'kl'; use one of sampled_token, full_logits, topk_logits",
    ),
    (
        "stages.rl.distillation.alpha=0.5",
        "stages[0].distillation.alpha: must be 1 with mode 'sampled_token'",
    ),
    ("stages.rl.distillation.alpha=1.5", "stages[0].distillation.alpha: must be in [0, 1]"),
    (
        "stages.rl.distillation.mode=topk_logits",
        "stages[0].distillation.topk: mode 'topk_logits' needs topk",
    ),
    ("stages.rl.distillation.weight=2", "stages[0].distillation.weight: must be in [0, 1]"),
    ("stages.rl.distillation.is_clip=0", "stages[0].distillation.is_clip: must be > 0 (or null: off)"),
    (
        "stages.rl.distillation.teacher=frozen",
        "stages[0].distillation.teacher: use one of base, stage_start, live, ema (got 'frozen')",
    ),
    ("stages.rl.reprompt.max_reprompt_len=0", "stages[0].reprompt.max_reprompt_len: must be >= 1"),
    (
        "stages.rl.reprompt.reprompt_template='{solution}{feedback}'",
        "stages[0].reprompt.reprompt_template: has no {prompt} placeholder",
    ),
    (
        "stages.rl.reprompt.reprompt_template='{prompt}{feedback}'",
        "stages[0].reprompt.reprompt_template: has no {solution} placeholder",
    ),
    (
        "stages.rl.reprompt.reprompt_template='{prompt}{solution}'",
        "stages[0].reprompt.reprompt_template: has no {feedback} placeholder",
    ),
    (
        "stages.rl.reprompt.solution_template='solved: '",
        "stages[0].reprompt.solution_template: has no {successful_previous_attempt} placeholder",
    ),
    (
        "stages.rl.reprompt.feedback_template='{feedback}'",
        "stages[0].reprompt.feedback_template: unknown placeholder {feedback}; use {feedback_raw}",
    ),
    (  # the default templates' letters on the tiny model's digits-only tokenizer (was 50 lines)
        "stages.rl.steps=1",
        "stages[0].reprompt.reprompt_template: this model's tokenizer cannot encode the template's text "
        "(WordLevel error: Missing [UNK] token from the vocabulary); write the template in characters",
    ),
    (
        "stages.rl.reprompt.reprompt_template='{prompt}{solution}{feedback}='",
        "stages[0].reprompt.solution_template: this model's tokenizer cannot encode",
    ),
    # the flat keys of earlier versions: one line naming the block each moved to
    (
        "stages.rl.distillation_mode=full_logits",
        "stages[0].distillation_mode: 'distillation_mode' moved: write it as distillation: {mode: ...} "
        "(see CHANGELOG.md)",
    ),
    (
        "stages.rl.reprompt_template='{prompt}'",
        "stages[0].reprompt_template: 'reprompt_template' moved: write it as reprompt: {reprompt_template: ...}",
    ),
    (
        "stages.rl.max_steps_off_policy=2",
        "stages[0].max_steps_off_policy: 'max_steps_off_policy' moved: write it as stale: "
        "{max_steps_off_policy: ...} (see CHANGELOG.md)",
    ),
]


@pytest.mark.parametrize(
    "override, message",
    BAD_INPUT,
    ids=[o.split("=")[0].removeprefix("stages.rl.") + "=" + o.split("=", 1)[1][:12] for o, _ in BAD_INPUT],
)
def test_bad_input_is_one_line_before_anything_trains(rejects_before_training, override, message):
    rejects_before_training(BAD_RECIPE, override, message)


@pytest.mark.parametrize(
    "stage, message",
    [
        (
            {"teacher": "ema"},
            "stages[0].distillation.teacher: 'ema' needs a backend that averages weights (ema_update, e.g. local); "
            "use distillation.teacher: stage_start, base or live",
        ),
        (
            {"teacher": "stage_start", "distillation_mode": "full_logits"},
            "stages[0].distillation.mode: 'full_logits' (support: student) needs the teacher's full "
            "next-token distributions",
        ),
        (
            {
                "teacher": "live",
                "distillation_mode": "topk_logits",
                "distillation_topk": 4,
                "distillation_topk_support": "teacher",
            },
            "stages[0].distillation.mode: 'topk_logits' needs the teacher's top-k next-token distributions",
        ),
    ],
)
def test_a_backend_without_the_needed_capability_is_refused(tmp_path, stage, message):
    """Checked with the backend's capability protocols (tempering.interfaces.supports) before
    any step: FakeBackend has weight snapshots but no averaging and no distributions."""
    from tempering.errors import ConfigError
    from tempering.testing import FakeBackend

    backend = FakeBackend()
    spec = {
        "name": "sdpo",
        "dataset": [{"prompt": "1+1=", "answer": "2"}],
        "steps": 1,
        "group_size": 2,
        **sdpo_keys(**stage),
    }
    with pytest.raises(ConfigError) as err:
        Recipe(name="cap", output_dir=str(tmp_path), loggers=[], stages=[spec]).run(backend=backend)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert backend.batches == []  # nothing trained


def test_sampled_token_with_a_frozen_teacher_runs_on_a_snapshot_only_backend(tmp_path):
    """What FakeBackend can do (token logprobs of a snapshot) is enough for sampled_token."""
    from tempering.testing import FakeBackend

    backend = FakeBackend(complete=lambda prompt, i: "2" if i == 0 else "3")
    spec = {
        "name": "sdpo",
        "dataset": [{"prompt": "1+1=", "answer": "2"}],
        "steps": 2,
        "prompts_per_step": 1,
        "group_size": 2,
        "distillation": {"teacher": "stage_start"},
        "reward": "exact_match",
    }
    result = Recipe(name="ok", output_dir=str(tmp_path), loggers=[], stages=[spec]).run(backend=backend)
    rows = sdpo_rows(result)
    assert len(rows) == 2 and rows[0]["sdpo/signal_frac"] == 0.5 and rows[0]["sdpo/solution_frac"] == 0.5
    assert len(backend.batches) == 2 and all("distill_weights" in d.extra for d in backend.batches[0].data)
