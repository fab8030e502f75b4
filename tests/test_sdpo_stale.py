"""Stale SDPO (issue 23 item 3): the sdpo stage with a ``stale: {max_steps_off_policy: k}``
block takes its rollouts from the asynchronous producer through the component the offpolicy
stage holds too (``tempering.training.stale.StaleRollouts``) -- with its corrections: the policy
loss's advantages capped and normalised, PPO's clip around the sampler's policy, the
distillation term's importance weight clipped to [distillation.is_clip_low,
distillation.is_clip]; the teacher is scored at training time with the current teacher weights
on the stale sample's tokens."""

from __future__ import annotations

import math
import os
import string
from typing import Any

import pytest
import torch
from tiny_runs import tiny_recipe

from tempering.algorithms.grpo.algorithm import GRPO
from tempering.algorithms.offpolicy.algorithm import OffPolicyRL
from tempering.algorithms.offpolicy.loss import ClippedISLoss
from tempering.algorithms.sdpo.algorithm import SDPO
from tempering.algorithms.sdpo.loss import SDPOLoss
from tempering.loss_contract import DISTILL_WEIGHTS, TEACHER_TOKEN_LOGPROBS
from tempering.training.recipe import Recipe
from tempering.training.stale import OffPolicyObjective, Staleness, StaleRollouts
from tempering.types import Batch, Datum, SamplingParams

CHARS = string.digits + string.ascii_letters + " +=:,.'\n"
SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "chars": CHARS}
STALE = os.path.join(os.path.dirname(__file__), "..", "examples", "sdpo", "stale.yaml")
TINY_YAML = "{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}"


# --------------------------------------------------------------------------- the corrections, in numbers
RATIOS = [3.0, 0.25, 1.0, 1.5]  # the current policy over the sampler's, per token (one token per row)
TEACHER = [-2.0, -0.5, -1.0, -1.5]  # the teacher's logprob of each sampled token; the student's is -1


def corrected_batch() -> tuple[Batch, list[float]]:
    """Four one-token rows with advantages 10, 1, 1, 1 and the teacher's values attached."""
    rows = []
    for adv, ratio, teacher in zip([10.0, 1.0, 1.0, 1.0], RATIOS, TEACHER):
        d = Datum([1, 2], [2, 3], [0.0, 1.0], [0.0, -1.0 - math.log(ratio)], [0.0, adv])
        d.extra[DISTILL_WEIGHTS] = [0.0, 1.0]
        d.extra[TEACHER_TOKEN_LOGPROBS] = [0.0, teacher]
        rows.append(d)
    return Batch(rows), [-1.0] * 4


def test_stale_corrections_on_a_constructed_batch():
    """The advantage cap (3x the running mean |A|: mean 3.25, cap 9.75), the token-mean fold,
    PPO's clip of the policy part and the two-sided clip of the distillation weight, blended
    50/50: every number by hand."""
    loss = SDPOLoss(policy=ClippedISLoss(), weight=0.5, is_clip=2.0, is_clip_low=0.5)
    corrections = StaleRollouts(
        Staleness(max_steps_off_policy=3), ClippedISLoss(), loss, SamplingParams(), {}, "stages[0]"
    )
    objective = corrections.objective
    assert isinstance(objective, OffPolicyObjective) and objective.inner is loss and corrections.fold == "token_mean"
    batch, lp = corrected_batch()
    metrics = corrections.prepare(batch)
    assert metrics == {"advantage/cap": 9.75, "advantage/capped_frac": 0.25}
    assert [d.advantages[1] for d in batch.data] == [9.75 / 4, 0.25, 0.25, 0.25]  # capped, then / 4 tokens

    logprobs = torch.tensor([[0.0, v] for v in lp], dtype=torch.float64, requires_grad=True)
    tensors = batch.to_tensors()  # float32: the numbers below hold to 1e-6
    out = objective(logprobs, tensors)
    # policy: -sum min(r A, clip(r, 0.8, 1.2) A) = -(1.2 * 2.4375 + 0.0625 + 0.25 + 1.2 * 0.25) = -3.5375
    # distillation: sg(lp - t) * lp * clamp(r, 0.5, 2) = [-2, 0.25, 0, -0.75], mean over rows = -0.625
    assert out.loss.item() == pytest.approx(0.5 * -3.5375 + 0.5 * -0.625, abs=1e-6)
    assert out.metrics["sdpo/policy_loss"] == pytest.approx(-3.5375, abs=1e-6)
    assert out.metrics["sdpo/distill_loss"] == pytest.approx(-0.625, abs=1e-6)
    assert out.metrics["sdpo/is_clip_frac"] == 0.5  # 3 > 2 and 0.25 < 0.5
    assert out.metrics["ratio/clipped_frac"] == 0.5  # 3 and 1.5 outside [0.8, 1.2] with A > 0
    assert (out.metrics["ratio/max"], out.metrics["ratio/min"]) == pytest.approx((3.0, 0.25))
    out.loss.backward()
    # policy: 0 where clipped, else -0.5 r A; distillation: 0.5 / 4 * weight * (lp - t)
    assert logprobs.grad[:, 1].tolist() == pytest.approx([0.25, -0.0625, -0.125, 0.09375], abs=1e-6)


