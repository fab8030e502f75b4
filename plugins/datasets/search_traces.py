"""The ``agentic_search`` dataset: tasks for the ``search`` environment, SFT trajectories of
their solutions, and DPO pairs of preferred vs rejected tool calls.

Everything is played through the environment itself (:func:`replay`, the message-level twin
of an episode), so a transcript's tool results are the environment's own and each assistant
turn sits in exactly the context the model would see -- pruned documents' text gone after a
``prune`` call. Formats (``format``):

* ``tasks``: ``{"question", "answer", "gold_ids", "hops", "queries", "corpus"}`` -- ``corpus`` is
  the spec the environment builds the corpus from, ``queries`` the gold path (one search per hop);
* ``transcripts``: the gold path as SFT rows ``{"messages", "tools"}``: one search per hop (with
  ``prune: true``, the previous search's distractors pruned in the same turn), then the answer
  citing every supporting document, ``var [d12][d3]``. A history rewritten by a prune gives one
  row per context, its earlier turns marked ``"weight": 0`` (context only), so SFT trains each
  turn once, in the context it was taken in: the rows of the RL episode of the same turns;
* ``pairs``: one DPO pair per gold turn ``{"messages", "tools", "chosen", "rejected", "kind"}``:
  the shared context, the gold turn, and a wasted or wrong one (``kind``: ``repeat``: the
  previous search again; ``open_seen``: open a document already shown in full; ``wrong_query``:
  search for a distractor; ``early_answer``: answer before the last hop; ``uncited``: the right
  answer without its citations) -- the JSONL format of :mod:`tempering.algorithms.dpo.algorithm`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse, ToolCall, assign_call_ids, check_messages
from tempering.rollouts.trajectory import as_context

FORMATS = ("tasks", "transcripts", "pairs")


def agentic_search(
    split: str = "train",
    format: str = "tasks",
    size: int | None = None,
    hops: Sequence[int] = (1, 2, 3),
    prune: bool = False,
    corpus: object = None,
    environment: object = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Rows of ``split`` (train, val, test) in ``format`` (tasks, transcripts, pairs) for the
    questions of ``hops`` hops, shuffled by ``seed``; ``size`` keeps the first tasks. ``corpus``:
    the generator's arguments (default ``{style: tiny}``); ``environment``: the ``search``
    environment's keys the trajectories are played with (``k``, ``snippet_chars``, ``system``;
    the sampler's ``{name: search, ...}`` spec works too: use the same);
    ``prune``: the SFT trajectories prune each search's distractors."""
    from tempering.plugins.datasets.search_corpus import SPLITS

    if split not in SPLITS:
        raise ValueError(f"agentic_search: split must be one of {', '.join(SPLITS)}, got '{split}'")
    if format not in FORMATS:
        raise ValueError(f"agentic_search: format must be one of {', '.join(FORMATS)}, got '{format}'")
    hops = tuple(int(h) for h in hops)
    if not hops or not set(hops) <= {1, 2, 3}:
        raise ValueError(f"agentic_search: hops must be a non-empty list of 1, 2, 3, got {list(hops)}")
    key = json.dumps([split, format, size, hops, prune, corpus, environment, seed], sort_keys=True, default=str)
    return [dict(r) for r in _rows(key)]


@lru_cache(maxsize=16)
def _rows(key: str) -> tuple[dict[str, Any], ...]:
    split, format, size, hops, prune, corpus, environment, seed = json.loads(key)
    tasks = search_tasks(split, hops, corpus, seed)[:size]
    if format == "tasks":
        return tuple(tasks)
    from tempering.rollouts.scoring import run_coroutine

    env_keys = dict(environment or {})
    maker = transcript_rows if format == "transcripts" else pair_rows

    async def main() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, task in enumerate(tasks):
            out += await maker(env_keys, task, prune=prune, rng=random.Random(f"{seed}-{i}"))
        return out

    return tuple(run_coroutine(main()))


