"""The agentic-search pieces: the generated corpus, the ``search`` environment's tools, pruning,
its trajectories and rewards, and the ``agentic_search`` dataset.

Episodes are played by a scripted "model" (a sampling client that answers with the tokens of
the gold path) through the registered ``environment`` sampler, rendered by ``tiny_chat`` (the
tiny model's format) and by ``qwen3_instruct`` (the real Qwen3 tokenizer and format), so what is
checked is what RL trains on: which tokens each row holds and which ones it weighs.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import Future
from typing import Any

import pytest

from tempering.plugins.datasets.search_corpus import corpus_from_spec, generate
from tempering.plugins.datasets.search_traces import agentic_search, gold_turns
from tempering.plugins.environments.search import Search
from tempering.registry import get_registry
from tempering.rollouts.chat import ParsedResponse, ToolCall
from tempering.rollouts.rollout import SamplerContext, collect
from tempering.types import Completion, SamplingParams

TINY = {"style": "tiny"}


def two_hop_task(split: str = "test") -> dict[str, Any]:
    """A 2-hop question whose first search shows distractors (namesakes) worth pruning."""
    return next(t for t in agentic_search(split, hops=[2]) if len(reset(t)._hits(t["queries"][0])) > 1)


def reset(task: dict[str, Any], **keys: Any) -> Search:
    env = Search(**keys)
    asyncio.run(env.reset(dict(task)))
    return env


def run_calls(env: Search, *calls: ToolCall) -> list[str]:
    """One turn of ``calls`` through ``env.step``; the tool messages' texts."""
    for i, c in enumerate(calls):
        c.id = c.id or f"t{env.steps}_{i}"
    result = asyncio.run(env.step(ParsedResponse(tool_calls=list(calls))))
    return [m["content"] for m in result.messages]


# --------------------------------------------------------------------------- the corpus
def test_the_corpus_is_deterministic_with_planted_chains_and_person_disjoint_splits() -> None:
    corpus = generate("tiny", seed=0)
    assert (
        generate("tiny", seed=0).documents == corpus.documents
        and generate("tiny", seed=1).documents != corpus.documents
    )
    assert 300 <= len(corpus.documents) <= 500  # a few hundred short documents
    people = {split: {q["queries"][0] for q in qs} for split, qs in corpus.questions.items()}
    assert (
        not people["train"] & people["test"]
        and not people["train"] & people["val"]
        and not people["val"] & people["test"]
    )
    assert {q["hops"] for q in corpus.questions["test"]} == {1, 2, 3}
    for q in corpus.questions["train"][:60]:  # each gold document states its link of the chain
        hops = [*q["queries"][1:], q["answer"]]
        for doc_id, subject, obj in zip(q["gold_ids"], q["queries"], hops):
            text = corpus.by_id[doc_id].text
            assert corpus.by_id[doc_id].title == subject and text.endswith(f" {obj}.")
    full = generate("full", seed=0)
    assert {d.title for d in full.documents} == {d.id for d in corpus.documents}  # the same world, ...
    assert min(len(d.text) for d in full.documents) > 60 and full.documents[7].id == "d007"  # ... numbered, longer
    with pytest.raises(ValueError, match="style must be"):
        generate("huge")


# --------------------------------------------------------------------------- the tools
def test_search_ranks_each_hops_subject_first_and_shows_only_matches() -> None:
    for task in agentic_search("test", hops=[3])[:20]:
        env = reset(task)
        for query, gold in zip(task["queries"], task["gold_ids"]):
            hits = env._hits(query)
            assert hits[0] == gold and 1 <= len(hits) <= env.k
        [text] = run_calls(env, ToolCall("search", {"query": task["queries"][0], "k": 1}))
        assert text == f"{task['gold_ids'][0]}: {env.index.corpus.by_id[task['gold_ids'][0]].text}"
    assert run_calls(env, ToolCall("search", {"query": "zzzz qqqq"})) == ["no document matches"]
    doc = env.index.corpus.documents[3]
    assert run_calls(env, ToolCall("open", {"doc_id": doc.id})) == [f"{doc.id}: {doc.text}"]


