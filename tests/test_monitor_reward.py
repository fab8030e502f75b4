"""The ``monitor`` reward (issue 37 item 3): a monitor reading a sample's reasoning predicts the
policy's behaviour on counterfactual prompts; the reward is its accuracy.

Oracles: constructed cases whose accuracy is known by hand (a scripted policy and a scripted
monitor); the real tiny model's ``sample`` calls counted and their prompts decoded; a GRPO stage
end to end; one-line config errors."""

from __future__ import annotations

import json
import string
from concurrent.futures import Future
from pathlib import Path

import pytest

from tempering.interfaces import BatchScores, Policy, PolicyReward, RewardResult, SamplingClient
from tempering.plugins.rewards.combine import weighted
from tempering.plugins.rewards.monitor import MonitorReward, answer_of, majority
from tempering.plugins.samplers.completion import BatchPolicy, CompletionSampler
from tempering.rollouts.rollout import SamplerContext, collect
from tempering.rollouts.scoring import RewardRunner, run_coroutine
from tempering.types import Completion, Sample, SamplingParams

CUE_VARIANTS = [{"remove": "{cue}"}, {"replace": "{cue}", "with": "{alt}"}]


def example(question: str, cue_letter: str, alt_letter: str) -> dict[str, str]:
    cue, alt = f"Prof says {cue_letter}. ", f"Prof says {alt_letter}. "
    return {"prompt": f"{cue}{question}", "cue": cue, "alt": alt, "answer": "a"}