def search_tasks(split: str, hops: Sequence[int], corpus: Any = None, seed: int = 0) -> list[dict[str, Any]]:
    """The questions of ``split`` with ``hops`` hops, in a seeded order, each carrying its
    corpus spec."""
    from tempering.plugins.datasets.search_corpus import corpus_from_spec

    built = corpus_from_spec({"style": "tiny", **dict(corpus or {})})
    rows = [{**q, "corpus": dict(built.spec)} for q in built.questions[split] if q["hops"] in hops]
    random.Random(f"agentic-search-{split}-{seed}").shuffle(rows)
    return rows


# ---------------------------------------------------------------------- playing turns
def call(name: str, **arguments: object) -> ToolCall:
    return ToolCall(name, dict(arguments))


def final_answer(task: dict[str, Any], cite: Sequence[str] | None = None) -> ParsedResponse:
    """``answer [d12][d3]``: the task's answer citing ``cite`` (default: every gold document)."""
    ids = task["gold_ids"] if cite is None else cite
    return ParsedResponse(" ".join([str(task["answer"]), "".join(f"[{d}]" for d in ids)]).strip())


def gold_turns(env: Any, task: dict[str, Any], prune: bool = False) -> list[ParsedResponse]:
    """The gold path: one search per hop (the subject of each link) -- and, where search shows
    snippets, an ``open`` of the hop's document to read the fact -- each search after the first
    pruning the previous search's distractors when ``prune``; then the answer citing every gold
    document. ``env`` must be reset on ``task`` (its index answers the searches)."""
    turns: list[ParsedResponse] = []
    previous: list[str] = []
    for query, gold in zip(task["queries"], task["gold_ids"]):
        calls = []
        distractors = [d for d in previous if d not in task["gold_ids"]]
        if prune and distractors:
            calls.append(call("prune", doc_ids=distractors))
        calls.append(call("search", query=query))
        turns.append(ParsedResponse(tool_calls=calls))
        if env.snippet_chars:
            turns.append(ParsedResponse(tool_calls=[call("open", doc_id=gold)]))
        previous = env._hits(query)
    return [*turns, final_answer(task)]


async def replay(
    env: Any, example: dict[str, Any], turns: Sequence[ParsedResponse]
) -> tuple[list[Message], list[list[Message]]]:
    """Play scripted turns through ``env`` as an episode would (call ids, history, the view).
    Returns the history and, per turn, the messages the model saw before it."""
    from tempering.rollouts.episode import model_view

    history = check_messages(await env.reset(dict(example)), "environment.reset() returned")
    contexts = []
    for i, response in enumerate(turns):
        contexts.append(model_view(env, history))
        assign_call_ids(response.tool_calls, i)
        history.append(response.to_message())
        result = await env.step(response)
        history += check_messages(result.messages, "environment.step() returned")
        if result.done:
            break
    return history, contexts


def context_rows(contexts: Sequence[list[Message]], turns: Sequence[Message]) -> list[list[Message]]:
    """Supervised rows of turns taken in ``contexts``: consecutive turns share a row while each
    context extends the row so far; a context that rewrote it (a prune) starts a new row whose
    earlier assistant turns are ``"weight": 0``. Each turn is trained once, in its context."""
    rows: list[list[Message]] = []
    for context, turn in zip(contexts, turns):
        row = rows[-1] if rows else None
        if row is not None and [_bare(m) for m in context[: len(row)]] == [_bare(m) for m in row]:
            row += [*context[len(row) :], dict(turn)]
        else:
            rows.append([*as_context(context), dict(turn)])
    return rows


def _bare(m: Message) -> Message:
    return {k: v for k, v in m.items() if k != "weight"}