def test_full_documents_show_as_snippets_and_open_reads_them_whole() -> None:
    task = agentic_search("test", hops=[1], corpus={"style": "full"})[0]
    env = reset(task)
    assert env.snippet_chars == 80
    [text] = run_calls(env, ToolCall("search", {"query": task["queries"][0]}))
    first = text.splitlines()[0]
    head = f"{task['gold_ids'][0]} {task['queries'][0]}: "
    assert first.startswith(head) and first.endswith("...") and len(first) <= len(head) + 80 + 3
    [opened] = run_calls(env, ToolCall("open", {"doc_id": task["gold_ids"][0]}))
    assert task["answer"] in opened and not opened.endswith("...")


@pytest.mark.parametrize(
    "name, args, error",
    [
        ("search", {"query": ""}, "ValueError: query must be non-empty text"),
        ("search", {"query": "kam", "k": 0}, "ValueError: k must be an integer from 1 to 10, got 0"),
        ("search", {"query": "kam", "k": "2"}, "k must be an integer from 1 to 10, got '2'"),
        ("search", {"q": "kam"}, "Error: bad arguments for search"),
        ("open", {"doc_id": "zzz"}, "KeyError: \"no document 'zzz'\""),
        ("open", {"doc_id": 12}, "TypeError: doc_id must be a document id"),
        ("prune", {"doc_ids": "d3"}, "TypeError: doc_ids must be a non-empty list"),
        ("prune", {"doc_ids": ["d3"]}, "ValueError: not in your context: d3"),
        ("grep", {"pattern": "kam"}, "Error: unknown tool 'grep' (tools: open, prune, search)"),
    ],
)
def test_a_bad_call_is_an_error_message_the_model_reads(name: str, args: dict[str, Any], error: str) -> None:
    env = reset(two_hop_task())
    result = asyncio.run(env.step(ParsedResponse(tool_calls=[ToolCall(name, args, "c0")])))
    [message] = result.messages
    assert message["role"] == "tool" and message["content"].startswith("Error:") and error in message["content"]
    assert (result.done, result.metrics["tool_errors"], result.metrics["tool_calls"]) == (False, 1.0, 1.0)
    assert not env.listings and not env.pruned_at  # a failed call shows and prunes nothing


def test_offer_limits_the_tools_the_model_sees_and_may_call() -> None:
    """``offer: [search]``: the transcripts' tool specs (what a chat format writes into the
    system turn) hold search alone, and a call to another tool is an error the model reads."""
    task = two_hop_task()
    env = reset(task, offer=["search"])
    assert [t.name for t in env.tools()] == ["search"]
    [message] = asyncio.run(env.step(ParsedResponse(tool_calls=[ToolCall("open", {"doc_id": "x"}, "c0")]))).messages
    assert message["content"] == "Error: unknown tool 'open' (tools: search)"
    [row] = agentic_search("test", format="transcripts", hops=[2], size=1, environment={"offer": ["search"]})
    assert [t["function"]["name"] for t in row["tools"]] == ["search"]
    for bad in (["grep"], [], "search"):
        with pytest.raises(ValueError, match="offer must be a non-empty list of tool names from open, prune, search"):
            Search(offer=bad)


