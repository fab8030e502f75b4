"""llm_judge with a real sampler: the local backend's tiny Llama as the judge model.

The oracle is the backend itself: the same judge prompts sampled greedily in one direct
``sample`` call must give exactly the replies (and so the scores or failures) the judge saw.
"""

from __future__ import annotations

import pytest

from tempering.plugins.rewards.judge import JudgeParseError, LLMJudge, parse_graded
from tempering.rollouts.scoring import RewardRunner
from tempering.types import Completion, Sample, SamplingParams


@pytest.fixture(scope="module")
def backend():
    from tempering.plugins.backends.local.backend import LocalBackend

    return LocalBackend("tiny_llama", num_threads=1, seed=0)


def test_judge_on_the_local_backend_matches_direct_sampling(backend):
    # the tiny model's tokenizer only knows "0123456789+= ": a template in that alphabet
    judge = LLMJudge(sampler=backend, template="{prompt}{completion}=", max_tokens=3, scale=999)
    examples = [{"prompt": f"{i}+"} for i in range(6)]
    ss = [Sample(example=e, completion=Completion([], [], [], text=str(7 * i))) for i, e in enumerate(examples)]
    stats = RewardRunner(judge).score(ss)
    assert stats.scored + stats.failed == 6

    prompts = [judge.render(s.completion.text, s.example) for s in ss]
    assert prompts[2] == "2+14="
    ids = [backend.tokenizer(p, add_special_tokens=True)["input_ids"] for p in prompts]
    direct = backend.sample(ids, 1, SamplingParams(max_tokens=3, temperature=0.0)).result()
    for s, comps in zip(ss, direct):
        reply = comps[0].text
        try:
            want = parse_graded(reply, 999)
        except JudgeParseError:
            assert s.failed and "JudgeParseError" in s.error
        else:
            assert not s.failed and s.reward == pytest.approx(want) and s.reward_info["judge_reply"] == reply
