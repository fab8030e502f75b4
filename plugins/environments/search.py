"""``search``: agentic multi-hop search over a corpus, with a context the model prunes itself.

The model answers a question about a corpus (the generated one of
:mod:`tempering.plugins.datasets.search_corpus`, or your own documents) with three tools:

* ``search(query, k)``: BM25 (``bm25s``) over each document's title and text; the top ``k``
  documents with a positive score, one line each: ``d12 kam olo lives in tes.`` (a snippet of
  ``snippet_chars`` characters instead of the whole text when set, e.g. for long documents);
* ``open(doc_id)``: one document in full;
* ``prune(doc_ids)``: drop documents from the model's context. From the next turn on, every
  earlier search or open result leaves a pruned document out (a result left empty reads
  ``(pruned)``): its tokens are gone from the prompt (:meth:`Search.view`), while the
  transcript keeps what happened and the prune call itself records the ids.

A turn without a tool call is the final answer: the answer, then the supporting documents
cited as ``[d12]``: ``var [d12][d3]``.

The episode's reward comes from the registered reward components named by ``reward`` (default:
:data:`DEFAULT_REWARD`, recall of the cited documents + answer correctness - a cost per tool
call - a cost per context token; the weights are its config keys). It is computed once the
episode ended (:meth:`Search.group_reward`), because two of its parts need the finished
trajectory: the costs read ``example["episode"]`` -- the episode's tool calls and the tokens the
model read (``context_tokens``: each turn's prompt, summed over the turns; pruning lowers it).

Per-episode counts, summed over a batch as ``env/<name>`` (``eval/<name>`` in evaluations; divide
by ``rollout/samples`` or ``eval/n`` for the per-episode mean): ``recall``, ``answer_correct``,
``tool_calls``, ``context_tokens``, ``peak_context`` (the largest prompt + turn), ``pruned``
(documents), ``opened``, ``searches``, and ``reward/<component>`` for each weighted part; turns
are ``env/turns_mean``.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse, tool_message
from tempering.rollouts.environment import Environment, StepResult, tool_metrics
from tempering.rollouts.feedback import Scored, feedback_of
from tempering.rollouts.tools import tool

#: The default episode reward: recall and answer correctness, minus a cost per tool call and
#: per context token (``context_tokens``: the prompt of every turn, summed).
DEFAULT_REWARD: dict[str, Any] = {
    "name": "weighted",
    "rewards": [
        {"name": "retrieval_recall", "weight": 1.0, "pattern": r"\[([^\[\]]+)\]"},
        {"name": "answer_match", "weight": 1.0},
        {"name": "tool_call_cost", "weight": 0.02},
        {"name": "context_token_cost", "weight": 0.0002},
    ],
}
MAX_K = 10


@dataclass
class Listing:
    """The documents one search or open call showed, at which step, in full or as snippets."""

    step: int
    doc_ids: list[str]
    snippet: bool


@dataclass
class Search(Environment):
    """Config keys: ``corpus`` (null: the example's own ``corpus`` spec, which the bundled
    datasets write; a mapping of generator arguments; or the path of a documents JSONL file),
    ``k`` (search's default result count), ``snippet_chars`` (search shows this many
    characters of each document, 0 = all; null: 0 for the ``tiny`` corpus style, 80 else),
    ``system`` (an optional system message: instructions for a real model), ``citation`` (the
    regex of a cited id, group 1 the id), ``reward`` (a reward spec, :data:`DEFAULT_REWARD`) and
    ``offer`` (the names of the tools offered, default all three: on the ``tiny`` corpus a
    search shows whole documents, so ``[search]`` alone does the task, and every prompt of a
    real model's chat format is ~150 tokens shorter without the other two's specs)."""

    corpus: Any = None
    k: int = 3
    snippet_chars: int | None = None
    system: str | None = None
    citation: str = r"\[([^\[\]]+)\]"
    reward: Any = field(default_factory=lambda: dict(DEFAULT_REWARD))
    offer: Sequence[str] | None = None

    def __post_init__(self) -> None:
        if self.offer is not None:
            known = sorted(t.name for t in super().tools())
            names = [] if isinstance(self.offer, str) else list(self.offer)
            if not names or any(n not in known for n in names):
                raise ValueError(
                    f"search: offer must be a non-empty list of tool names from {', '.join(known)}, got {self.offer!r}"
                )
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"search: k must be between 1 and {MAX_K}, got {self.k}")
        if self.snippet_chars is not None and self.snippet_chars < 0:
            raise ValueError(f"search: snippet_chars must be >= 0 (0 = whole documents), got {self.snippet_chars}")
        self.example: dict[str, Any] = {}
        self.listings: dict[str | None, Listing] = {}
        self.pruned_at: dict[str, int] = {}  # doc id -> the step that last pruned it
        self.steps = 0

    def tools(self) -> list[Any]:
        """The tools offered to the model: all three, or the ones ``offer`` names (a call to
        another is an ``unknown tool`` error the model reads)."""
        every = super().tools()
        return every if self.offer is None else [t for t in every if t.name in self.offer]

    # ------------------------------------------------------------------ episode
    async def reset(self, example: dict[str, Any]) -> list[Message]:
        from tempering.plugins.datasets.search_corpus import corpus_from_spec

        spec = self.corpus if self.corpus is not None else example.get("corpus")
        if spec is None:
            raise ValueError(
                "search: no corpus: set the environment's 'corpus' key (a documents JSONL path) or give "
                "examples a 'corpus' spec"
            )
        self.index = index_of(corpus_from_spec(spec))
        if self.snippet_chars is None:
            self.snippet_chars = 0 if self.index.corpus.spec.get("style") == "tiny" else 80
        self.example = dict(example)
        messages: list[Message] = [{"role": "system", "content": self.system}] if self.system else []
        return [*messages, {"role": "user", "content": str(example["question"])}]

    @tool
    async def search(self, query: str, k: int | None = None) -> str:
        """Search the documents for the words of a query.

        Args:
            query: the words to look for, e.g. a name
            k: how many documents to return, from 1 to 10
        """
        return self._listing(self._hits(query, k), snippet=bool(self.snippet_chars))

    @tool
    async def open(self, doc_id: str) -> str:
        """Read one document in full.

        Args:
            doc_id: the document's id, e.g. d12
        """
        return self._listing([self._document(doc_id).id], snippet=False)

    @tool
    async def prune(self, doc_ids: list[str]) -> str:
        """Remove documents from your context: their text is gone from the next turn on.

        Args:
            doc_ids: the ids of the documents to drop, e.g. ["d3", "d40"]
        """
        return "pruned " + " ".join(self._prunable(doc_ids))

    async def step(self, response: ParsedResponse) -> StepResult:
        """Run the turn's calls; remember which documents each result showed (so that a later
        prune can hide them) and which ones this turn pruned."""
        self.steps += 1
        if response.parse_error is not None or not response.tool_calls:
            return await super().step(response)
        results = await self.call_tools(response)
        counts = {"searches": 0.0, "opened": 0.0, "pruned": 0.0}
        for call, result in zip(response.tool_calls, results):
            if result.error is not None:
                continue
            args = result.arguments
            if call.name == "search":
                self.listings[call.id] = Listing(self.steps, self._hits(**args), bool(self.snippet_chars))
                counts["searches"] += 1
            elif call.name == "open":
                self.listings[call.id] = Listing(self.steps, [args["doc_id"]], False)
                counts["opened"] += 1
            elif call.name == "prune":
                for doc_id in args["doc_ids"]:
                    self.pruned_at[doc_id] = self.steps
                counts["pruned"] += len(args["doc_ids"])
        messages = [tool_message(call, r.content) for call, r in zip(response.tool_calls, results)]
        return StepResult(
            messages,
            reward=0.0,
            metrics={**tool_metrics(results), **counts},
            errors=[r.error for r in results if r.error],
        )

    async def score(self, response: ParsedResponse) -> float:
        """0: the episode's reward is computed once it ended (:meth:`group_reward`)."""
        return 0.0

    def view(self, messages: list[Message]) -> list[Message]:
        """The history with every pruned document gone from the results shown before it was
        pruned (a later search may show it again); a result left empty reads ``(pruned)``."""
        if not self.pruned_at:
            return messages
        out = []
        for m in messages:
            listing = self.listings.get(m.get("tool_call_id") or "") if m.get("role") == "tool" else None
            if listing is not None:
                hidden = {d for d in listing.doc_ids if self.pruned_at.get(d, 0) > listing.step}
                if hidden:
                    m = {**m, "content": self._render(listing.doc_ids, listing.snippet, hidden)}
            out.append(m)
        return out

    # ------------------------------------------------------------------ the reward
    async def group_reward(self, trajectories: Sequence[Any]) -> list[float]:
        """Each episode's reward from the ``reward`` components, given the final answer and
        ``example["episode"]`` (:func:`episode_stats`), with their feedback (``answer_match:
        expected 'var', got 'kam'``); counts the episode's metrics on its trajectory. An episode
        without a final answer (out of turns or context) gets only the costs."""
        from tempering.plugins.rewards.common import as_finite, info_of, resolve_reward
        from tempering.plugins.rewards.retrieval import cited_ids
        from tempering.plugins.rewards.search import answer_correct

        reward = resolve_reward(self.reward, path="environment.reward")
        gold = [str(g).lower() for g in self.example.get("gold_ids", [])]
        out: list[float] = []
        for traj in trajectories:
            stats = episode_stats(traj)
            final = traj.turns[-1].response.text if traj.stop == "done" and traj.turns else ""
            value = reward(final, {**self.example, "episode": stats})
            value = await value if inspect.isawaitable(value) else value
            out.append(
                Scored(as_finite(value, "search: the episode reward"), feedback_of(value, "search: the episode reward"))
            )
            cited = {c.lower() for c in cited_ids(final, self.citation)}
            for key in ("context_tokens", "peak_context"):
                traj.count(key, float(stats[key]))
            if gold:
                traj.count("recall", len(cited & set(gold)) / len(gold))
            if "answer" in self.example:
                traj.count("answer_correct", answer_correct(final, str(self.example["answer"]), self.citation))
            for name, part in (info_of(value).get("components") or {}).items():
                traj.count(f"reward/{name}", float(part))
        return out

    # ------------------------------------------------------------------ retrieval
    def _hits(self, query: str, k: int | None = None) -> list[str]:
        k = self.k if k is None else k
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query must be non-empty text")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise ValueError(f"k must be an integer from 1 to {MAX_K}, got {k!r}")
        return self.index.search(query, k)

    def _document(self, doc_id: Any) -> Any:
        if not isinstance(doc_id, str):
            raise TypeError(f'doc_id must be a document id such as "d12", got {doc_id!r}')
        found = self.index.corpus.by_id.get(doc_id.strip())
        if found is None:
            raise KeyError(f"no document '{doc_id}'")
        return found

    def _prunable(self, doc_ids: object) -> list[str]:
        if not isinstance(doc_ids, list) or not doc_ids or not all(isinstance(d, str) for d in doc_ids):
            raise TypeError(f'doc_ids must be a non-empty list of document ids such as ["d3"], got {doc_ids!r}')
        visible = self.visible()
        missing = [d for d in doc_ids if d not in visible]
        if missing:
            raise ValueError(f"not in your context: {', '.join(missing)}")
        return list(dict.fromkeys(doc_ids))

    def visible(self) -> set[str]:
        """Documents whose text the model's context holds now."""
        return {
            d for listing in self.listings.values() for d in listing.doc_ids if self.pruned_at.get(d, 0) <= listing.step
        }

    def _listing(self, doc_ids: list[str], snippet: bool) -> str:
        return self._render(doc_ids, snippet, set()) if doc_ids else "no document matches"

    def _render(self, doc_ids: Sequence[str], snippet: bool, hidden: set[str]) -> str:
        """One line per document, ``d12 title: text`` (``title: text`` where the title is the
        id), leaving out ``hidden`` ones; the same function
        writes a result and its pruned view, so an unpruned result re-renders exactly as the
        model first saw it."""
        lines = []
        for doc_id in doc_ids:
            if doc_id in hidden:
                continue
            doc = self.index.corpus.by_id[doc_id]
            text = " ".join(doc.text.split())
            if snippet and self.snippet_chars and len(text) > self.snippet_chars:
                text = text[: self.snippet_chars].rstrip() + "..."
            head = doc_id if doc.title in ("", doc_id) else f"{doc_id} {doc.title}"
            lines.append(f"{head}: {text}")
        return "\n".join(lines) or "(pruned)"