def test_prune_hides_documents_shown_before_it_and_only_those() -> None:
    task = two_hop_task()
    env = reset(task)
    messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
    [first] = run_calls(env, ToolCall("search", {"query": task["queries"][0]}, "a"))
    messages.append({"role": "tool", "tool_call_id": "a", "content": first})
    assert env.view(messages) == messages  # nothing pruned: the history as it is
    gold, *others = env._hits(task["queries"][0])
    assert env.visible() == {gold, *others}
    assert run_calls(env, ToolCall("prune", {"doc_ids": others}, "b")) == ["pruned " + " ".join(others)]
    [seen] = env.view(messages)[1:]
    assert seen["content"] == first.splitlines()[0] and messages[1]["content"] == first  # the history is kept
    assert env.visible() == {gold}
    [again] = run_calls(env, ToolCall("search", {"query": task["queries"][0]}, "c"))  # shown again: visible again
    assert again == first and env.visible() == {gold, *others}
    messages.append({"role": "tool", "tool_call_id": "c", "content": again})
    assert [m["content"] for m in env.view(messages)[1:]] == [first.splitlines()[0], first]
    run_calls(env, ToolCall("prune", {"doc_ids": [gold, *others]}, "d"))
    assert [m["content"] for m in env.view(messages)[1:]] == ["(pruned)", "(pruned)"]


# --------------------------------------------------------------------------- episodes
@pytest.fixture(scope="module")
def tiny_chat() -> Any:
    from tempering.plugins.models.tiny import tiny_llama

    _, tokenizer = tiny_llama(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, chat=True)
    return get_registry().build("renderer", "tiny_chat", "renderer", tokenizer=tokenizer)


@pytest.fixture(scope="module")
def qwen3() -> Any:
    from tempering.plugins.models.qwen3 import qwen3_tokenizer

    return get_registry().build("renderer", "qwen3_instruct", "renderer", tokenizer=qwen3_tokenizer())


class Scripted:
    """A sampling client playing one episode: its ``k``-th turn is ``turns[k]`` (token ids)."""

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns, self.prompts = list(turns), []

    def sample(self, prompts: list[list[int]], num_samples: int, params: SamplingParams) -> Future:
        [prompt] = prompts
        self.prompts.append(list(prompt))
        tokens = self.turns.pop(0)
        assert tokens[-1] in params.stop
        done: Future = Future()
        done.set_result([[Completion(list(prompt), tokens, [-0.1] * len(tokens), "stop")]])
        return done


def weighted_runs(rows: list[Any]) -> list[list[int]]:
    """The weight-1 runs of supervised rows, in order: the tokens of each trained turn."""
    runs: list[list[int]] = []
    for row in rows:
        previous = 0.0
        for token, weight in zip(row.tokens, row.weights):
            if weight and not previous:
                runs.append([])
            if weight:
                runs[-1].append(token)
            previous = weight
    return runs


def episodes(renderer: Any, environment: Any = "search", max_turns: int = 6) -> Any:
    """The registered ``environment`` sampler over ``renderer``."""
    reg = get_registry()
    context = SamplerContext(
        renderer.tokenizer,
        lambda: renderer,
        None,
        build=lambda k, s, key: reg.build(k, s, key),
        factory=lambda k, s, key: reg.factory(k, s, key),
    )
    spec = {"name": "environment", "environment": environment, "max_turns": max_turns}
    return reg.build("sampler", spec, "sampler", context=context)


def play(
    renderer: Any, task: dict[str, Any], turns: list[list[int]], environment: Any = "search", max_turns: int = 6
) -> tuple[Any, Scripted]:
    """One episode of ``task`` through the registered ``environment`` sampler; its sample."""
    model = Scripted(turns)
    rollout = collect(
        episodes(renderer, environment, max_turns), model, [task], 1, SamplingParams(max_tokens=64, temperature=0.0)
    )
    [sample] = rollout.groups[0].samples
    return sample, model


