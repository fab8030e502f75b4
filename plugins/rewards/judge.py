"""LLM-as-judge: another model reads the prompt, the completion (and a reference) and grades it.

The judge is either

* an OpenAI-compatible HTTP endpoint (``base_url``: ``POST {base_url}/chat/completions``; vLLM,
  SGLang, llama.cpp, TGI and hosted APIs speak it), called with httpx, async, with a timeout
  and retries; or
* any of our samplers/backends, passed as a runtime object (``LLMJudge(..., sampler=backend)``):
  an object with ``sample(prompts, num_samples, SamplingParams) -> Future[list[list[Completion]]]``
  and a ``tokenizer``. Concurrent judge calls are grouped into one ``sample`` call
  (``batch_size``).

``mode: graded`` reads a score from the reply (``Score: 7/10``, ``Score: 0.7``, ``85%``, ``8 out
of 10``; a bare number is divided by ``scale``) into [0, 1]; ``mode: binary`` reads a verdict
(``Verdict: YES``, or a reply that starts or ends with yes/no, correct/incorrect, pass/fail,
true/false) into 1 or 0. A reply that does not parse raises :class:`JudgeParseError`: the sample
fails (masked out), it is never silently scored 0. The reply's explanation -- the default
templates ask for one before the score -- is the reward's feedback (:func:`critique`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tempering.interfaces import RewardResult
from tempering.plugins.rewards.common import LoopLocal, MicroBatcher, RewardError, post_json
from tempering.rollouts.feedback import clip
from tempering.types import SamplingParams

GRADED_TEMPLATE = """You are grading a response to a task.

Task:
{prompt}

Reference answer:
{reference}

Response to grade:
{completion}

How correct and complete is the response, from 0 (wrong) to 10 (fully correct)? Explain briefly, \
then end with a line of the form "Score: N/10"."""

BINARY_TEMPLATE = """You are checking a response to a task.

Task:
{prompt}

Reference answer:
{reference}

Response to check:
{completion}

Is the response correct? Explain briefly, then end with a line "Verdict: YES" or "Verdict: NO"."""

NO_REFERENCE = "(no reference answer given)"


class JudgeParseError(RewardError, ValueError):
    """The judge's reply holds no score/verdict that can be read."""


# --------------------------------------------------------------------------- parsing
_NUM = r"[-+]?\d+(?:\.\d+)?"
_SCORE_RE = re.compile(
    rf"(?:score|rating|grade)\**\s*(?:is|of|=|:)?\s*\**\s*(?P<num>{_NUM})\s*"
    rf"(?:(?:/|out\s+of)\s*(?P<den>{_NUM})|(?P<pct>%))?",
    re.IGNORECASE,
)
_RATIO_RE = re.compile(rf"(?P<num>{_NUM})\s*(?:/|out\s+of)\s*(?P<den>{_NUM})", re.IGNORECASE)
_BARE_RE = re.compile(rf"\s*\**\s*(?P<num>{_NUM})\s*(?P<pct>%)?\s*\**\s*\.?\s*")

_YES = {"yes", "correct", "true", "pass", "right", "acceptable"}
_NO = {"no", "incorrect", "false", "fail", "wrong", "not correct", "unacceptable"}
_VERDICT_WORDS = r"not\s+correct|incorrect|unacceptable|acceptable|correct|yes|no|true|false|pass|fail|right|wrong"
_LABELLED_RE = re.compile(
    rf"(?:verdict|answer|judge?ment|decision|final|result)\**\s*[:=]\s*\**\s*(?P<v>{_VERDICT_WORDS})\b", re.IGNORECASE
)
_FIRST_RE = re.compile(rf"^\W*(?P<v>{_VERDICT_WORDS})\b", re.IGNORECASE)
_LAST_RE = re.compile(rf"\b(?P<v>{_VERDICT_WORDS})\W*$", re.IGNORECASE)


def _verdict(word: str) -> float:
    w = re.sub(r"\s+", " ", word.lower())
    return 1.0 if w in _YES else 0.0


def parse_binary(reply: str) -> float:
    """1.0 / 0.0 from a verdict: a labelled one (``Verdict: YES``; the last wins), else a reply
    that starts with, else ends with, a verdict word. Raises :class:`JudgeParseError`."""
    labelled = list(_LABELLED_RE.finditer(reply))
    if labelled:
        return _verdict(labelled[-1].group("v"))
    for rx in (_FIRST_RE, _LAST_RE):
        m = rx.search(reply.strip())
        if m:
            return _verdict(m.group("v"))
    raise JudgeParseError(f"no yes/no verdict in the judge's reply: {reply[-300:]!r}")


