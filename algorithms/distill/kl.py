"""The KL term of on-policy distillation: the ``kl:`` block of the distill stage.

The student samples; the teacher scores the student's tokens; the term turns the two into the
training signal, one of two ways (``estimator``):

* ``sampled`` (default; the tinker-cookbook's ``incorporate_kl_penalty``, Thinking Machines'
  "on-policy distillation"): the per-token reverse KL seen through the sampled token,
  ``k_t = log p_student(x_t) - log p_teacher(x_t)``, becomes the per-token advantage
  ``A_t = -coef * sum_{j >= 0} discount**j k_{t+j}`` (``discount`` 0: ``-coef * k_t``), added to
  the task reward's group advantage when the stage has a reward, and trained with a policy loss
  (``importance_sampling`` by default, Tinker's built-in). The normaliser of ``aggregation``
  (``token_mean``, ``seq_mean``; ``sum`` = none, the cookbook's) is folded into ``A`` because the
  loss sums over tokens. On-policy the gradient is ``-sum_t A_t grad log p_student(x_t)``: a
  REINFORCE estimate of the reverse KL's gradient, which needs one teacher logprob per token;
* ``top_k`` / ``full``: the reverse KL over the teacher's top-k tokens (+ a tail bucket) or the
  whole vocabulary at each position of the student's samples, minimised directly
  (:class:`~tempering.algorithms.distill.loss.ReverseKLLoss`); lower variance, but it needs the
  model's logits in the loss and the teacher's distributions (the local backend).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tempering.algorithms.distill.loss import LOGIT_MODES, ReverseKLLoss
from tempering.loss_contract import TEACHER_TOKEN_LOGPROBS
from tempering.rlmath.aggregation import fold_normaliser
from tempering.rlmath.kl import reverse_kl_advantages
from tempering.schema import Problem, one_of
from tempering.training.stage import sub_config
from tempering.training.teacher import TeacherNeeds
from tempering.types import Batch

ESTIMATORS = ("sampled", *LOGIT_MODES)
AGGREGATIONS = ("token_mean", "seq_mean", "sum")


@dataclass
class KLTerm:
    """The ``kl:`` block: ``estimator`` (``sampled``, ``top_k``, ``full``), ``top_k`` (the
    teacher's support for ``top_k``, 20), ``add_tail`` (``top_k``: one more category for the
    mass outside the support, true), ``coef`` (the cookbook's ``kl_penalty_coef``, 1),
    ``discount`` (``sampled``: the cookbook's ``kl_discount_factor``, 0) and ``aggregation``
    (``token_mean``; ``seq_mean``; ``sum`` for ``sampled`` only, the cookbook's). A string is
    shorthand for ``{estimator: ...}``."""

    estimator: str = "sampled"
    top_k: int = 20
    add_tail: bool = True
    coef: float = 1.0
    discount: float = 0.0
    aggregation: str = "token_mean"

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
        """The values that cannot work, at their keys."""
        estimator = config["estimator"]
        yield one_of("estimator", estimator, ESTIMATORS, f"use one of {', '.join(ESTIMATORS)} (got {estimator!r})")
        if config["top_k"] < 1:
            yield Problem("top_k", f"must be >= 1, got {config['top_k']}")
        if not config["coef"] > 0:
            yield Problem("coef", f"must be > 0, got {config['coef']} (0 would train on nothing)")
        if not 0 <= config["discount"] <= 1:
            yield Problem("discount", f"must be in [0, 1], got {config['discount']}")
        elif config["discount"] and estimator != "sampled":
            yield Problem("discount", f"discounts sampled-token advantages; estimator {estimator!r} has none")
        aggregation = config["aggregation"]
        yield one_of(
            "aggregation", aggregation, AGGREGATIONS, f"use one of {', '.join(AGGREGATIONS)} (got {aggregation!r})"
        )
        if aggregation == "sum" and estimator != "sampled":
            yield Problem("aggregation", f"sum is for sampled-token advantages; estimator {estimator!r} takes a mean")

    @property
    def sampled(self) -> bool:
        return self.estimator == "sampled"

    @property
    def teacher_needs(self) -> TeacherNeeds:
        """What the teacher must score: its logprobs of the sampled tokens, or distributions."""
        loss = self.loss()
        return TeacherNeeds("token", aggregation=self.aggregation) if loss is None else loss.teacher_needs

    def loss(self) -> ReverseKLLoss | None:
        """The loss of a ``top_k`` / ``full`` estimator; ``None`` for ``sampled`` (the stage's
        policy loss trains on the advantages :meth:`shape_advantages` writes)."""
        if self.sampled:
            return None
        return ReverseKLLoss(self.estimator, self.top_k, self.add_tail, self.coef, self.aggregation)

    def shape_advantages(self, batch: Batch) -> None:
        """Per token: the row's advantage (the task reward's, 0 without a reward) plus the
        distillation advantage, times the aggregation's normaliser (in place). Reads each row's
        sampler logprobs and the teacher's (``extra[TEACHER_TOKEN_LOGPROBS]``)."""
        norms = fold_normaliser([d.weights for d in batch.data], self.aggregation)
        for d, norm in zip(batch.data, norms):
            mask = torch.tensor(d.weights)
            kl_adv = reverse_kl_advantages(
                torch.tensor(d.sampler_logprobs or [0.0] * len(d.weights), dtype=torch.float64),
                torch.tensor(d.extra[TEACHER_TOKEN_LOGPROBS], dtype=torch.float64),
                mask,
                self.coef,
                self.discount,
            ).tolist()
            base = d.advantages or [0.0] * len(d.weights)
            d.advantages = [(a + k) * n for a, k, n in zip(base, kl_adv, norm)]


def kl_term(value: object, path: str) -> KLTerm:
    """The ``kl:`` block at ``path``, checked (a string is ``{estimator: value}``)."""
    return sub_config(KLTerm, {"estimator": value} if isinstance(value, str) else value, path)