@pytest.mark.parametrize("renderer_name", ["tiny_chat", "qwen3"])
def test_pruning_removes_the_documents_tokens_and_rows_hold_only_seen_tokens(renderer_name: str, request: Any) -> None:
    renderer = request.getfixturevalue(renderer_name)
    task = two_hop_task()
    sft = agentic_search("test", "transcripts", hops=[2], prune=True)
    rows = [r for r in sft if r["messages"][0]["content"] == task["question"]]
    assert len(rows) == 2  # the prune rewrote the history: one row per context
    rendered = [row for r in rows for row in renderer.render_training(r["messages"], r["tools"])]
    sample, model = play(renderer, task, weighted_runs(rendered))
    traj = sample.trajectory
    assert (traj.stop, len(traj.turns), traj.metrics["pruned"], traj.metrics["row_splits"]) == ("done", 3, 2.0, 1.0)
    pruned = [
        f"{d}: {corpus_from_spec(task['corpus']).by_id[d].text}"
        for d in json.loads(traj.messages[3]["tool_calls"][0]["function"]["arguments"])["doc_ids"]
    ]
    assert all(p in renderer.decode(model.prompts[1]) for p in pruned)  # seen while choosing what to prune ...
    assert not any(p in renderer.decode(model.prompts[2]) for p in pruned)  # ... gone from the next prompt
    unpruned = renderer.render_prompt(traj.messages[:6], traj.tools).tokens  # the history as it happened
    saved = len(unpruned) - len(model.prompts[2])
    assert saved > 0 and (renderer_name != "tiny_chat" or saved == sum(len(p) + 1 for p in pruned))  # a char a token
    # every row is one turn's prompt plus what followed it, weight 1 exactly on sampled tokens
    first, second = traj.segments
    assert first.tokens == [*model.prompts[1], *traj.turns[1].completion.tokens]
    assert second.tokens == [*model.prompts[2], *traj.turns[2].completion.tokens]
    for seg, turns in ((first, traj.turns[:2]), (second, traj.turns[2:])):
        weights = [0.0] * len(seg.tokens)
        for t in turns:
            weights[t.prompt_len : t.prompt_len + len(t.completion.tokens)] = [1.0] * len(t.completion.tokens)
        assert seg.weights == weights
    # ... and exactly the rows SFT trains on the same trajectory
    assert [(s.tokens, s.weights) for s in traj.segments] == [(r.tokens, r.weights) for r in rendered]


def test_the_gold_path_scores_recall_answer_and_costs_with_its_metrics(tiny_chat: Any) -> None:
    task = two_hop_task()
    rows = agentic_search("test", "transcripts", hops=[2], prune=True)
    rendered = [
        row
        for r in rows
        if r["messages"][0]["content"] == task["question"]
        for row in tiny_chat.render_training(r["messages"], r["tools"])
    ]
    sample, _ = play(tiny_chat, task, weighted_runs(rendered))
    m = sample.trajectory.metrics
    context = sum(t.prompt_len for t in sample.trajectory.turns)
    assert (m["recall"], m["answer_correct"], m["tool_calls"], m["searches"], m["pruned"]) == (1.0, 1.0, 3.0, 2.0, 2.0)
    assert m["context_tokens"] == context and m["peak_context"] < context
    assert sample.reward == pytest.approx(1.0 + 1.0 - 0.02 * 3 - 0.0002 * context)
    assert m["reward/retrieval_recall"] == 1.0 and m["reward/tool_call_cost"] == -3.0
    assert m["reward/context_token_cost"] == -context
    assert sample.feedback is None  # nothing went wrong
    # half the citations, then a wrong answer: recall and correctness drop, costs stay; the
    # components' feedback says which
    answer = sample.trajectory.turns[-1].response.text
    first = answer.split("]")[0] + "]"
    [missing] = [g for g in task["gold_ids"] if f"[{g}]" not in first]
    for final, recall, correct, said in (
        (first, 0.5, 1.0, f"retrieval_recall: cited 1 of 2 supporting documents; missing {missing}"),
        ("zzz " + answer.split(" ", 1)[1], 1.0, 0.0, f"answer_match: expected '{task['answer'].lower()}', got 'zzz'"),
    ):
        turns = [*weighted_runs(rendered)[:-1], tiny_chat.render_response({"role": "assistant", "content": final})]
        other, _ = play(tiny_chat, task, turns)
        assert (other.trajectory.metrics["recall"], other.trajectory.metrics["answer_correct"]) == (recall, correct)
        assert other.reward == pytest.approx(recall + correct - 0.02 * 3 - 0.0002 * context)
        assert other.feedback == said


