"""The ``distill`` stage's sampled-token advantages are tinker-cookbook 0.6.1's: its
``incorporate_kl_penalty`` (``distillation/train_on_policy.py``), run on the same rows, sampler
logprobs and teacher logprobs (a stand-in teacher client returns them), gives the advantages
and the ``teacher_kl`` our KL term and stage give with ``aggregation: sum`` (the cookbook adds
no normaliser), with and without its discount. Pure maths: no server.

One difference, on purpose: with a discount the cookbook's return-to-go also lands on positions
outside the mask (the prompt's, an observation's inside a multi-turn row) and stays there; its
training loop then drops the mask (``_remove_mask``) before ``importance_sampling``, so those
prompt and observation tokens are trained too. Ours keep 0 off the mask."""

from __future__ import annotations

import asyncio
import random

import pytest

pytestmark = [pytest.mark.extras]


class _Teacher:
    """What ``incorporate_kl_penalty`` calls of a sampling client: ``compute_logprobs(input)``,
    whose ``.coroutine()`` gives the logprobs of every position (the first one None)."""

    def __init__(self, logprobs: list[float]) -> None:
        self.logprobs = logprobs

    def compute_logprobs(self, model_input):
        values = [None, *self.logprobs]
        assert model_input.length == len(values)

        class _Call:
            async def coroutine(self):
                return values

        return _Call()


@pytest.mark.parametrize("coef, discount", [(1.0, 0.0), (0.5, 0.9)])
def test_our_advantages_are_the_cookbooks_incorporate_kl_penalty(coef, discount):
    import tinker

    # .ci/run runs this in the tinker-cookbook venv; elsewhere a skip (allowed: marker extras)
    incorporate_kl_penalty = pytest.importorskip("tinker_cookbook.distillation.train_on_policy").incorporate_kl_penalty

    from tempering.algorithms.distill.algorithm import teacher_kl
    from tempering.algorithms.distill.kl import KLTerm
    from tempering.loss_contract import TEACHER_TOKEN_LOGPROBS
    from tempering.types import Batch, Datum

    rng = random.Random(0)
    ours, theirs, clients = [], [], []
    for n_prompt, n_sampled, gap in [(3, 5, None), (2, 7, 3), (4, 2, None)]:
        tokens = [rng.randrange(50) for _ in range(n_prompt + n_sampled)]
        mask = [0.0] * (n_prompt - 1) + [1.0] * n_sampled
        if gap is not None:  # an observation inside a multi-turn row: weight 0 between sampled tokens
            mask[n_prompt - 1 + gap] = 0.0
        q = [rng.uniform(-4, 0) if m else 0.0 for m in mask]
        u = [rng.uniform(-6, 0) for _ in mask]
        ours.append(Datum(tokens[:-1], tokens[1:], mask, q, [0.0] * len(mask), {TEACHER_TOKEN_LOGPROBS: u}))
        theirs.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData(data=tokens[1:], dtype="int64", shape=[len(mask)]),
                    "logprobs": tinker.TensorData(data=q, dtype="float32", shape=[len(mask)]),
                    "mask": tinker.TensorData(data=mask, dtype="float32", shape=[len(mask)]),
                    "advantages": tinker.TensorData(data=[0.0] * len(mask), dtype="float32", shape=[len(mask)]),
                },
            )
        )
        clients.append(_Teacher(u))
    metrics = asyncio.run(incorporate_kl_penalty(theirs, clients, [0] * len(theirs), coef, discount))
    batch = Batch(ours)
    KLTerm(coef=coef, discount=discount, aggregation="sum").shape_advantages(batch)
    off_mask = []
    for d, t in zip(batch.data, theirs):
        cookbook = t.loss_fn_inputs["advantages"].to_torch().tolist()
        on = [i for i, w in enumerate(d.weights) if w]
        assert [d.advantages[i] for i in on] == pytest.approx([cookbook[i] for i in on], abs=1e-5)
        assert all(a == 0.0 for a, w in zip(d.advantages, d.weights) if not w)
        off_mask += [abs(a) for a, w in zip(cookbook, d.weights) if not w]
    assert (max(off_mask) > 0.1) == (discount > 0)  # the cookbook's discounted advantages off the mask
    assert teacher_kl(batch)["distill/teacher_kl"] == pytest.approx(metrics["teacher_kl"], abs=1e-5)