def test_the_distillation_cap_alone_is_one_sided():
    batch, lp = corrected_batch()
    out = SDPOLoss(is_clip=2.0)(torch.tensor([[0.0, v] for v in lp], dtype=torch.float64), batch.to_tensors())
    # weights min(r, 2) = [2, 0.25, 1, 1.5]: [-2, 0.125, 0, -0.75] / 4
    assert out.loss.item() == pytest.approx(-2.625 / 4, abs=1e-7) and out.metrics["sdpo/is_clip_frac"] == 0.25


def set_up(tmp_path: Any, folder: str, **stage: Any) -> Any:
    """The stage of a one-stage recipe, built and set up on the tiny local backend (its
    rollouts started), as the recipe would before its first step."""
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.registry import get_registry
    from tempering.training.recipe import RunContext

    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(4)]
    spec = {"dataset": rows, "reward": digit_reward, "steps": 2, "prompts_per_step": 2, "group_size": 2, **stage}
    recipe = Recipe(name=folder, output_dir=str(tmp_path / folder), loggers=[], stages=[spec])
    built = get_registry().build("algorithm", recipe.stages[0], "stages[0]")
    backend = LocalBackend(model="tiny_llama", model_kwargs=SMALL, num_threads=1, threaded=False)
    ctx = RunContext(get_registry(), backend, {}, str(tmp_path / folder), [], 0)
    built.setup(ctx, {})
    built.teardown(ctx, False)
    return built


def test_offpolicy_and_sdpo_hold_the_same_stale_component(tmp_path):
    """Composition, not inheritance: after setup both stages hold a StaleRollouts (the one
    class), neither inherits from another algorithm, and on-policy SDPO (``stale: null``, the
    default) holds none."""
    offpolicy = set_up(tmp_path, "offpolicy", name="offpolicy", stale={"max_steps_off_policy": 2})
    stale = set_up(tmp_path, "stale", name="sdpo", stale={"max_steps_off_policy": 2})
    on_policy = set_up(tmp_path, "on_policy", name="sdpo")
    assert type(offpolicy) is OffPolicyRL and type(stale) is type(on_policy) is SDPO
    assert type(offpolicy.corrections) is type(stale.corrections) is StaleRollouts
    assert offpolicy.corrections.keys.max_steps_off_policy == stale.corrections.keys.max_steps_off_policy == 2
    assert on_policy.stale is None and on_policy.corrections is None
    for stage in (SDPO, OffPolicyRL, GRPO):
        from_algorithms = [c for c in stage.__mro__ if c.__module__.startswith("tempering.algorithms.")]
        assert from_algorithms == [stage], (stage, from_algorithms)


# --------------------------------------------------------------------------- end to end, tiny model
def digit_reward(completion: str, example: dict) -> float:
    return 1.0 if completion[:1].isdigit() else 0.0


def stale_recipe(tmp_path: Any, name: str, teacher: str) -> Recipe:
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    spec = {
        "name": "sdpo",
        "dataset": rows,
        "reward": digit_reward,
        "steps": 5,
        "prompts_per_step": 4,
        "group_size": 4,
        "max_tokens": 3,
        "optimizer": {"learning_rate": 1e-2},
        "stale": {"max_steps_off_policy": 2, "fixed_staleness": True},
        "loss": "clipped_is",
        "distillation": {"weight": 0.5, "is_clip_low": 0.5, "teacher": teacher},
        "reprompt": {"success_reward_threshold": 0.0},
        "log_kl": False,
    }
    return tiny_recipe(tmp_path, name, spec, SMALL)