def test_an_evaluation_counts_what_answering_cost(tiny_chat: Any) -> None:
    """A held-out evaluation of the gold path logs, next to recall and tool calls, the tokens the
    model wrote, its turns and the wall clock: the per-episode costs a search agent is judged on."""
    from tempering.training.evaluate import evaluate

    task = two_hop_task()
    rows = agentic_search("test", "transcripts", hops=[2])
    [row] = [r for r in rows if r["messages"][0]["content"] == task["question"]]
    turns = weighted_runs(tiny_chat.render_training(row["messages"], row["tools"]))
    m = evaluate(Scripted(turns), [task], None, 64, sampler=episodes(tiny_chat))
    assert (m["eval/n"], m["eval/recall"], m["eval/tool_calls"], m["eval/turns"]) == (1.0, 1.0, 2.0, 3.0)
    assert m["eval/generated_tokens"] == sum(len(t) for t in turns) > 0
    assert 0.0 < m["eval/seconds"] < 30.0


def test_an_episode_without_an_answer_gets_only_the_costs(tiny_chat: Any) -> None:
    task = two_hop_task()
    search = tiny_chat.render_response(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "search", "arguments": {"query": task["queries"][0]}}}],
        }
    )
    sample, _ = play(tiny_chat, task, [search, search], max_turns=2)
    context = sum(t.prompt_len for t in sample.trajectory.turns)
    assert sample.trajectory.stop == "max_turns" and sample.trajectory.metrics["recall"] == 0.0
    assert sample.reward == pytest.approx(-0.02 * 2 - 0.0002 * context)


def test_reward_weights_are_config_keys(tiny_chat: Any) -> None:
    task = two_hop_task()
    rows = agentic_search("test", "transcripts", hops=[2], prune=False)
    rendered = [
        row
        for r in rows
        if r["messages"][0]["content"] == task["question"]
        for row in tiny_chat.render_training(r["messages"], r["tools"])
    ]
    env = {
        "name": "search",
        "reward": {
            "name": "weighted",
            "rewards": [{"name": "answer_match", "weight": 0.5}, {"name": "tool_call_cost", "weight": 0.25}],
        },
    }
    sample, _ = play(tiny_chat, task, weighted_runs(rendered), environment=env)
    assert sample.reward == pytest.approx(0.5 - 0.25 * 2)
    assert sample.trajectory.metrics["row_splits"] == 0.0  # no prune: one row


def test_reward_components_alone() -> None:
    reg = get_registry()
    answer = reg.build("reward", "answer_match", "reward")
    assert answer("Var [kam olo][d3].", {"answer": "var"}).reward == 1.0
    assert answer("tes [kam olo]", {"answer": "var"}).reward == 0.0
    calls = reg.build("reward", "tool_call_cost", "reward")
    tokens = reg.build("reward", {"name": "context_token_cost", "measure": "peak"}, "reward")
    stats = {"episode": {"tool_calls": 3.0, "context_tokens": 900.0, "peak_context": 400.0}}
    assert (calls("x", stats).reward, tokens("x", stats).reward) == (-3.0, -400.0)
    with pytest.raises(KeyError, match="added by the search environment"):
        calls("x", {"answer": "var"})
    with pytest.raises(ValueError, match="use total or peak"):
        reg.build("reward", {"name": "context_token_cost", "measure": "max"}, "reward")


# --------------------------------------------------------------------------- the dataset
def test_pairs_share_the_context_and_differ_in_one_turn() -> None:
    pairs = agentic_search("train", "pairs", size=40)
    tasks = agentic_search("train", size=40)
    assert len(pairs) == sum(t["hops"] + 1 for t in tasks)  # one per gold turn
    assert {p["kind"] for p in pairs} == {"repeat", "open_seen", "wrong_query", "early_answer", "uncited"}
    for p in pairs:
        [chosen], [rejected] = p["chosen"], p["rejected"]
        assert chosen["role"] == rejected["role"] == "assistant" and chosen != rejected
        assert p["messages"][0]["role"] == "user" and p["messages"][-1]["role"] in ("user", "tool")
    assert agentic_search("train", "pairs", size=40) == pairs  # deterministic


