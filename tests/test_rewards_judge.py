"""llm_judge: reply parsing, the prompt template, a fake OpenAI-compatible server on 127.0.0.1
(real HTTP: retries, auth header, request shape) and a fake sampler object (batched calls)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from tempering.plugins.rewards.judge import JudgeParseError, LLMJudge, critique, parse_binary, parse_graded
from tempering.registry import get_registry
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample, SamplingParams


def mk(texts, **example) -> list[Sample]:
    return [Sample(example=dict(example), completion=Completion([], [], [], text=t)) for t in texts]


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "reply, want",
    [
        ("The steps are right. Score: 7/10", 0.7),
        ("**Score:** 8", 0.8),
        ("score = 3 out of 4", 0.75),
        ("Rating: 85%", 0.85),
        ("I'd give it 9/10.", 0.9),
        (" 6 ", 0.6),
        ("Score: 2/10 ... final Score: 10/10", 1.0),
    ],
)
def test_parse_graded(reply, want):
    assert parse_graded(reply) == pytest.approx(want)


def test_parse_graded_scale_and_failures():
    assert parse_graded("Score: 0.8", scale=1.0) == pytest.approx(0.8)
    assert parse_graded("Score: 4", scale=5) == pytest.approx(0.8)
    for bad in ["I cannot grade this.", "Score: 11/10", "Score: -1/10", ""]:
        with pytest.raises(JudgeParseError):
            parse_graded(bad)


@pytest.mark.parametrize(
    "reply, want",
    [
        ("Verdict: YES", 1.0),
        ("The maths is correct but... Verdict: **NO**", 0.0),
        ("Yes, it matches.", 1.0),
        ("No. The answer is 5.", 0.0),
        ("The response is not correct", 0.0),
        ("It is incorrect.", 0.0),
        ("Checked every step: correct", 1.0),
    ],
)
def test_parse_binary(reply, want):
    assert parse_binary(reply) == want


def test_parse_binary_failure():
    with pytest.raises(JudgeParseError):
        parse_binary("Hmm, hard to say; it depends.")


def test_template_rendering_and_checks():
    j = LLMJudge(base_url="http://127.0.0.1:9/v1", template="Q={prompt} A={completion} R={reference} T={topic}")
    assert j.render("42", {"prompt": "6*7?", "answer": "42", "topic": "maths"}) == "Q=6*7? A=42 R=42 T=maths"
    assert "(no reference answer given)" in j.render("42", {"prompt": "6*7?", "topic": "t"})
    with pytest.raises(KeyError, match=r"\{topic\}"):
        j.render("42", {"prompt": "6*7?"})
    msgs = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "What is 2+2?"}]}
    assert LLMJudge(base_url="http://x", template="{prompt}|{completion}").render("4", msgs) == "What is 2+2?|4"
    with pytest.raises(ValueError, match="exactly one"):
        LLMJudge()
    with pytest.raises(ValueError, match="completion"):
        LLMJudge(base_url="http://x", template="{prompt}")
    with pytest.raises(ValueError, match="mode"):
        LLMJudge(base_url="http://x", mode="vibes")


# --------------------------------------------------------------------------- OpenAI-compatible HTTP
class _FakeOpenAI:
    """/v1/chat/completions: grades by what the judge prompt says; fails the first
    ``fail_first`` requests with a 500."""

    requests: list = []
    fail_first = 0

    @classmethod
    def answer(cls, call):
        from tempering.runs.serving import Reply

        body = call.json
        cls.requests.append({"path": call.path, "auth": call.headers.get("authorization"), "body": body})
        if cls.fail_first > 0:
            cls.fail_first -= 1
            return Reply(500, {"error": "overloaded"})
        prompt = body["messages"][-1]["content"]
        if "GOOD" in prompt:
            text = "Looks right. Score: 9/10"
        elif "MEH" in prompt:
            text = "Partly. Score: 4/10"
        elif "YESNO" in prompt:
            text = "Verdict: YES"
        else:
            text = "I am not sure what to say."
        return Reply(
            200,
            {
                "id": "x",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
            },
        )


@pytest.fixture
def openai_url(json_server):
    _FakeOpenAI.requests, _FakeOpenAI.fail_first = [], 0
    return json_server(_FakeOpenAI.answer) + "/v1"


def test_http_judge_graded(openai_url):
    judge = get_registry().build(
        "reward",
        {
            "name": "llm_judge",
            "base_url": openai_url,
            "model": "judge-7b",
            "api_key": "sk-test",
            "system_prompt": "Be strict.",
            "backoff": 0.01,
        },
    )
    ss = mk(["GOOD answer", "MEH answer", "rambling"], prompt="What is 6*7?", answer="42")
    stats = RewardRunner(judge).score(ss)
    assert (stats.scored, stats.failed) == (2, 1)
    assert [s.reward for s in ss[:2]] == pytest.approx([0.9, 0.4])
    assert ss[0].reward_info["judge_reply"] == "Looks right. Score: 9/10"
    assert [s.feedback for s in ss[:2]] == ["Looks right.", "Partly."]  # the critique, without its score
    assert ss[2].failed and "JudgeParseError" in ss[2].error  # unparseable: a failure, not a 0
    req = _FakeOpenAI.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert req["body"]["model"] == "judge-7b" and req["body"]["temperature"] == 0.0
    assert req["body"]["messages"][0] == {"role": "system", "content": "Be strict."}
    user = req["body"]["messages"][1]["content"]
    assert "What is 6*7?" in user and "42" in user and "Score: N/10" in user


def test_http_judge_binary_with_retries(openai_url):
    _FakeOpenAI.fail_first = 2
    judge = LLMJudge(mode="binary", base_url=openai_url, retries=2, backoff=0.01, template="YESNO {completion}")
    ss = mk(["whatever"])
    assert RewardRunner(judge).score(ss).scored == 1 and ss[0].reward == 1.0
    assert len(_FakeOpenAI.requests) == 3  # two 500s, then the answer
    _FakeOpenAI.fail_first = 5
    ss = mk(["whatever"])
    assert (
        RewardRunner(
            LLMJudge(mode="binary", base_url=openai_url, retries=1, backoff=0.01, template="YESNO {completion}")
        )
        .score(ss)
        .failed
        == 1
    )
    assert "HTTP 500" in ss[0].error


def test_http_judge_unreachable_is_a_failure():
    judge = LLMJudge(base_url="http://127.0.0.1:9/v1", retries=1, backoff=0.01, timeout=1.0)
    ss = mk(["x"], prompt="p")
    assert RewardRunner(judge).score(ss).failed == 1 and "ConnectError" in ss[0].error


# --------------------------------------------------------------------------- a sampler object
class CharTokenizer:
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


class FakeSampler:
    """The backend interface: ``sample(prompts, n, params) -> Future[list[list[Completion]]]``.
    Replies with the token ids of a scripted text (``text`` left empty, so the judge decodes)."""

    def __init__(self, replies):
        self.tokenizer = CharTokenizer()
        self.replies = replies
        self.calls = []
        self.pool = concurrent.futures.ThreadPoolExecutor(1)

    def sample(self, prompts, num_samples, params):
        assert isinstance(params, SamplingParams) and num_samples == 1
        self.calls.append((len(prompts), params))

        def run():
            out = []
            for p in prompts:
                text = self.tokenizer.decode(p)
                reply = next(r for key, r in self.replies.items() if key in text)
                out.append(
                    [
                        Completion(
                            prompt_tokens=p,
                            tokens=[ord(c) for c in reply],
                            logprobs=[0.0] * len(reply),
                            stop_reason="stop",
                        )
                    ]
                )
            return out

        return self.pool.submit(run)


def test_sampler_judge_batches_calls_and_decodes():
    sampler = FakeSampler({"GOOD": "Score: 8/10", "BAD": "Score: 1/10", "ODD": "no idea"})
    judge = LLMJudge(sampler=sampler, max_tokens=64, batch_size=16)
    ss = mk(["GOOD", "BAD", "GOOD", "ODD", "BAD"], prompt="Explain.", answer="ref")
    stats = RewardRunner(judge).score(ss)
    assert (stats.scored, stats.failed) == (4, 1) and ss[3].failed and "JudgeParseError" in ss[3].error
    assert [s.reward for s in ss if not s.failed] == pytest.approx([0.8, 0.1, 0.8, 0.1])
    assert len(sampler.calls) == 1 and sampler.calls[0][0] == 5  # one sample() call for the batch
    params = sampler.calls[0][1]
    assert params.max_tokens == 64 and params.temperature == 0.0


def test_sampler_judge_in_a_weighted_reward_and_binary():
    sampler = FakeSampler({"JUDGE GOOD": "Yes, this is right.", "JUDGE BAD": "No."})
    judge = LLMJudge(mode="binary", sampler=sampler, template="JUDGE {completion} (reference: {answer})")
    w = get_registry().build(
        "reward",
        {"name": "weighted", "rewards": [{"name": "exact_match", "weight": 0.5}, {"reward": judge, "weight": 0.5}]},
    )
    ss = mk(["GOOD", "BAD"], prompt="p", answer="GOOD")
    assert RewardRunner(w).score(ss).scored == 2
    assert [s.reward for s in ss] == [1.0, 0.0]  # 0.5*1 + 0.5*1 ; 0.5*0 + 0.5*0
    assert ss[0].reward_info["components"] == {"exact_match": 1.0, "LLMJudge": 1.0}
    # the judge's words are feedback; a bare "No." says nothing beyond the verdict
    assert [s.feedback for s in ss] == ["LLMJudge: Yes, this is right.", "exact_match: expected 'GOOD', got 'BAD'"]

    # a sampler whose sample() returns a plain list (no future) works too
    class Sync(FakeSampler):
        def sample(self, prompts, n, params):
            return super().sample(prompts, n, params).result()

    ss = mk(["GOOD"], prompt="p")
    assert asyncio.run(LLMJudge(mode="binary", sampler=Sync({"GOOD": "yes"}))("GOOD", {"prompt": "p"})).reward == 1.0


@pytest.mark.parametrize(
    "reply, said",
    [
        ("The answer omits the units.\nScore: 6/10", "The answer omits the units."),
        ("**Score:** 7/10", None),
        ("The sum is wrong: 3+4 is 7.\n\nVerdict: NO", "The sum is wrong: 3+4 is 7."),
        ("No.", None),
        ("7", None),
        ("x" * 700 + "\nScore: 1/10", "x" * 497 + "..."),
    ],
)
def test_the_critique_is_the_reply_without_its_score(reply, said):
    assert critique(reply) == said
