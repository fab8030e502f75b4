"""The loss contract (issue 22): a loss declares the batch inputs it reads, checked against what
its stage's batches hold before anything trains; stages pass what a loss needs as a typed
LossSetup instead of writing into it; the built-in a loss declares is backend-neutral; and the
layering that keeps a backend from importing an algorithm holds (no upward import, no cycle)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tempering.algorithms.dpo.loss import DPOLoss
from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.errors import ConfigError
from tempering.loss_contract import (
    ADVANTAGES,
    REF_LOGPROBS,
    WEIGHTS,
    BuiltinLoss,
    LossSetup,
    NoBuiltin,
    builtin_of,
    check_reads,
    for_stage,
    reads_input,
)
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe
from tempering.types import Batch, Datum

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "chosen": "1", "rejected": "2"} for i in range(4)]


def stage_error(tmp_path: Path, stage: dict) -> str:
    backend = FakeBackend()
    with pytest.raises(ConfigError) as err:
        Recipe(name="c", output_dir=str(tmp_path), loggers=[], stages=[stage]).run(backend=backend)
    assert backend.step == 0 and backend.batches == []  # refused before anything trained
    return str(err.value)


def test_a_loss_reading_what_its_stage_does_not_provide_fails_at_validation(tmp_path):
    message = stage_error(tmp_path / "a", {"name": "offpolicy", "dataset": ROWS, "loss": "dpo"})
    assert message.startswith(
        "stages[0].loss: the DPOLoss loss reads ref_logprobs, which a 'offpolicy' stage's batches"
    )
    message = stage_error(tmp_path / "b", {"name": "sft", "dataset": ROWS, "completion_key": "answer", "loss": "grpo"})
    assert message.startswith("stages[0].loss: the GRPOLoss loss reads advantages, which a 'sft' stage's batches")


def test_reads_follow_the_config_and_drive_what_grpo_prepares():
    assert GRPOLoss().reads == {WEIGHTS, ADVANTAGES}
    assert reads_input(GRPOLoss(beta=0.04), REF_LOGPROBS) and not reads_input(GRPOLoss(), REF_LOGPROBS)
    assert DPOLoss().reads == {WEIGHTS, REF_LOGPROBS}
    check_reads(DPOLoss(), {WEIGHTS, REF_LOGPROBS}, "stages[0].loss", "dpo")  # passes
    check_reads(object(), set(), "stages[0].loss", "dpo")  # a loss that declares nothing is not checked


def test_the_stage_passes_max_tokens_without_writing_into_the_loss():
    loss = GRPOLoss(loss_type="dr_grpo")
    configured = for_stage(loss, LossSetup(max_tokens=8))
    assert configured.max_completion_length == 8 and loss.max_completion_length is None  # a copy, not a write
    fixed = GRPOLoss(loss_type="dr_grpo", max_completion_length=5)
    assert for_stage(fixed, LossSetup(max_tokens=8)) is fixed  # the user's value wins
    assert for_stage(DPOLoss(), LossSetup(max_tokens=8)) == DPOLoss()  # not stage-aware: unchanged


def test_builtin_declarations_are_backend_neutral():
    batch = Batch([Datum([1, 2, 3], [2, 3, 4], [0.0, 1.0, 1.0], [0.0, -0.5, -0.2], [0.0, 1.0, 1.0])])
    found = builtin_of(GRPOLoss(loss_type="dapo"), batch)
    assert isinstance(found, BuiltinLoss) and found.name == "ppo"
    assert found.coefficients.tolist() == [[0.0, 0.5, 0.5]]  # the token mean folded into the advantages
    assert isinstance(builtin_of(GRPOLoss(beta=0.1), batch), NoBuiltin)
    assert builtin_of(DPOLoss(), batch) == NoBuiltin("DPOLoss names no built-in loss (tinker_builtin is None)")

    class Unknown:
        tinker_builtin = "nope"

    with pytest.raises(ValueError, match="not a built-in loss"):
        builtin_of(Unknown(), batch)


def test_sdft_declares_its_inputs_teacher_and_builtin(tmp_path):
    """SDFT on the contract: its losses declare what they read and what the teacher must score
    (the stage reads no loss attribute by name), its stage what its batches hold, and the
    checks run at validation: a loss the stage cannot feed, or a logit mode on a backend that
    gives a loss no logits, is one line at the loss's key before anything trains."""
    from tempering.algorithms.sdft.algorithm import SDFT
    from tempering.algorithms.sdft.loss import ImportanceSamplingLoss, SDFTLoss
    from tempering.loss_contract import (
        LOGITS,
        SAMPLER_LOGPROBS,
        TEACHER_LOGITS,
        TEACHER_TOKEN_LOGPROBS,
        TEACHER_TOPK_IDS,
        TEACHER_TOPK_LOGPROBS,
    )
    from tempering.training.teacher import TEACHER_KEYS, TeacherNeeds, teacher_needs

    assert TEACHER_KEYS == (TEACHER_TOKEN_LOGPROBS, TEACHER_LOGITS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS)
    token, full = SDFTLoss(mode="sampled_token", aggregation="token_mean"), SDFTLoss(mode="full_logits")
    topk = SDFTLoss(mode="topk_logits", topk=4, topk_support="teacher")
    assert token.reads == ImportanceSamplingLoss.reads == {WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES}
    assert full.reads == {WEIGHTS, LOGITS, TEACHER_LOGITS} == SDFTLoss().reads  # student support: the full teacher
    assert topk.reads == {WEIGHTS, LOGITS, TEACHER_TOPK_LOGPROBS, TEACHER_TOPK_IDS}
    assert token.teacher_needs == TeacherNeeds("token", 100, "token_mean") and topk.teacher_needs == TeacherNeeds(
        "topk", 4
    )
    assert teacher_needs(ImportanceSamplingLoss()) == TeacherNeeds()  # declares none: the sampled-token default
    stage = SDFT()
    for loss in (token, full, topk, ImportanceSamplingLoss()):  # what the stage prepares covers what each reads
        check_reads(loss, stage.batch_inputs(loss), "stages[0].loss", "sdft")
    assert TEACHER_TOPK_IDS in stage.batch_inputs(topk) and ADVANTAGES not in stage.batch_inputs(full)

    batch = Batch([Datum([1, 2, 3], [2, 3, 4], [0.0, 1.0, 1.0], [0.0, -0.5, -0.2], [0.0, 1.0, 1.0])])
    found = builtin_of(token, batch)
    assert isinstance(found, BuiltinLoss) and (found.name, found.config, found.coefficients) == (
        "importance_sampling",
        None,
        None,
    )
    assert builtin_of(full, batch) == NoBuiltin(
        "Use mode: sampled_token (Tinker's importance_sampling) for SDFT on Tinker."
    )

    rows = [{"prompt": f"{i}+{i}=", "demonstration": str(2 * i)} for i in range(4)]
    message = stage_error(tmp_path / "a", {"name": "sdft", "dataset": rows, "teacher": "live", "loss": "dpo"})
    assert message.startswith("stages[0].loss: the DPOLoss loss reads ref_logprobs, which a 'sdft' stage's batches")
    message = stage_error(
        tmp_path / "b",
        {"name": "sdft", "dataset": rows, "teacher": "live", "loss": {"name": "sdft", "mode": "full_logits"}},
    )
    assert message == (
        "stages[0].loss.mode: 'full_logits' needs the teacher's full next-token distributions, which "
        "this backend does not return; use mode: sampled_token"
    )

    class TopK(FakeBackend):  # the teacher's top-k, but no logits for the loss (as Tinker)
        def distributions(self, batch, reference=False, weights=None, topk=None):
            raise AssertionError("validation must refuse the stage first")

    with pytest.raises(ConfigError) as err:
        Recipe(
            name="c",
            output_dir=str(tmp_path / "c"),
            loggers=[],
            stages=[{"name": "sdft", "dataset": rows, "teacher": "live", "loss": "sdft"}],
        ).run(backend=TopK())
    assert str(err.value) == (
        "stages[0].loss: the SDFTLoss loss trains on the student's logits, which this backend "
        "does not give a loss (it returns per-token logprobs only); use mode: sampled_token "
        "(Tinker's importance_sampling)"
    )
    message = stage_error(
        tmp_path / "d",
        {
            "name": "sdft",
            "dataset": rows,
            "teacher": "live",
            "loss": {"name": "sdft", "mode": "topk_logits", "topk_support": "teacher"},
        },
    )
    assert message.startswith("stages[0].loss.mode: 'topk_logits' needs the teacher's top-k")
    with pytest.raises(ConfigError) as err:
        Recipe(
            name="c",
            output_dir=str(tmp_path / "e"),
            loggers=[],
            stages=[
                {
                    "name": "sdft",
                    "dataset": rows,
                    "teacher": "live",
                    "loss": {"name": "sdft", "mode": "topk_logits", "topk_support": "teacher"},
                }
            ],
        ).run(backend=TopK())
    assert str(err.value).startswith("stages[0].loss.mode: 'topk_logits' trains on the student's logits")


def test_optional_capabilities_are_read_through_the_contract() -> None:
    """Issue 38: a loss's capabilities are optional protocols; a property that says False is
    read as False, an absent one as absent, and the call alone makes a Loss."""
    from tempering import loss_contract as lc
    from tempering.interfaces import Loss

    class Bare:
        def __call__(self, logprobs, batch):
            raise AssertionError("not called")

    class Declares:
        needs_logits = True
        needs_all_positions = False
        tinker_builtin = "ppo"
        tinker_loss_fn_config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

        def __call__(self, logprobs, batch):
            raise AssertionError("not called")

    bare, declares = Bare(), Declares()
    assert isinstance(bare, Loss) and isinstance(declares, Loss)
    assert (lc.needs_logits(bare), lc.needs_all_positions(bare), lc.builtin_name(bare)) == (False, False, None)
    assert (lc.needs_logits(declares), lc.needs_all_positions(declares), lc.builtin_name(declares)) == (
        True,
        False,
        "ppo",
    )
    assert lc.builtin_config(declares, "ppo") == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert isinstance(builtin_of(bare, Batch(data=[])), NoBuiltin)
