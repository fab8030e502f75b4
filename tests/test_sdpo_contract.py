"""SDPO on the loss contract (issue 23 with issue 22's contract): SDPOLoss declares the batch
inputs it reads (the policy loss's when blended in, the distillation mask and the teacher's
values of its mode), the sdpo stage declares what its batches hold and checks the blended loss
against it, and the built-in that computes the loss is declared backend-neutrally (none while
something is distilled; the policy loss's own at distillation.weight 0)."""

from __future__ import annotations

import pytest

from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.algorithms.offpolicy.loss import ClippedISLoss
from tempering.algorithms.sdpo.algorithm import SDPO
from tempering.algorithms.sdpo.loss import SDPOLoss
from tempering.errors import ConfigError
from tempering.loss_contract import (
    ADVANTAGES,
    DISTILL_WEIGHTS,
    LOGITS,
    REF_LOGPROBS,
    SAMPLER_LOGPROBS,
    TEACHER_LOGITS,
    TEACHER_TOKEN_LOGPROBS,
    TEACHER_TOPK_IDS,
    TEACHER_TOPK_LOGPROBS,
    WEIGHTS,
    BuiltinLoss,
    NoBuiltin,
    builtin_of,
    check_reads,
)
from tempering.training.teacher import TeacherNeeds, teacher_needs
from tempering.types import Batch, Datum

TOKEN = {WEIGHTS, DISTILL_WEIGHTS, TEACHER_TOKEN_LOGPROBS}
MODES = {
    "sampled_token": ({"mode": "sampled_token"}, TOKEN, TeacherNeeds("token", 0)),
    "full": ({"mode": "full_logits", "alpha": 0.5}, TOKEN | {LOGITS, TEACHER_LOGITS}, TeacherNeeds("full", 0)),
    "topk_student": ({"mode": "topk_logits", "topk": 4}, TOKEN | {LOGITS, TEACHER_LOGITS}, TeacherNeeds("full", 4)),
    "topk_teacher": (
        {"mode": "topk_logits", "topk": 4, "topk_support": "teacher"},
        TOKEN | {LOGITS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS},
        TeacherNeeds("topk", 4),
    ),
}


@pytest.mark.parametrize("case", MODES)
def test_sdpo_loss_reads_and_teacher_needs_follow_the_mode_and_weight(case):
    cfg, distill, needs = MODES[case]
    assert SDPOLoss(**cfg).reads == distill  # distillation only: no policy input
    assert teacher_needs(SDPOLoss(**cfg)) == needs
    blended = SDPOLoss(policy=GRPOLoss(beta=0.04), weight=0.5, **cfg)
    assert blended.reads == distill | {ADVANTAGES, REF_LOGPROBS}  # grpo's with its KL term
    assert SDPOLoss(policy=ClippedISLoss(), weight=0.0, **cfg).reads == {WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES}
    # what the stage's batches hold covers what the loss reads, for each mode
    distillation = {
        "mode": cfg["mode"],
        "alpha": cfg.get("alpha", 1.0),
        "topk": cfg.get("topk"),
        "topk_support": cfg.get("topk_support", "student"),
    }
    for weight in (1.0, 0.5, 0.0):
        stage = SDPO(distillation={"weight": weight, **distillation})
        check_reads(
            SDPOLoss(policy=GRPOLoss(beta=0.04), weight=weight, **cfg),
            stage.batch_inputs(GRPOLoss()),
            "stages[0].loss",
            "sdpo",
        )
    assert DISTILL_WEIGHTS not in SDPO(distillation={"weight": 0.0}).batch_inputs(GRPOLoss())


def test_a_loss_the_sdpo_stage_cannot_feed_is_one_line():
    """An SDPOLoss whose teacher input the stage does not prepare (a hand-built mismatch: the
    stage scores token logprobs, the loss reads full distributions) is refused by the check
    the stage runs at setup."""
    with pytest.raises(ConfigError) as err:
        check_reads(SDPOLoss(mode="full_logits"), SDPO().batch_inputs(GRPOLoss()), "stages[0].loss", "sdpo")
    assert str(err.value).startswith("stages[0].loss: the SDPOLoss loss reads teacher_logits, which a 'sdpo' stage's")


def test_sdpo_builtin_is_declared_backend_neutrally():
    batch = Batch([Datum([1, 2, 3], [2, 3, 4], [0.0, 1.0, 1.0], [0.0, -0.5, -0.2], [0.0, 1.0, 1.0])])
    assert builtin_of(SDPOLoss(), batch) == NoBuiltin(
        "SDPOLoss: no built-in computes the self-distillation term sg(lp - lp_teacher) * lp "
        "blended with the policy loss"
    )
    assert builtin_of(SDPOLoss(mode="full_logits"), batch) == NoBuiltin(
        "Use distillation.mode: sampled_token for SDPO on Tinker."
    )
    policy_only = builtin_of(SDPOLoss(policy=ClippedISLoss(), weight=0.0), batch)  # weight 0: the policy loss itself
    assert isinstance(policy_only, BuiltinLoss) and policy_only.name == "ppo"
    assert dict(policy_only.config or {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert SDPOLoss(policy=ClippedISLoss(), weight=0.0).tinker_builtin == "ppo" and SDPOLoss().tinker_builtin is None
