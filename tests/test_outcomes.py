"""Outcomes (``tempering.runs.outcomes``): scored samples counted by their reward's label, per
step and per evaluation; failed samples are failures, not outcomes."""

from __future__ import annotations

from tempering.apps.checkpoint_eval import score_groups
from tempering.rollouts.rollout import rollout_metrics
from tempering.runs.failures import mark_failed
from tempering.runs.outcomes import outcome_metrics
from tempering.types import Completion, Group, Sample


def sample(info: dict) -> Sample:
    return Sample(example={}, completion=Completion([], [], [], text="x"), reward_info=dict(info))


def test_labels_are_counted_and_failures_are_not() -> None:
    failed = sample({"outcome": "timeout"})
    mark_failed(failed, "raised:SandboxError", "SandboxError: did not start")
    samples = [sample({"outcome": "passed"}), sample({"outcome": "timeout"}), sample({"outcome": "passed"})]
    samples += [failed, sample({}), sample({"outcome": 3}), sample({"outcome": ""})]
    assert outcome_metrics(samples) == {"outcome/passed": 2.0, "outcome/timeout": 1.0}
    assert outcome_metrics(samples, prefix="eval/") == {"eval/outcome/passed": 2.0, "eval/outcome/timeout": 1.0}


def test_a_step_logs_them() -> None:
    metrics = rollout_metrics([Group({}, [sample({"outcome": "memory"}), sample({"outcome": "passed"})])])
    assert (metrics["outcome/memory"], metrics["outcome/passed"]) == (1.0, 1.0)


def test_tempering_eval_counts_them() -> None:
    report = score_groups([Group({}, [sample({"outcome": "passed"}), sample({"outcome": "syntax_error"})])])
    assert (report["outcome/passed"], report["outcome/syntax_error"]) == (1.0, 1.0)