def test_sft_transcripts_without_pruning_are_one_row_per_task() -> None:
    tasks = agentic_search("val", hops=[1, 2, 3], size=30)
    rows = agentic_search("val", "transcripts", hops=[1, 2, 3], size=30)
    assert len(rows) == len(tasks)
    for task, row in zip(tasks, rows):
        assistant = [m for m in row["messages"] if m["role"] == "assistant"]
        assert len(assistant) == task["hops"] + 1 and "weight" not in str(assistant)
        assert assistant[-1]["content"] == f"{task['answer']} " + "".join(f"[{d}]" for d in task["gold_ids"])


def test_a_corpus_of_your_own_documents(tmp_path: Any) -> None:
    path = tmp_path / "docs.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(d)
            for d in [
                {"id": "d1", "title": "Ada", "text": "Ada Lovelace wrote the first program."},
                {"id": "d2", "title": "Babbage", "text": "Charles Babbage designed the analytical engine."},
            ]
        )
    )
    env = reset({"question": "Who wrote the first program?", "answer": "Ada"}, corpus=str(path))
    assert run_calls(env, ToolCall("search", {"query": "analytical engine"})) == [
        "d2 Babbage: Charles Babbage designed the analytical engine."
    ]


def test_bad_dataset_and_environment_keys_say_what_is_wrong() -> None:
    for kwargs, match in (
        ({"split": "dev"}, "split must be"),
        ({"format": "chat"}, "format must be"),
        ({"hops": [4]}, "hops must be"),
    ):
        with pytest.raises(ValueError, match=match):
            agentic_search(**kwargs)
    with pytest.raises(ValueError, match="k must be between 1 and 10"):
        Search(k=0)
    with pytest.raises(ValueError, match="unknown key"):
        corpus_from_spec({"style": "tiny", "size": 3})
    with pytest.raises(ValueError, match="no corpus"):
        asyncio.run(Search().reset({"question": "q"}))


def test_gold_turns_prune_the_previous_searchs_distractors() -> None:
    task = agentic_search("test", hops=[3])[0]
    env = reset(task)
    turns = gold_turns(env, task, prune=True)
    assert [[c.name for c in t.tool_calls] for t in turns] == [["search"], ["prune", "search"], ["prune", "search"], []]
    distractors = [d for d in env._hits(task["queries"][0]) if d not in task["gold_ids"]]
    assert turns[1].tool_calls[0].arguments == {"doc_ids": distractors}


# --------------------------------------------------------------------------- the recipes
ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "recipe",
    [
        "agentic_search_dpo",
        "agentic_search_sft",
        str(ROOT / "examples/agentic_search/qwen3_dpo.yaml"),
        str(ROOT / "examples/agentic_search/qwen3_sft.yaml"),
    ],
)
def test_the_recipes_are_valid_with_their_data(recipe: str) -> None:
    """Every stage's config and data, as a run checks them before training (the real-model
    recipes need Tinker or a checkpoint to run: their config is what can be checked here)."""
    from tempering.training.recipe import RunContext, find_recipe

    reg = get_registry()
    cfg = find_recipe(recipe).to_dict()
    reg.check("backend", cfg["backend"], "backend")
    ctx = RunContext(reg, None, cfg, cfg["output_dir"], [], cfg["seed"])
    for i, spec in enumerate(cfg["stages"]):
        stage = reg.build("algorithm", {k: v for k, v in spec.items() if k != "id"}, f"stages[{i}]")
        ctx.stage_index, ctx.stage_id = i, spec["id"]
        stage.validate(ctx)