def episode_stats(traj: Any) -> dict[str, float]:
    """What the cost rewards read from a finished trajectory: tool calls, the tokens the model
    read (each turn's prompt, summed: ``context_tokens``), the largest prompt plus its turn
    (``peak_context``), documents pruned and turns."""
    turns = list(traj.turns)
    return {
        "tool_calls": float(traj.metrics.get("tool_calls", 0.0)),
        "context_tokens": float(sum(t.prompt_len for t in turns)),
        "peak_context": float(max((t.prompt_len + len(t.completion.tokens) for t in turns), default=0)),
        "pruned": float(traj.metrics.get("pruned", 0.0)),
        "turns": float(len(turns)),
    }


class Index:
    """A BM25 index (``bm25s``) over a corpus's documents: title (boosted) and text."""

    def __init__(self, corpus: Any) -> None:
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.corpus = corpus
        self.ids = [d.id for d in corpus.documents]
        self.tokenizer = Tokenizer(stopwords="en")
        # the title counts twice (a field boost): a search for a name ranks the document about
        # it above the ones that merely mention it
        tokens = self.tokenizer.tokenize(
            [f"{d.title} {d.title} {d.text}" for d in corpus.documents], return_as="ids", show_progress=False
        )
        self.bm25 = bm25s.BM25()
        self.bm25.index(tokens, show_progress=False)
        self.lock = threading.Lock()  # tools may run on threads; bm25s is not documented thread-safe

    def search(self, query: str, k: int) -> list[str]:
        """Ids of the top ``k`` documents with a positive score, best first (ties: corpus order,
        so results never depend on how bm25s breaks them)."""
        with self.lock:
            q = self.tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)
            if not q[0]:
                return []
            docs, scores = self.bm25.retrieve(q, k=min(k + 16, len(self.ids)), show_progress=False)
        ranked = sorted((-float(s), int(i)) for i, s in zip(docs[0], scores[0]) if s > 0)
        return [self.ids[i] for _, i in ranked[:k]]


_INDEXES: dict[int, Index] = {}
_INDEX_LOCK = threading.Lock()


def index_of(corpus: object) -> Index:
    """The corpus's index, built once (corpora are cached, so every episode shares one)."""
    with _INDEX_LOCK:
        found = _INDEXES.get(id(corpus))
        if found is None or found.corpus is not corpus:
            found = _INDEXES[id(corpus)] = Index(corpus)
        return found