def parse_graded(reply: str, scale: float = 10.0) -> float:
    """A score in [0, 1]: the last ``Score: N[/M | out of M | %]`` (a bare ``N`` is ``N/scale``),
    else the last ``N/M``, else a reply that is only a number. Raises
    :class:`JudgeParseError` when none is found or the score falls outside [0, 1]."""
    m = None
    for rx in (_SCORE_RE, _RATIO_RE):
        found = list(rx.finditer(reply))
        if found:
            m = found[-1]
            break
    if m is None:
        m = _BARE_RE.fullmatch(reply)
    if m is None:
        raise JudgeParseError(f"no score in the judge's reply: {reply[-300:]!r}")
    groups = m.groupdict()
    num = float(groups["num"])
    if groups.get("den") is not None:
        den = float(groups["den"])
        if den <= 0:
            raise JudgeParseError(f"judge score {m.group(0)!r} has a non-positive denominator")
        value = num / den
    elif groups.get("pct"):
        value = num / 100
    else:
        value = num / scale
    if not 0.0 <= value <= 1.0:
        raise JudgeParseError(f"judge score {m.group(0).strip()!r} is outside [0, 1] (scale {scale})")
    return value


def critique(reply: str) -> str | None:
    """The judge's explanation: its reply without the score or verdict (``Score: 7/10``,
    ``Verdict: NO``) and the lines they leave empty, clipped; ``None`` when nothing else was
    said (a bare ``7`` or ``No.``)."""
    text = _LABELLED_RE.sub("", _SCORE_RE.sub("", reply))
    text = "\n".join(ln.strip() for ln in text.splitlines() if any(c.isalnum() for c in ln)).strip()
    if not text or _BARE_RE.fullmatch(text) or _FIRST_RE.fullmatch(text.strip(" .!")):
        return None
    return clip(text)


# --------------------------------------------------------------------------- templates
class _Fields(dict):
    def __missing__(self, key: str) -> Any:
        raise KeyError(
            f"llm_judge: the prompt template uses {{{key}}}, which is neither prompt/completion/"
            f"answer/reference nor a key of the example (keys: {sorted(k for k in self if not k.startswith('_'))})"
        )


def _prompt_text(example: Mapping[str, Any], key: str) -> str:
    if key in example:
        return str(example[key])
    messages = example.get("messages")
    if messages:
        users = [m.get("content", "") for m in messages if isinstance(m, Mapping) and m.get("role") == "user"]
        if users:
            return str(users[-1])
    raise KeyError(
        f"llm_judge: the example has no '{key}' (or user 'messages') to show the judge (keys: {sorted(example)})"
    )


async def _resolve(value: object) -> Any:
    """A sampler's answer: a concurrent future, an awaitable or a plain value."""
    if isinstance(value, concurrent.futures.Future):
        return await asyncio.wrap_future(value)
    if inspect.isawaitable(value):
        return await value
    if hasattr(value, "result") and callable(value.result):  # a future-like object
        return await asyncio.to_thread(value.result)
    return value


class _HTTPState:
    def __init__(self, concurrency: int, timeout: float | None) -> None:
        import httpx

        self.client = httpx.AsyncClient(
            timeout=timeout, trust_env=False, limits=httpx.Limits(max_connections=concurrency)
        )
        self.sem = asyncio.Semaphore(concurrency)


