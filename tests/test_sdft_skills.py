"""SDFT vs SFT on a two-skill toy: learn skill B from demonstrations, measure what happens to A.

The toy (``tempering.algorithms.sdft.toy``, character-level tiny Llama, ~40 s on 2 quiet cores):

* pretraining (SFT until A is learnt, ~400 steps): skill A = reverse a letter string (``"R abcd="`` -> ``"dcba"``)
  plus in-context copying: ``"{hint}!|{task} {x}="`` -> ``"{hint}"``. The hint is shown in the
  demonstrator's style (a trailing ``!``) and answered in the model's own style (no ``!``): the
  toy stand-in for an LLM's ability to use an example response and answer in its own words,
  which is what SDFT's teacher relies on.
* skill B = reverse a *digit* string (``"R 0312="`` -> ``"2130"``); the model has never seen
  digits as input, and gets B almost always wrong at the start (seed 2: 2%).
* the same 2000 B demonstrations, ``"2130!"`` (the demonstrator's style), train B either by SFT
  (imitate the demonstration) or by SDFT (student samples from the prompt alone; the teacher is
  the model at stage start prompted with ``"{demonstration}|{prompt}"``; full-logit JSD).

Forgetting = A's held-out exact-match accuracy before minus after. SFT copies the
demonstrations verbatim, ``!`` included, and the habit leaks into skill A ("dcba!") on top of
the interference on A's content; SDFT's targets are the model's own (teacher) distribution, so
its answers keep their style and it changes the model less. Both are reported, as is A's
*content* accuracy (ignoring a trailing ``!``) so the two effects can be told apart.
"""

from __future__ import annotations

import time

import pytest

from tempering.algorithms.sdft.toy import TOY_CHARS, TOY_DIGITS, TOY_TEACHER_TEMPLATE, toy_skills
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.plugins.rewards.basic import ExactMatch
from tempering.training.evaluate import evaluate
from tempering.training.recipe import Recipe

SEED = 2
MODEL = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 128,
    "chars": TOY_CHARS,
    "max_position_embeddings": 64,
}
STYLE = "!"
B_TRAIN = {"name": "toy_skills", "skill": "reverse", "size": 2000, "letters": TOY_DIGITS, "demo_suffix": STYLE}


def content(completion: str, example: dict) -> float:
    return float(completion.strip().removesuffix(STYLE) == example["answer"])


def measure(backend, a_test, b_test) -> dict[str, float]:
    exact = ExactMatch()
    acc = lambda rows, reward: evaluate(backend, rows, reward, max_tokens=7)["eval/accuracy"]
    return {"A": acc(a_test, exact), "A_content": acc(a_test, content), "B": acc(b_test, content)}


def _run(backend, tmp_path, name, stage):
    Recipe(name=name, output_dir=str(tmp_path / name), loggers=[], seed=SEED, stages=[stage]).run(backend=backend)


@pytest.mark.slow
def test_sdft_learns_b_and_forgets_less_of_a_than_sft(tmp_path):
    t0 = time.perf_counter()
    a_test = toy_skills("reverse", "test", 100)
    b_test = toy_skills("reverse", "test", 100, letters=TOY_DIGITS)
    backend = LocalBackend(model="tiny_llama", model_kwargs=MODEL, num_threads=1, seed=SEED)
    # Pretrain until A is learnt (held-out exact match >= 0.9, checked every 50 steps): when
    # the tiny model gets it depends on the CPU's float rounding (0.97 at step 400 on one
    # machine, 0.83 on another), so a fixed step count would make the test machine-dependent.
    a_val = toy_skills("reverse", "test", 200)[100:]  # mostly other strings than a_test's
    _run(
        backend,
        tmp_path,
        "pretrain",
        {
            "name": "sft",
            "steps": 1000,
            "batch_size": 64,
            "optimizer": {"learning_rate": 3e-3, "warmup_steps": 20},
            "dataset": {
                "name": "toy_mixture",
                "demo_suffix": STYLE,
                "skills": {"reverse": 2000, "hint": 1000, f"hint@{TOY_DIGITS}": 1000},
            },
            "eval": {"dataset": a_val, "max_tokens": 7, "every": 50, "at_start": False, "stop_at_accuracy": 0.9},
        },
    )
    start = backend.save(str(tmp_path / "pretrained"))
    before = measure(backend, a_test, b_test)
    t_pre = time.perf_counter() - t0

    after, times = {}, {}
    arms = {
        "sft": {
            "name": "sft",
            "steps": 100,
            "batch_size": 32,
            "completion_key": "demonstration",
            "optimizer": {"learning_rate": 3e-4},
            "dataset": B_TRAIN,
        },
        "sdft": {
            "name": "sdft",
            "steps": 100,
            "prompts_per_step": 32,
            "max_tokens": 7,
            "teacher": "stage_start",
            "teacher_template": TOY_TEACHER_TEMPLATE,
            "loss": {"name": "sdft", "mode": "full_logits", "alpha": 0.5},
            "optimizer": {"learning_rate": 3e-4},
            "dataset": B_TRAIN,
        },
    }
    for arm, stage in arms.items():
        t1 = time.perf_counter()
        backend.load(start)
        _run(backend, tmp_path, arm, stage)
        after[arm] = measure(backend, a_test, b_test)
        times[arm] = time.perf_counter() - t1

    forget = {arm: before["A"] - m["A"] for arm, m in after.items()}
    forget_content = {arm: before["A_content"] - m["A_content"] for arm, m in after.items()}
    gain = {arm: m["B"] - before["B"] for arm, m in after.items()}
    print(f"\npretrained ({t_pre:.0f}s): A {before['A']:.2f}, B {before['B']:.2f}")
    for arm in arms:
        print(
            f"{arm:>4} ({times[arm]:.0f}s): A {after[arm]['A']:.2f} (forgetting {forget[arm]:+.2f}; content "
            f"{after[arm]['A_content']:.2f}, forgetting {forget_content[arm]:+.2f}), "
            f"B {after[arm]['B']:.2f} (gain {gain[arm]:+.2f})"
        )
    # A was learnt, B was not: B's exact match before is 0.0-0.38 across three machines (0.15 on
    # CI's and 0.38 on a third, where the pretraining mixture's digit hints leak some of B; the
    # same numbers from the pre-redesign code there, so it is the machine's float rounding), so
    # "not learnt" is <= 0.4. Both arms learn B from the same demonstrations: B after 0.87-1.00
    # measured (>= 0.85), a gain of 0.49-0.98 (>= 0.45); without training B stays where it was.
    assert before["A"] >= 0.85 and before["B"] <= 0.4
    assert all(after[arm]["B"] >= 0.85 and gain[arm] >= 0.45 for arm in arms), (after, gain)
    assert forget["sdft"] < forget["sft"] - 0.2  # ... and SDFT forgets much less of A (measured: 0.34-0.70 less)
    # A's *content* alone is not asserted: SDFT forgot less of it on one machine (3 seeds) and
    # more on another (0.26 vs 0.12), so the robust effect is the style one (docs/sdft.md).