def _environment(env_keys: dict[str, Any]) -> Any:
    """The ``search`` environment the trajectories are played in; ``env_keys`` may be the
    sampler's own spec (``{name: search, ...}``), so one YAML anchor serves both."""
    from tempering.plugins.environments.search import Search

    keys = dict(env_keys)
    if keys.pop("name", "search") != "search":
        raise ValueError(
            f"agentic_search: the trajectories are played in the 'search' environment, not '{env_keys['name']}'"
        )
    return Search(**keys)


async def transcript_rows(
    env_keys: dict[str, Any], task: dict[str, Any], prune: bool = False, rng: random.Random | None = None
) -> list[dict[str, Any]]:
    """The SFT rows of ``task``'s gold path (see the module docstring)."""
    env = _environment(env_keys)
    await env.reset(dict(task))
    turns = gold_turns(env, task, prune)
    _, contexts = await replay(env, task, turns)
    tools = [t.spec() for t in env.tools()]
    return [{"messages": row, "tools": tools} for row in context_rows(contexts, [t.to_message() for t in turns])]


async def pair_rows(
    env_keys: dict[str, Any], task: dict[str, Any], prune: bool = False, rng: random.Random | None = None
) -> list[dict[str, Any]]:
    """One DPO pair per gold turn of ``task``: its context, the gold turn, a bad one."""
    rng = rng or random.Random(0)
    env = _environment(env_keys)
    await env.reset(dict(task))
    turns = gold_turns(env, task, prune)
    _, contexts = await replay(env, task, turns)
    tools = [t.spec() for t in env.tools()]
    shown = [env._hits(q) for q in task["queries"]]
    rows = []
    for i, (context, gold) in enumerate(zip(contexts, turns)):
        kind, bad = rejected_turn(
            task, turns[:i], shown, last=i == len(turns) - 1, snippets=bool(env.snippet_chars), rng=rng
        )
        assign_call_ids(bad.tool_calls, i)
        rows.append(
            {
                "messages": context,
                "tools": tools,
                "chosen": [gold.to_message()],
                "rejected": [bad.to_message()],
                "kind": kind,
            }
        )
    return rows


def rejected_turn(
    task: dict[str, Any],
    before: Sequence[ParsedResponse],
    shown: Sequence[list[str]],
    last: bool,
    snippets: bool,
    rng: random.Random,
) -> tuple[str, ParsedResponse]:
    """A wasted or wrong turn in place of the gold turn that follows the gold turns ``before``
    (``shown``: each gold search's hits; ``snippets``: search shows snippets, so only an opened
    document has been read in full)."""
    calls = [c for t in before for c in t.tool_calls]
    hops = sum(c.name == "search" for c in calls)  # searches made so far
    read = (
        {c.arguments["doc_id"] for c in calls if c.name == "open"}
        if snippets
        else {d for h in range(hops) for d in shown[h]}
    )
    options = []
    if hops:
        options += ["repeat", *(["open_seen"] if read else [])]
    distractors = [d for d in shown[max(hops - 1, 0)] if d not in task["gold_ids"]]
    if distractors:
        options.append("wrong_query")
    options.append("uncited" if last else "early_answer")
    kind = rng.choice(options)
    if kind == "repeat":
        return kind, ParsedResponse(tool_calls=[call("search", query=task["queries"][hops - 1])])
    if kind == "open_seen":
        return kind, ParsedResponse(tool_calls=[call("open", doc_id=rng.choice(sorted(read)))])
    if kind == "wrong_query":
        return kind, ParsedResponse(tool_calls=[call("search", query=_title(task, rng.choice(distractors)))])
    if kind == "uncited":
        return kind, final_answer(task, cite=[])
    guess = task["queries"][hops] if hops < len(task["queries"]) else task["answer"]  # the chain's next name
    return kind, final_answer({**task, "answer": guess}, cite=task["gold_ids"][:hops])


def _title(task: dict[str, Any], doc_id: str) -> str:
    from tempering.plugins.datasets.search_corpus import corpus_from_spec

    return corpus_from_spec(task["corpus"]).by_id[doc_id].title