@dataclass
class LLMJudge:
    """Grades a completion with a judge model; see the module docstring.

    ``template`` placeholders: ``{prompt}``, ``{completion}``, ``{answer}`` / ``{reference}``
    (``example[reference_key]``, or a note that there is none) and any key of the example;
    literal braces must be doubled. Defaults to a 0-10 grading or a YES/NO template by ``mode``.
    HTTP: ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``), ``model``, ``api_key`` or
    ``api_key_env`` (the name of an environment variable holding it), ``timeout`` per attempt,
    ``retries`` with exponential ``backoff``. Sampler: ``sampler`` (runtime object or a
    registered sampler spec); ``batch_size`` judge prompts per ``sample`` call.
    """

    mode: str = "graded"
    template: str | None = None
    system_prompt: str | None = None
    scale: float = 10.0
    prompt_key: str = "prompt"
    reference_key: str = "answer"
    base_url: str | None = None
    model: str = "judge"
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str | None = None
    temperature: float = 0.0
    max_tokens: int = 512
    timeout: float = 60.0
    retries: int = 2
    backoff: float = 0.5
    backoff_max: float = 8.0
    concurrency: int = 16
    batch_size: int = 16
    batch_wait: float = 0.01
    sampler: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("graded", "binary"):
            raise ValueError(f"llm_judge.mode: use graded or binary (got '{self.mode}')")
        if (self.base_url is None) == (self.sampler is None):
            raise ValueError(
                "llm_judge: give exactly one judge: base_url (an OpenAI-compatible server) or sampler "
                "(a backend/sampler object, e.g. LLMJudge(..., sampler=backend))"
            )
        if self.scale <= 0:
            raise ValueError("llm_judge.scale must be > 0")
        if self.template is None:
            self.template = GRADED_TEMPLATE if self.mode == "graded" else BINARY_TEMPLATE
        try:
            names = {f for _, f, _, _ in string.Formatter().parse(self.template) if f}
        except ValueError as exc:
            raise ValueError(f"llm_judge.template: {exc} (double literal braces: {{{{ }}}})") from None
        self._uses = names
        if "completion" not in names:
            raise ValueError("llm_judge.template must contain {completion}")
        if isinstance(self.sampler, (str, Mapping)):
            from tempering.registry import get_registry

            self.sampler = get_registry().build("sampler", self.sampler, "llm_judge.sampler")
        if self.sampler is not None and not hasattr(self.sampler, "sample"):
            raise TypeError(f"llm_judge.sampler: {type(self.sampler).__name__} has no sample(prompts, n, params)")
        if self.base_url is not None:
            base = self.base_url.rstrip("/")
            self.endpoint = base if base.endswith("/chat/completions") else base + "/chat/completions"
        self._http: LoopLocal[_HTTPState] = LoopLocal(lambda: _HTTPState(self.concurrency, self.timeout))
        self._batcher = MicroBatcher(self._sample_batch, self.batch_size, self.batch_wait)

    # ------------------------------------------------------------------ reward
    def render(self, completion: str, example: Mapping[str, Any]) -> str:
        """The judge prompt for one sample."""
        ref = example.get(self.reference_key)
        fields = _Fields({str(k): v for k, v in example.items()})
        fields.update(
            prompt=_prompt_text(example, self.prompt_key) if "prompt" in self._uses else "",
            completion=completion,
            answer=NO_REFERENCE if ref is None else ref,
            reference=NO_REFERENCE if ref is None else ref,
        )
        return (self.template or "").format_map(fields)

    def parse(self, reply: str) -> float:
        return parse_graded(reply, self.scale) if self.mode == "graded" else parse_binary(reply)

    async def __call__(self, completion: str, example: Mapping[str, Any]) -> RewardResult:
        reply = await self.ask(self.render(completion, example))
        score = self.parse(reply)
        return RewardResult(score, {"judge_reply": reply[-1000:]}, feedback=critique(reply))

    async def ask(self, text: str) -> str:
        """The judge's reply to one prompt (the endpoint's, or the sampler's: concurrent asks
        are grouped into ``sample`` calls of ``batch_size``). Other rewards ask the judge
        their own questions through it (``monitor``)."""
        return await (self._ask_http(text) if self.base_url is not None else self._batcher.submit(text))

    async def aclose(self) -> None:
        await self._batcher.drain()
        state = self._http.pop()
        if state is not None:
            await state.client.aclose()

    # ------------------------------------------------------------------ judges
    def _messages(self, text: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": text}]

    async def _ask_http(self, text: str) -> str:
        state = self._http.get()
        key = self.api_key or (os.environ.get(self.api_key_env) if self.api_key_env else None)
        headers = {"authorization": f"Bearer {key}"} if key else {}
        payload = {
            "model": self.model,
            "messages": self._messages(text),
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        async with state.sem:
            reply = await post_json(
                state.client,
                self.endpoint,
                payload,
                retries=self.retries,
                backoff=self.backoff,
                backoff_max=self.backoff_max,
                timeout=self.timeout,
                headers=headers,
                what="judge request",
            )
        try:
            content = reply["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise RewardError(f"judge reply is not a chat completion: {str(reply)[:300]!r}") from None
        if not isinstance(content, str):
            raise RewardError(f"judge reply has no text content: {str(reply)[:300]!r}")
        return content

    def _encode(self, text: str) -> list[int]:
        tok = self.sampler.tokenizer
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(self._messages(text), add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)
        return list(tok(text, add_special_tokens=True)["input_ids"])

    async def _sample_batch(self, texts: list[str]) -> list[str]:
        params = SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature)
        prompts = [self._encode(t) for t in texts]
        out = await _resolve(self.sampler.sample(prompts, 1, params))
        if len(out) != len(texts):
            raise RewardError(f"judge sampler returned {len(out)} results for {len(texts)} prompts")
        tok = self.sampler.tokenizer
        replies = []
        for comps in out:
            c = comps[0]
            replies.append(c.text if getattr(c, "text", "") else tok.decode(list(c.tokens), skip_special_tokens=True))
        return replies