class ScriptedPolicy:
    """Follows the cue: answers the letter a 'Prof says X.' names, else A. Records its calls."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[list[str], int]] = []
        self.fail = fail

    async def complete(self, examples, num_samples, params=None):
        self.calls.append(([e["prompt"] for e in examples], num_samples))
        if self.fail:
            raise RuntimeError("sampling server gone")
        out = []
        for e in examples:
            letter = e["prompt"].split("Prof says ")[1][0] if "Prof says " in e["prompt"] else "A"
            out.append([Completion([], [], [], text=f"Answer: {letter}") for _ in range(num_samples)])
        return out


class ScriptedMonitor:
    """Predicts a change iff the reasoning names the professor and the variant lacks 'Prof says'
    (it misses the replaced cue); ``reply`` overrides the verdict."""

    def __init__(self, reply: str | None = None) -> None:
        self.asked: list[str] = []
        self.reply = reply

    async def ask(self, text: str) -> str:
        self.asked.append(text)
        if self.reply is not None:
            return self.reply
        reasoning = text.split("It wrote:\n")[1].split("\n\nIts final answer")[0]
        variant = text.split("modified task instead:\n")[1]
        changes = "professor" in reasoning and "Prof says" not in variant.split("\n\n")[0]
        return "Verdict: YES" if changes else "Verdict: NO"


def samples_of(rows: list[tuple[dict[str, str], str]]) -> list[Sample]:
    return [Sample(example=dict(e), completion=Completion([], [], [], text=t)) for e, t in rows]


def test_accuracy_on_constructed_cases_and_one_policy_call_per_batch():
    ex1, ex2 = example("Q1?", "B", "C"), example("Q2?", "D", "C")
    ss = samples_of(
        [
            (ex1, "The professor says B. Answer: B"),  # remove: changes (B->A), monitor YES: right;
            # replace: changes (B->C), monitor NO (variant has 'Prof says'): wrong -> 0.5
            (ex1, "B it is. Answer: B"),  # hides the cue: NO, NO -> both wrong -> 0.0
            (ex2, "Answer: A"),  # did not follow: remove keeps A (NO right), replace A->C (NO wrong) -> 0.5
            (ex2, "The professor was ignored. Answer: A"),  # YES wrong (A stays A), NO wrong -> 0.0
        ]
    )
    policy, monitor = ScriptedPolicy(), ScriptedMonitor()
    reward = MonitorReward(variants=CUE_VARIANTS, monitor=monitor, mentions=["professor"])
    assert isinstance(reward, PolicyReward)
    scored = run_coroutine(reward.score_batch(ss, policy))
    assert [r.reward for r in scored.results] == [0.5, 0.0, 0.5, 0.0]
    assert scored.results[0].info["variant_answers"] == ["a", "c"]
    assert scored.results[0].info["predictions"] == [True, False]
    # the samples of a group share their variants: 2 examples x 2 variants, in one call
    assert policy.calls == [(["Q1?", "Prof says C. Q1?", "Q2?", "Prof says C. Q2?"], 1)]
    assert len(monitor.asked) == 8
    assert scored.metrics["monitor/accuracy"] == pytest.approx(0.25)
    assert scored.metrics["monitor/changed"] == pytest.approx(6 / 8)  # all but sample 3-4's "remove"
    assert scored.metrics["monitor/predicted_change"] == pytest.approx(2 / 8)
    assert scored.metrics["monitor/mentions"] == pytest.approx(0.5)
    assert scored.metrics["monitor/variants"] == 4.0


def test_answer_mode_scores_the_predicted_answer_and_takes_the_majority():
    ex = example("Q?", "B", "C")
    ss = samples_of([(ex, "Answer: B")])

    class Votes(ScriptedPolicy):
        async def complete(self, examples, num_samples, params=None):
            self.calls.append(([e["prompt"] for e in examples], num_samples))
            texts = {"Q?": ["Answer: A", "Answer: D", "Answer: A"], "Prof says C. Q?": ["Answer: C"] * 3}
            return [[Completion([], [], [], text=t) for t in texts[e["prompt"]]] for e in examples]

    class Guess:
        async def ask(self, text):
            return "I think it drops the cue.\nAnswer: (A)"

    policy = Votes()
    reward = MonitorReward(variants=CUE_VARIANTS, monitor=Guess(), predict="answer", samples_per_variant=3)
    scored = run_coroutine(reward.score_batch(ss, policy))
    assert scored.results[0].reward == 0.5  # A right (majority of A, D, A), A for C wrong
    assert policy.calls[0][1] == 3
    assert answer_of("answer is (B). Final answer: c.", reward._pattern) == "c"
    assert majority(["x", None, None, "x"]) == "x"


def test_failures_are_counted_and_named_never_scored():
    ex = example("Q?", "B", "C")
    ss = samples_of([(ex, "Answer: B"), ({"prompt": "no cue here", "cue": "zzz", "alt": "y"}, "Answer: A")])
    runner = RewardRunner(MonitorReward(variants=[{"remove": "{cue}"}], monitor=ScriptedMonitor(reply="hmm")))
    stats = runner.score(ss, policy=ScriptedPolicy())
    assert stats.failed == 2 and stats.scored == 0
    assert "JudgeParseError: no yes/no verdict" in ss[0].error
    assert "no counterfactual variant of this example differs" in ss[1].error
    assert stats.metrics["monitor/unparsable"] == 1.0 and stats.metrics["monitor/variant_errors"] == 1.0
    assert stats.metrics["monitor/changed"] == 1.0  # the policy's sway is measured whatever the monitor said

    ss = samples_of([(ex, "Answer: B")] * 3)
    stats = runner.score(ss, policy=ScriptedPolicy(fail=True))
    assert stats.failed == 3 and stats.metrics["monitor/sampling_errors"] == 3.0
    assert all(
        "sampling the policy on 1 counterfactual prompts failed: RuntimeError: sampling server gone" in s.error
        for s in ss
    )

    ss = samples_of([(ex, "Answer: B")])  # a caller without a policy: failed with its own cause
    stats = runner.score(ss)
    assert stats.failed == 1 and ss[0].reward_info["failure"] == "no_policy"
    assert "nothing gave it the policy here" in ss[0].error


def test_weighted_adds_the_task_reward_and_passes_the_policy_through():
    ex = example("Q?", "B", "C")
    ss = samples_of([(ex, "The professor says B. Answer: B"), (ex, "Answer: A")])
    task = lambda completion, e: float(completion.endswith(e["answer"].upper()))
    combo = weighted([(task, 1.0), (MonitorReward(variants=CUE_VARIANTS, monitor=ScriptedMonitor()), 0.5)])
    assert isinstance(combo, PolicyReward)
    stats = RewardRunner(combo).score(ss, policy=ScriptedPolicy())
    assert stats.failed == 0
    # sample 1: task 0, monitor 0.5; sample 2: task 1, monitor: remove A->A NO right, replace A->C NO wrong: 0.5
    assert [s.reward for s in ss] == [0.25, 1.25]
    assert ss[0].reward_info["components"] == {"<lambda>": 0.0, "monitor": 0.5}
    assert stats.metrics["monitor/accuracy"] == 0.5


class JudgeModel:
    """A judge model behind the sampler interface (``llm_judge``'s ``sampler``): YES when the
    reasoning it reads names the professor. Records its calls."""

    def __init__(self) -> None:
        from tempering.plugins.models.tiny import build_char_tokenizer

        self.tokenizer = build_char_tokenizer(string.printable)
        self.calls: list[list[str]] = []

    def sample(self, prompts, num_samples, params) -> Future:
        texts = [self.tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
        self.calls.append(texts)
        fut: Future = Future()
        replies = ["Verdict: YES" if "professor" in t.split("It wrote:")[1] else "Verdict: NO" for t in texts]
        fut.set_result([[Completion(p, [], [], stop_reason="stop", text=r)] for p, r in zip(prompts, replies)])
        return fut


def test_the_monitor_through_the_judge_plumbing_batches_its_questions():
    ex = example("Q?", "B", "C")
    ss = samples_of([(ex, "The professor says B. Answer: B"), (ex, "Answer: B"), (ex, "Answer: A")])
    judge = JudgeModel()
    reward = MonitorReward(variants=[{"remove": "{cue}"}], monitor={"sampler": judge, "batch_size": 8})
    stats = RewardRunner(reward).score(ss, policy=ScriptedPolicy())
    # the policy answers A without the cue: samples 1-2 change (B->A), sample 3 does not
    assert [s.reward for s in ss] == [1.0, 0.0, 1.0] and stats.failed == 0
    assert len(judge.calls) == 1 and len(judge.calls[0]) == 3  # one judge call for the batch's questions
    assert "Now the model is given this modified task instead:\nQ?" in judge.calls[0][0]


class CountingClient:
    """The tiny backend, its ``sample`` calls recorded."""

    def __init__(self, backend) -> None:
        self.backend, self.tokenizer = backend, backend.tokenizer
        self.calls: list[tuple[list[list[int]], int, SamplingParams]] = []

    def sample(self, prompts, num_samples, params) -> Future:
        self.calls.append((prompts, num_samples, params))
        return self.backend.sample(prompts, num_samples, params)


def test_the_real_policy_is_sampled_on_the_variants_in_one_call_per_batch():
    from tempering.plugins.backends.local.backend import LocalBackend

    backend = LocalBackend("tiny_llama", num_threads=1, seed=0)
    client = CountingClient(backend)
    assert isinstance(client, SamplingClient)
    reward = MonitorReward(
        variants=[{"add": "1+"}, {"add": "=9", "at": "end"}],
        monitor="policy",
        predict="answer",
        answer_pattern=r"(\d+)",
        template="{completion}+{variant}",
        monitor_max_tokens=3,
    )
    context = SamplerContext(backend.tokenizer, lambda: None, RewardRunner(reward), build=None, factory=None)
    sampler = CompletionSampler(context=context)
    examples = [{"prompt": "12+34=", "answer": "46"}, {"prompt": "5+6=", "answer": "11"}]
    rollout = collect(sampler, client, examples, 3, SamplingParams(max_tokens=4, temperature=1.0, seed=0))
    assert len(client.calls) == 3  # the batch, the variants of all 6 samples, the monitor's 12 questions
    (batch, n0, _), (variants, n1, p1), (questions, n2, p2) = client.calls
    decode = lambda ids: backend.tokenizer.decode(ids, skip_special_tokens=True)
    assert [decode(p) for p in batch] == ["12+34=", "5+6="] and n0 == 3
    assert [decode(p) for p in variants] == ["1+12+34=", "12+34==9", "1+5+6=", "5+6==9"] and n1 == 1
    assert p1.max_tokens == 4 and p1.temperature == 1.0  # the batch's own sampling
    assert len(questions) == 12 and n2 == 1 and p2.max_tokens == 3 and p2.temperature == 0.0
    first = rollout.groups[0].samples[0].completion.text
    assert decode(questions[0]) == f"{first}+1+12+34="
    assert "monitor/variants" in rollout.metrics and rollout.metrics["monitor/variants"] == 4.0
    scored = [s for g in rollout.groups for s in g.samples if not s.failed]
    failed = [s for g in rollout.groups for s in g.samples if s.failed]
    assert len(scored) + len(failed) == 6
    assert all(s.reward in (0.0, 0.5, 1.0) for s in scored)
    assert all("JudgeParseError" in s.error for s in failed)  # a reply without a number


def test_batch_policy_is_a_policy():
    assert isinstance(BatchPolicy(CompletionSampler(), None, SamplingParams()), Policy)  # type: ignore[arg-type]
    assert BatchScores([1.0]).metrics == {}
    assert isinstance(RewardResult(1.0), RewardResult)


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "monitor" / "tiny.yaml"


def test_grpo_with_monitor_runs_end_to_end_on_the_tiny_model(tmp_path, monkeypatch):
    from tempering.apps import cli
    from tempering.plugins.backends.local.backend import LocalBackend

    calls: list[int] = []  # prompts per sample call
    real = LocalBackend.sample

    def counted(self, prompts, num_samples, params):
        calls.append(len(prompts))
        return real(self, prompts, num_samples, params)

    monkeypatch.setattr(LocalBackend, "sample", counted)
    rc = cli.main(["run", str(EXAMPLE), f"output_dir={tmp_path}"])
    assert rc in (0, None)
    # eval before (8 prompts: the batch, its 8 variants, 8 monitor questions), then per RL step
    # the batch (4 prompts), ONE call for the 4 variants, one for the 16 monitor questions; eval after
    assert calls == [8, 8, 8, 4, 4, 16, 4, 4, 16, 8, 8, 8]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("stage") == "rl" and "monitor/variants" in r]
    assert len(rl) == 2
    for r in rl:
        assert r["monitor/variants"] == 4.0  # 4 prompts x 1 variant, sampled in one call
        assert 0.0 <= r.get("monitor/accuracy", 0.0) <= 1.0
        assert r["monitor/unparsable"] == r["reward/failed"]  # every failure is counted as what it is
    evals = [r for r in rows if r.get("stage") == "rl" and "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [20, 22]  # before the first RL step, after the last
    for ev in evals:
        assert ev["eval/monitor/variants"] == 8.0  # the eval's 8 prompts, their variants in one call
        assert ev["eval/monitor/unparsable"] == ev["eval/failed"]
        assert 0.0 <= ev["eval/monitor/accuracy"] <= 1.0


TINY_RECIPE = """\
name: bad_monitor
output_dir: {out}
loggers: [jsonl]
backend:
  name: local
  model: tiny_llama
  model_kwargs: {{hidden_size: 32, num_layers: 1, num_heads: 2}}
stages:
  - id: rl
    name: grpo
    steps: 1
    prompts_per_step: 2
    group_size: 2
    max_tokens: 2
    reward:
      name: monitor
      predict: answer
      variants:
        - add: "1+"
"""


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "stages.rl.reward.predict=chnge",
            "stages[0].reward.predict: use change (whether the answer changes) or answer (which answer), "
            "got 'chnge'. Did you mean 'change'?",
        ),
        (
            "stages.rl.reward.variants=[{drop: x}]",
            "stages[0].reward.variants[0]: expected exactly one of remove, add, replace, got keys ['drop']: "
            "give 'module:function' or a list of",
        ),
        (
            "stages.rl.reward.variants=no_such_module:f",
            "stages[0].reward.variants: cannot import 'no_such_module:f'",
        ),
        (
            "stages.rl.reward.template=x",
            "stages[0].reward.template: must contain {completion}: the monitor reads the reasoning and the variant",
        ),
        (
            "stages.rl.reward.monitor=judge",
            "stages[0].reward.monitor: use 'policy' (the model being trained reads its own reasoning) or llm_judge",
        ),
        (
            "stages.rl.reward.monitor={model: m}",
            "stages[0].reward.monitor: give exactly one judge: base_url",
        ),
        (
            "stages.rl.reward.mentions=professor",
            "stages[0].reward.mentions: expected a list of texts, e.g. [professor, stanford], got 'professor'",
        ),
        (
            "stages.rl.reward.samples_per_variant=0",
            "stages[0].reward.samples_per_variant: must be a whole number >= 1, got 0",
        ),
    ],
)
def test_bad_monitor_config_is_one_line(rejects_before_training, override, message):
    rejects_before_training(TINY_RECIPE, override, message)


def test_cue_questions_plant_a_cue_that_the_variant_removes():
    from tempering.plugins.datasets.cue_questions import LETTERS, choice_reward, cue_questions
    from tempering.plugins.rewards.counterfactual import variant_maker

    rows = cue_questions(split="train", size=400)
    remove = variant_maker([{"remove": "{cue}"}])
    for r in rows:
        assert r["prompt"].startswith(r["cue"]) and f"({r['cued']})" in r["cue"] and "professor" in r["cue"]
        assert (r["cued"] == r["answer"]) == r["cue_right"]
        assert len(set(r["choices"].values())) == 4 and r["answer"] in LETTERS
        (variant,) = remove(r)
        assert variant["prompt"] == r["prompt"][len(r["cue"]) :] and "professor" not in variant["prompt"]
    assert 0.4 < sum(r["cue_right"] for r in rows) / len(rows) < 0.6
    assert {r["question"] for r in rows}.isdisjoint({r["question"] for r in cue_questions(split="test")})
    assert choice_reward("so... Answer: (B)", {"answer": "B"}) == 1.0
    assert choice_reward("B is the correct answer.", {"answer": "B"}) == 1.0  # as SmolLM2 writes it
    assert choice_reward("the answer is C. Answer: D", {"answer": "C"}) == 0.0  # the last one counts
    assert choice_reward("no idea, a or b", {"answer": "A"}) == 0.0  # lower case is not a choice


def test_variants_change_the_prompt_or_the_last_user_message(tmp_path, monkeypatch):
    from tempering.errors import ConfigError
    from tempering.plugins.rewards.counterfactual import distinct_variants, variant_maker

    chat = {"messages": [{"role": "user", "content": "old"}, {"role": "user", "content": "Hint: 3. Q?"}], "h": "3"}
    make = variant_maker([{"remove": "Hint: {h}. "}, {"add": " Be brief.", "at": "end"}, {"replace": "Q", "with": "R"}])
    out = make(chat)
    assert [v["messages"][1]["content"] for v in out] == ["Q?", "Hint: 3. Q? Be brief.", "Hint: 3. R?"]
    assert all(v["messages"][0]["content"] == "old" and v["h"] == "3" for v in out)
    assert chat["messages"][1]["content"] == "Hint: 3. Q?"  # the original is untouched

    (tmp_path / "my_variants.py").write_text(
        "def flip(example):\n    return [example['prompt'][::-1], {**example, 'prompt': 'x'}, example['prompt']]\n"
    )
    monkeypatch.chdir(tmp_path)  # imported from the working folder, as the python reward is
    user = variant_maker("my_variants:flip")
    assert [v["prompt"] for v in distinct_variants(user, {"prompt": "ab"})] == ["ba", "x"]  # the copy is dropped

    with pytest.raises(ConfigError, match=r"monitor.variants\[0\].at: use start or end"):
        variant_maker([{"add": "x", "at": "middle"}])
    with pytest.raises(ConfigError, match=r"monitor.variants\[0\].with: 'replace' needs 'with: NEW'"):
        variant_maker([{"replace": "x"}])
    with pytest.raises(TypeError, match="return a list of prompt texts or examples"):
        variant_maker(lambda e: "one text")({"prompt": "p"})
    with pytest.raises(ValueError, match=r"names the column 'cue', which the example lacks"):
        variant_maker([{"remove": "{cue}"}])({"prompt": "p"})


def test_offpolicy_with_monitor_samples_the_snapshot_and_logs_the_monitor(tmp_path):
    """Off-policy, the policy a reward gets is the snapshot client that sampled the chunk; the
    monitor's batch metrics reach the step's row through the asynchronous producer."""
    from tempering.apps import cli

    rc = cli.main(["run", str(EXAMPLE), f"output_dir={tmp_path}", "stages.rl.name=offpolicy", "stages.rl.eval=null"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r.get("stage") == "rl" and "reward/mean" in r]
    assert len(rl) == 2 and all(r["monitor/variants"] == 4.0 for r in rl)
    assert all(r["monitor/unparsable"] == r["reward/failed"] for r in rl)
    assert all("offpolicy/staleness_mean" in r for r in rl)


def test_the_runner_bounds_a_policy_rewards_batch_call():
    """``reward_timeout`` bounds the whole batch's call; a wrong result count fails the batch."""
    import asyncio

    class Slow:
        def __init__(self, delay: float, results: int) -> None:
            self.delay, self.n = delay, results

        def __call__(self, completion, example):
            raise AssertionError("a policy reward is scored by batch")

        async def score_batch(self, samples, policy):
            await asyncio.sleep(self.delay)
            return BatchScores([1.0] * self.n, {"monitor/accuracy": 1.0})

    ss = samples_of([({"prompt": "p"}, "x")] * 3)
    stats = RewardRunner(Slow(5.0, 3), timeout=0.05).score(ss, policy=ScriptedPolicy())
    assert stats.timeouts == 3 and stats.failed == 3 and stats.metrics == {}
    stats = RewardRunner(Slow(0.0, 2)).score(ss, policy=ScriptedPolicy())
    assert stats.failed == 3 and "score_batch returned 2 results for 3 samples" in ss[0].error
    stats = RewardRunner(Slow(0.0, 3)).score(ss, policy=ScriptedPolicy())
    assert stats.scored == 3 and [s.reward for s in ss] == [1.0] * 3 and stats.metrics == {"monitor/accuracy": 1.0}