def test_python_recipe_reaches_k_stale_and_scores_the_teacher_at_training_time(tmp_path):
    """fixed_staleness: batch b is sampled with the weights of step max(0, b - 2), so the
    staleness is 0, 1, 2, 2, 2; the live teacher scores each batch after the previous step's
    update (the backend's step is the trainer's step when the teacher is scored), not with
    the weights that sampled it. Clip and ratio metrics are logged at every step."""
    from tempering.plugins.backends.local.backend import LocalBackend

    backend = LocalBackend(model="tiny_llama", model_kwargs=SMALL, num_threads=1)
    scored_at: list[int] = []
    logprobs = backend.logprobs
    backend.logprobs = lambda batch, **kw: scored_at.append(backend.step) or logprobs(batch, **kw)
    result = stale_recipe(tmp_path, "live", teacher="live").run(backend=backend)
    rows = [h for h in result.history if "sdpo/signal_frac" in h]
    assert [r["offpolicy/staleness_max"] for r in rows] == [0, 1, 2, 2, 2]
    assert [r["offpolicy/staleness_mean"] for r in rows] == [0, 1, 2, 2, 2]
    assert scored_at == [0, 1, 2, 3, 4]  # the teacher at training time: after steps 0..4's updates
    for r in rows:
        for key in (
            "ratio/clipped_frac",
            "ratio/max",
            "is/ess",
            "sdpo/is_clip_frac",
            "advantage/cap",
            "advantage/capped_frac",
            "sdpo/distill_loss",
            "sdpo/policy_loss",
        ):
            assert key in r and math.isfinite(r[key]), key
        assert r["sdpo/signal_frac"] == 1.0 and r["grad_norm"] > 0
    assert rows[0]["ratio/max"] == pytest.approx(1.0, abs=1e-4)  # on-policy first batch
    assert max(r["ratio/max"] for r in rows[2:]) > 1.0  # two steps stale: ratios move


def test_the_yaml_recipe_runs(tmp_path):
    """examples/sdpo/stale.yaml shortened: its SFT warmup, then stale SDPO (k = 3)."""
    overrides = [
        f"output_dir={tmp_path}",
        "loggers=[]",
        f"backend.model_kwargs={TINY_YAML}",
        "stages.warmup.steps=2",
        "stages.warmup.eval.dataset=null",
        "stages.rl.eval.dataset=null",
        "stages.rl.steps=5",
        "stages.rl.prompts_per_step=2",
        "stages.rl.group_size=3",
        "stages.rl.reprompt.success_reward_threshold=0.0",
        "stages.rl.stale.fixed_staleness=true",
    ]
    result = Recipe.from_yaml(STALE, overrides).run()
    rows = [h for h in result.history if "sdpo/signal_frac" in h]
    assert [r["offpolicy/staleness_max"] for r in rows] == [0, 1, 2, 3, 3]
    assert all("ratio/clipped_frac" in r and "sdpo/is_clip_frac" in r and "advantage/capped_frac" in r for r in rows)


# --------------------------------------------------------------------------- bad input: one line, before training
BAD_RECIPE = """\
name: bad
output_dir: {out}
backend: {{name: local, model: tiny_llama,
          model_kwargs: {{hidden_size: 32, num_layers: 1, num_heads: 2, intermediate_size: 64}}, num_threads: 1}}
loggers: []
stages:
  - {{id: rl, name: sdpo, dataset: {{name: arithmetic, split: train}}, steps: 1, prompts_per_step: 2,
      group_size: 2, max_tokens: 2, stale: {{max_steps_off_policy: 1}}}}
"""

BAD_INPUT = [
    ("stages.rl.stale.max_steps_off_policy=-1", "stages[0].stale.max_steps_off_policy: must be >= 0, got -1"),
    (
        "stages.rl.stale.sync_every=3",
        "stages[0].stale.sync_every: must be between 1 and max_steps_off_policy + 1 = 2",
    ),
    (
        "stages.rl.stale.aggregation=mean",
        "stages[0].stale.aggregation: use one of ('auto', 'token_mean', 'seq_mean', 'sum')",
    ),
    (
        "stages.rl.temperature=0.7",
        "stages[0].temperature: stale SDPO (a stale: block) needs temperature: 1, got 0.7",
    ),
    ("stages.rl.top_k=5", "stages[0].top_k: stale SDPO (a stale: block) needs top_k: 0, got 5"),
    ("stages.rl.recompute_logprobs=always", "stages[0].recompute_logprobs: stale SDPO keeps the sampler's logprobs"),
    ("stages.rl.distillation.is_clip_low=1.5", "stages[0].distillation.is_clip_low: must be in (0, 1]"),
    (  # a flat key of earlier versions: one line naming its block
        "stages.rl.max_steps_off_policy=2",
        "stages[0].max_steps_off_policy: 'max_steps_off_policy' moved: write it as stale: "
        "{max_steps_off_policy: ...} (see CHANGELOG.md)",
    ),
]


@pytest.mark.parametrize(
    "override, message", BAD_INPUT, ids=[o.split("=")[0].removeprefix("stages.rl.") for o, _ in BAD_INPUT]
)
def test_bad_input_is_one_line_before_anything_trains(rejects_before_training, override, message):
    rejects_before_training(BAD_RECIPE, override, message)


def test_a_floor_without_a_cap_is_one_line():
    from tempering.algorithms.sdpo.loss import distillation_problem

    assert distillation_problem("sampled_token", 1.0, None, "student", None, 1.0, 0.5) == (
        "is_clip_low",
        "is a floor of the is_clip weight, which is off (null); set both",
    )
