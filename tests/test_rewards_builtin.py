"""The built-in rewards' parsing and maths, against hand-computed numbers, and their
registration (names, descriptions, lazy targets, config keys)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from tempering.errors import ConfigError
from tempering.interfaces import RewardResult
from tempering.plugins.rewards.combine import AsyncWeightedReward, WeightedReward, weighted
from tempering.plugins.rewards.common import RewardError, find_numbers, parse_number
from tempering.plugins.rewards.forecast import Brier, BrierSkill, ForecastParseError, parse_probability
from tempering.plugins.rewards.math_answer import MathAnswer, extract_answer, extract_boxed
from tempering.plugins.rewards.retrieval import RetrievalRecall, cited_ids
from tempering.registry import get_registry
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample

BUILTINS = [
    "brier",
    "brier_skill",
    "exact_match",
    "llm_judge",
    "math_answer",
    "process_pool",
    "remote",
    "retrieval_recall",
    "weighted",
]


def samples(*texts: str, **example) -> list[Sample]:
    return [Sample(example=dict(example), completion=Completion([], [], [], text=t)) for t in texts]


# --------------------------------------------------------------------------- registration
def test_every_builtin_reward_is_registered_lazily_with_a_description():
    reg = get_registry()
    names = reg.names("reward")
    assert set(BUILTINS) <= set(names)
    for name in BUILTINS:
        comp = reg.get("reward", name)
        assert comp.plugin.dist == "tempering"
        assert comp.description, name
    # lazy: listing the rewards must not have imported httpx or the reward modules
    code = (
        "import sys; from tempering.registry import get_registry; get_registry().names('reward'); "
        "bad = [m for m in ('httpx', 'tempering.plugins.rewards.remote', 'tempering.plugins.rewards.judge', "
        "'tempering.plugins.rewards.pool', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    for name in BUILTINS:
        assert callable(get_registry().get("reward", name).load())


def test_misspelt_config_key_fails_with_its_path():
    with pytest.raises(ConfigError, match=r"reward\.abs_tl.*abs_tol"):
        get_registry().build("reward", {"name": "math_answer", "abs_tl": 0.1}, "reward")


def test_exact_match_unchanged():
    em = get_registry().build("reward", "exact_match")
    assert em(" 42 ", {"answer": "42"}) == 1.0
    assert em("42.0", {"answer": "42"}) == 0.0


# --------------------------------------------------------------------------- numbers
@pytest.mark.parametrize(
    "text, want",
    [
        ("1,234,567", 1234567),
        ("-3/4", -0.75),
        ("0.125", 0.125),
        (".5", 0.5),
        ("$12.", 12),
        ("1e3", 1000),
        ("\u22127", -7),
        ("12,34", None),
        ("abc", None),
        ("1/0", None),
    ],
)
def test_parse_number(text, want):
    tok = parse_number(text)
    assert (tok is None) if want is None else (tok is not None and float(tok.value) == want)


def test_find_numbers_hyphen_after_a_word_is_not_a_sign():
    assert [float(t.value) for t in find_numbers("x2 is 10-5, then -2 and 50%")] == [10, 5, -2, 50]
    assert find_numbers("50%")[0].percent


# --------------------------------------------------------------------------- math_answer
def test_extract_boxed_nested_and_last():
    assert extract_boxed(r"first \boxed{1} then \boxed{\frac{a}{\sqrt{b}}} end") == r"\frac{a}{\sqrt{b}}"
    assert extract_boxed(r"\boxed{3} and an unclosed \boxed{4") == "3"
    assert extract_boxed("no box") is None


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"so the answer is \boxed{\frac{3}{4}}", "0.75"),
        (r"\boxed{\dfrac{\frac{1}{2}}{2}}", "1/4"),
        (r"x = -\frac12", "-0.5"),
        ("The total is 1,234 dollars.", "1234"),
        ("It costs $1,000,000.", "1e6"),
        (r"\boxed{-7}", "\u22127"),
        (r"\boxed{x = 5 \text{ cm}}", "5"),
        ("2 + 3 = 5, so 10 - 5 = 5", "5"),
        ("answer: 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72"),
        (r"\boxed{x+1}", "x + 1"),  # not numbers: normalised text
        (r"\boxed{0.5}", r"\frac{1}{2}"),
    ],
)
def test_math_answer_correct(completion, answer):
    res = MathAnswer()(completion, {"answer": answer})
    assert isinstance(res, RewardResult)
    assert res.reward == 1.0, res.info


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"\boxed{3} but later 4", "4"),  # the box wins over the last number
        ("1/3 is about 0.333", "1/3"),  # 0.333 != 1/3 at abs_tol 1e-6
        (r"\boxed{x+2}", "x + 1"),
        ("-5", "5"),
        ("no number here", "3"),
        (r"\boxed{50\%}", "0.5"),  # percent: strip -> 50
    ],
)
def test_math_answer_wrong(completion, answer):
    assert MathAnswer()(completion, {"answer": answer}).reward == 0.0


def test_math_answer_tolerance_and_percent_modes():
    ex = {"answer": "1/3"}
    assert MathAnswer(abs_tol=1e-3)("about 0.333", ex).reward == 1.0  # |0.333 - 1/3| = 3.3e-4
    assert MathAnswer(abs_tol=1e-4)("about 0.333", ex).reward == 0.0
    assert MathAnswer(abs_tol=0, rel_tol=0.01)("99.5", {"answer": "100"}).reward == 1.0  # 0.5 <= 1.0
    assert MathAnswer(abs_tol=0, rel_tol=0.001)("99.5", {"answer": "100"}).reward == 0.0
    assert MathAnswer(percent="fraction")(r"\boxed{50\%}", {"answer": "0.5"}).reward == 1.0
    assert MathAnswer(percent="fraction")(r"\boxed{50\%}", {"answer": "50"}).reward == 0.0
    assert MathAnswer(percent="either")("50%", {"answer": "50"}).reward == 1.0
    assert MathAnswer(percent="either")("50%", {"answer": "0.5"}).reward == 1.0


def test_math_answer_info_and_modes():
    res = MathAnswer()(r"I think \boxed{\frac{6}{8}}", {"answer": "3/4"})
    assert res.info["extracted"] == r"\frac{6}{8}" and res.info["method"] == "boxed" and res.info["value"] == 0.75
    assert extract_answer("the answer is 12", "boxed").method == "none"
    assert MathAnswer(extract="boxed")("the answer is 12", {"answer": "12"}).reward == 0.0
    assert MathAnswer(extract="last_number")(r"\boxed{3} or rather 4", {"answer": "4"}).reward == 1.0
    with pytest.raises(KeyError, match="no 'answer'"):
        MathAnswer()("12", {"solution": "12"})
    with pytest.raises(ValueError):
        MathAnswer(percent="sometimes")


# --------------------------------------------------------------------------- forecasts
def test_parse_probability():
    assert parse_probability("I'd say 0.7") == 0.7
    assert parse_probability("Out of 3 scenarios, 70% likely") == 0.7
    assert parse_probability("probability 0.2 by 2025") == 0.2  # 2025 is not in [0, 1]
    assert parse_probability("<p>0.9</p> ... confidence 0.4", pattern=r"<p>(.*?)</p>") == 0.9
    with pytest.raises(ForecastParseError):
        parse_probability("certainly, by 2030")


def test_brier_hand_computed():
    b = Brier()
    r = b("p = 0.7", {"outcome": 1})
    assert r.reward == pytest.approx(-0.09) and r.info["brier"] == pytest.approx(0.09)  # (0.7-1)^2
    assert b("20%", {"outcome": "no"}).reward == pytest.approx(-0.04)  # -(0.2-0)^2
    assert b("1.0", {"outcome": True}).reward == 0.0  # perfect: the best possible reward
    assert b("0", {"outcome": 1}).reward == -1.0  # confidently wrong: the worst
    with pytest.raises(KeyError, match="outcome"):
        b("0.5", {"y": 1})


def test_brier_skill_hand_computed():
    s = BrierSkill()  # p_ref 0.5: Brier_ref = 0.25
    assert s("0.7", {"outcome": 1}).reward == pytest.approx(1 - 0.09 / 0.25)  # 0.64
    assert s("0.5", {"outcome": 0}).reward == pytest.approx(0.0)  # no better than the reference
    assert s("0.9", {"outcome": 0}).reward == pytest.approx(1 - 0.81 / 0.25)  # -2.24
    rate = BrierSkill(p_ref_key="base_rate")  # Brier_ref = (0.2 - 1)^2 = 0.64
    assert rate("0.6", {"outcome": 1, "base_rate": 0.2}).reward == pytest.approx(1 - 0.16 / 0.64)  # 0.75
    assert BrierSkill(p_ref=0.1)("0.6", {"outcome": 1}).reward == pytest.approx(1 - 0.16 / 0.81)
    with pytest.raises(Exception, match="undefined"):
        BrierSkill(p_ref=1.0)("0.6", {"outcome": 1})


def test_unparseable_forecast_is_a_failure_not_a_zero():
    ss = samples("no idea", "0.8", outcome=1)
    stats = RewardRunner(Brier()).score(ss)
    assert stats.failed == 1 and ss[0].failed and "probability" in ss[0].error
    assert not ss[1].failed and ss[1].reward == pytest.approx(-0.04)


def test_unparsed_reward_scores_an_unreadable_forecast_instead():
    """Opt-in (issue 36 item 3): RL on a model that often answers in words needs a score for
    "no probability" that is worse than any forecast, not a masked failure; the sample then
    reports no forecast, so calibration leaves it out."""
    for reward in (Brier(unparsed_reward=-1.0), BrierSkill(unparsed_reward=-3.0)):
        ss = samples("no idea", "0.8", outcome=1)
        assert RewardRunner(reward).score(ss).failed == 0
        assert ss[0].reward == reward.unparsed_reward and "p" not in ss[0].reward_info
        assert ss[0].reward_info["unparsed"] == 1.0 and "no probability" in ss[0].feedback
        assert ss[1].reward_info["p"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="outcome"):  # a bad outcome still fails, parsed or not
        Brier(unparsed_reward=-1.0)("no idea", {"outcome": 7})


# --------------------------------------------------------------------------- retrieval
def test_cited_ids_and_recall_minus_cost():
    text = "See [doc3] and [doc1]; also [doc3] again and [DOC7]."
    assert cited_ids(text) == ["doc3", "doc1"]
    r = RetrievalRecall(cost_coef=0.001, cost_unit="chars")
    res = r(text, {"gold_ids": ["doc1", "doc2", "doc7", "doc3"]})
    # recall: doc1, doc3 of 4 gold -> 0.5 ([DOC7] does not match the lower-case pattern)
    assert res.info["recall"] == 0.5 and res.info["cost"] == len(text) == 52
    assert res.reward == pytest.approx(0.5 - 0.052)
    words = RetrievalRecall(cost_coef=0.01, cost_unit="words", pattern=r"\[(\w+)\]")
    res = words(text, {"gold_ids": "doc1, doc7"})  # ids compared case-insensitively: DOC7 counts; 9 words
    assert res.info["recall"] == 1.0 and res.info["cost"] == 9 and res.reward == pytest.approx(1.0 - 0.01 * 9)


def test_retrieval_token_cost_and_errors():
    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": list(range(len(text.split()))) * 2}  # 2 tokens per word

    r = RetrievalRecall(cost_coef=0.1, cost_unit="tokens", tokenizer=Tok())
    assert r("[doc1] ok", {"gold_ids": ["doc1"]}).reward == pytest.approx(1.0 - 0.1 * 4)
    with pytest.raises(ValueError, match="tokenizer"):
        RetrievalRecall(cost_unit="tokens")
    with pytest.raises(ValueError, match="empty"):
        RetrievalRecall()("[doc1]", {"gold_ids": []})


# --------------------------------------------------------------------------- weighted
def test_weighted_by_registry_spec():
    spec = {
        "name": "weighted",
        "rewards": [{"name": "exact_match", "weight": 0.8}, {"name": "math_answer", "weight": 0.2, "abs_tol": 0.01}],
    }
    w = get_registry().build("reward", spec, "reward")
    assert isinstance(w, WeightedReward) and not isinstance(w, AsyncWeightedReward)
    res = w(r"\boxed{3.001}", {"answer": "3"})  # exact 0, math 1 (within 0.01)
    assert res.reward == pytest.approx(0.2) and res.info["components"] == {"exact_match": 0.0, "math_answer": 1.0}
    assert w("3", {"answer": "3"}).reward == pytest.approx(1.0)


def test_weighted_objects_normalize_and_duplicates():
    w = weighted([(lambda c, e: 1.0, 3.0), {"reward": lambda c, e: 0.0, "weight": 1.0}], normalize=True)
    assert w("x", {}).reward == pytest.approx(0.75)
    w = weighted(["exact_match", {"name": "exact_match", "weight": 2.0, "case_sensitive": False}])
    res = w("ABC", {"answer": "abc"})
    assert res.reward == 2.0 and set(res.info["components"]) == {"exact_match", "exact_match#2"}


def test_weighted_fails_if_any_component_fails():
    def boom(c, e):
        raise RuntimeError("checker crashed")

    w = weighted([("exact_match", 0.5), (boom, 0.5)])
    w_nan = weighted([("exact_match", 0.5), (lambda c, e: math.nan, 0.5)])
    ss = samples("a", answer="a")
    stats = RewardRunner(w).score(ss)
    assert stats.failed == 1 and ss[0].failed and "boom" in ss[0].error and "checker crashed" in ss[0].error
    ss = samples("a", answer="a")
    assert RewardRunner(w_nan).score(ss).failed == 1 and "not a finite number" in ss[0].error


def test_weighted_with_async_component_is_async():
    async def half(c, e):
        return 0.5

    w = weighted([("exact_match", 1.0), (half, 2.0)])
    assert isinstance(w, AsyncWeightedReward)
    ss = samples("a", "b", answer="a")
    assert RewardRunner(w).score(ss).scored == 2
    assert [s.reward for s in ss] == [2.0, 1.0]


def test_weighted_bad_entries():
    with pytest.raises(ValueError, match="empty"):
        weighted([])
    with pytest.raises(ValueError, match=r"rewards\[0\]"):
        weighted([{"weight": 1.0}])
    with pytest.raises(ValueError, match=r"rewards\[0\]\.weight"):
        weighted([{"name": "exact_match", "weight": "heavy"}])


# --------------------------------------------------------------------------- feedback
def test_exact_match_says_what_it_expected_and_stays_a_float():
    em = get_registry().build("reward", "exact_match")
    miss = em(" 41\n", {"answer": "42"})
    assert miss == 0.0 and float(miss) + 1 == 1.0 and miss.feedback == "expected '42', got '41'"
    assert em("   ", {"answer": "42"}).feedback == "expected '42', got nothing"
    long = em("7" * 200, {"answer": "42"}).feedback
    assert long == "expected '42', got '" + "7" * 77 + "...'"  # never the whole completion
    hit = em("42", {"answer": "42"})
    assert hit == 1.0 and getattr(hit, "feedback", None) is None


def test_math_answer_feedback_names_the_extracted_answer():
    ma = get_registry().build("reward", "math_answer")
    assert ma("12 + 30 = 41, so the answer is 41.", {"answer": "42"}).feedback == "expected '42', got '41'"
    assert ma("I do not know", {"answer": "42"}).feedback == "no final answer found; expected '42'"
    boxed = get_registry().build("reward", {"name": "math_answer", "extract": "boxed"})
    assert boxed("41", {"answer": "#### 42"}).feedback == "no final answer found in a \\boxed{}; expected '42'"
    assert ma(r"\boxed{42}", {"answer": "42"}).feedback is None


def test_answer_match_and_retrieval_recall_feedback():
    am = get_registry().build("reward", "answer_match")
    assert am("Kam [d3].", {"answer": "var"}).feedback == "expected 'var', got 'kam'"
    assert am("Var [d3].", {"answer": "var"}).feedback is None
    rr = get_registry().build("reward", {"name": "retrieval_recall", "pattern": r"\[(d\d+)\]"})
    assert (
        rr("var [d3]", {"gold_ids": ["d3", "d12", "d7"]}).feedback
        == "cited 1 of 3 supporting documents; missing d12, d7"
    )
    assert rr("var [d3]", {"gold_ids": ["d3"]}).feedback is None


def test_weighted_joins_its_parts_feedback_with_their_names():
    w = get_registry().build(
        "reward",
        {
            "name": "weighted",
            "rewards": [
                {"name": "exact_match", "weight": 0.5},
                {"name": "math_answer", "weight": 0.5},
                {"reward": lambda c, e: {"reward": 1.0, "feedback": "tidy"}, "weight": 0.0},
            ],
        },
        "reward",
    )
    res = w("41", {"answer": "42"})
    assert res.reward == 0.0
    assert res.feedback == "exact_match: expected '42', got '41'\nmath_answer: expected '42', got '41'\n<lambda>: tidy"
    assert w("42", {"answer": "42"}).feedback == "<lambda>: tidy"
    bad = weighted([(lambda c, e: {"reward": 1.0, "feedback": ["no"]}, 1.0)])
    with pytest.raises(RewardError, match=r"^weighted: component '<lambda>' returned feedback \['no'\] of type list"):
        bad("x", {})
