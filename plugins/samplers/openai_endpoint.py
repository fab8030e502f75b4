"""The policy as an OpenAI-compatible endpoint, for agent harnesses that talk to a model over HTTP.

Most agent harnesses already exist and speak the OpenAI chat API. Instead of rewriting them as a
tempering :class:`~tempering.rollouts.environment.Environment`, the ``agent`` sampler hands each
episode an ``openai.AsyncOpenAI`` client pointed here, and this server answers with the stage's
policy: messages (and tools) are rendered by the stage's renderer, sampled through the stage's
backend (batched with the other episodes' calls), and parsed back into text and tool calls. Every
call is recorded token-exactly (:class:`Call`: prompt ids, completion ids, the sampler's
logprobs, the policy version), which is what the sampler trains on -- never a re-tokenization of
the text the harness saw.

Routes, under ``/<episode>/v1`` (one address per episode, so concurrent episodes' calls never
mix): ``POST chat/completions`` (``messages``, ``tools``, ``tool_choice`` auto/none, ``n``,
``max_tokens`` / ``max_completion_tokens``, ``stop``, ``logprobs``, ``temperature`` / ``top_p``
equal to the stage's), ``POST completions`` (a text or token-id ``prompt``), ``GET models``.
What it cannot honour is refused, never ignored: an OpenAI-style JSON error (400 with the reason
and the parameter) -- streaming, a sampling temperature other than the stage's (the RL update
assumes the stage's), the controls of :data:`UNSUPPORTED` (``response_format``, ``logit_bias``,
penalties, ``seed``, ``parallel_tool_calls: false``, ``reasoning_effort``), a prompt past the
context budget (``context_length_exceeded``), a text the tokenizer cannot encode. An assistant
turn the endpoint returned comes back in a later prompt as the tokens sampled for it, not as a
re-rendering of its text (:mod:`~tempering.plugins.samplers.splice`).

Security: it binds 127.0.0.1 only, every request must carry the server's random bearer token
(made per server with :mod:`secrets`, given only to the episodes' clients), an episode's address
stops answering when the episode ends, and the server is shut down when the sampler's batch
ends -- so it lives no longer than the stage that started it.

The server is tempering's one HTTP stack (:mod:`tempering.runs.serving`: Starlette on uvicorn),
as every tempering server uses: connections live on one event loop, so hundreds of episodes'
connections (or slow clients) cost a socket each; a request's handling runs in a thread of its
own, which blocks on the model while the sampler's event loop batches the calls. Requests must
name a loopback host (DNS rebinding), the token is checked before the body is read, bodies are
capped at ``MAX_BODY_BYTES`` (413), JSON nested deeper than 64 levels is a 400.
"""

from __future__ import annotations

import hmac
import json
import math
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

from tempering.interfaces import Tokenizer
from tempering.plugins.samplers.splice import spliced_prompt, turn_end
from tempering.rollouts.chat import ROLES, ParsedResponse, ToolCall, assign_call_ids, text_of
from tempering.rollouts.renderer import Renderer
from tempering.runs.serving import BackgroundServer, Limits, Policy, Reply, guarded_app
from tempering.runs.serving import Call as HttpCall
from tempering.types import Completion

#: The name ``/v1/models`` lists; a request may name any model (there is one policy).
MODEL_NAME = "policy"
#: Request bodies larger than this are refused (413) before they are read.
MAX_BODY_BYTES = 16 * 1024 * 1024
#: OpenAI's limit on stop sequences.
MAX_STOPS = 4

#: ``(episode key, prompt ids, max new tokens) -> Future[Completion]``: one sample of the policy,
#: submitted from a request's thread (the sampler batches it with other episodes' calls).
ModelFn = Callable[[int, list[int], int], "Future[Completion]"]


class RequestError(Exception):
    """A request the endpoint refuses: HTTP ``status`` and an OpenAI-style error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Call:
    """One answered model call of an episode: the prompt's token ids, the sampled completion
    (ids, sampler logprobs, policy version), how it parsed, and -- for a chat call -- the
    request's messages and tools, the renderer's ``canonical`` tokens of them (``prompt`` is
    those with earlier sampled turns spliced in: :mod:`~tempering.plugins.samplers.splice`) and
    the assistant message ``returned`` to the harness; ``choices`` is the request's ``n``."""

    prompt: list[int]
    completion: Completion
    response: ParsedResponse
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    canonical: list[int] | None = None
    returned: dict[str, Any] | None = None
    choices: int = 1
    _turn_end: list[int] | None = field(default=None, init=False, repr=False)
    _turn_end_known: bool = field(default=False, init=False, repr=False)

    def turn_end(self, renderer: Renderer) -> list[int] | None:
        """The canonical tokens of this call's prompt and returned turn (computed once)."""
        if self.canonical is None or self.returned is None or self.messages is None:
            return None  # not a chat call, or not answered yet
        if not self._turn_end_known:
            self._turn_end = turn_end(renderer, self.messages, self.tools, self.returned, self.canonical)
            self._turn_end_known = True
        return self._turn_end


class EpisodeCalls:
    """The calls of one episode, in the order they were answered, and its address."""

    def __init__(self, key: int, slug: str, base_url: str) -> None:
        self.key, self.slug, self.base_url = key, slug, base_url
        self.calls: list[Call] = []
        self.open = True
        self._lock = threading.Lock()

    def add(self, call: Call) -> int:
        """Record ``call``; its index in the episode (tool-call ids are made from it)."""
        with self._lock:
            if not self.open:
                raise RequestError(
                    404, "this episode has ended: its calls are no longer recorded", code="episode_ended"
                )
            self.calls.append(call)
            return len(self.calls) - 1

    def snapshot(self) -> list[Call]:
        """The calls so far (a copy: other requests of the episode may add to them)."""
        with self._lock:
            return list(self.calls)

    def close(self) -> None:
        with self._lock:
            self.open = False


@dataclass
class EndpointLimits:
    """What the stage decides for every call: ``max_tokens`` caps each call's completion,
    ``temperature`` / ``top_p`` are the only values a request may ask for (the RL update
    assumes them), ``max_total_tokens`` bounds prompt plus completion (0 = none), ``max_n``
    bounds ``n``, ``timeout`` (seconds, None = none) bounds a call's wait for the model.
    ``keys`` names the config keys for the error messages."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_total_tokens: int = 0
    max_n: int = 8
    timeout: float | None = 600.0
    keys: dict[str, str] = field(default_factory=dict)

    def key(self, name: str) -> str:
        return self.keys.get(name, name)


class PolicyEndpoint:
    """The OpenAI-compatible server of one sampler batch (see the module docs).

    ``model`` samples; ``renderer`` is the stage's (chat calls), ``tokenizer`` the backend's
    (text completions and token strings). Use as a context manager, or :meth:`start` /
    :meth:`close`; :meth:`open_episode` gives an episode its address, :meth:`end_episode`
    closes it.
    """

    def __init__(self, model: ModelFn, renderer: Renderer, tokenizer: Tokenizer, limits: EndpointLimits) -> None:
        self.model, self.renderer, self.tokenizer, self.limits = model, renderer, tokenizer, limits
        self.token = secrets.token_urlsafe(32)
        # Renderers and tokenizers are not promised to be thread-safe (a fast tokenizer whose
        # settings change between calls raises "Already borrowed"): the request threads take
        # turns for text work; they sample (the slow part) without it.
        self._text_lock = threading.Lock()
        self._episodes: dict[str, EpisodeCalls] = {}
        self._lock = threading.Lock()
        self._server: BackgroundServer | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> PolicyEndpoint:
        rules = http_policy(self)
        self._server = BackgroundServer(
            guarded_app(rules, http_handler(self)), rules, "127.0.0.1", 0, "tempering-openai-endpoint"
        ).start()
        return self

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("the endpoint is not started")
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}"

    def close(self) -> None:
        """Stop answering: every episode's address closes, the socket is released."""
        with self._lock:
            for episode in self._episodes.values():
                episode.close()
            self._episodes.clear()
        if self._server is not None:
            self._server.close()
            self._server = None

    def __enter__(self) -> PolicyEndpoint:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open_episode(self, key: int) -> EpisodeCalls:
        """A new episode's address (``base_url``, ending in ``/v1``); its calls sample with ``key``."""
        slug = secrets.token_hex(8)
        episode = EpisodeCalls(key, slug, f"{self.url}/{slug}/v1")
        with self._lock:
            self._episodes[slug] = episode
        return episode

    def end_episode(self, episode: EpisodeCalls) -> None:
        episode.close()
        with self._lock:
            self._episodes.pop(episode.slug, None)

    # ------------------------------------------------------------------ requests
    def authorized(self, header: str | None) -> bool:
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.token.encode())

    def route(self, method: str, path: str, body: bytes) -> dict[str, Any]:
        """The JSON answer to an authorized request; :class:`RequestError` for a refused one."""
        parts = urlsplit(path).path.strip("/").split("/")
        with self._lock:
            episode = self._episodes.get(parts[0]) if parts else None
        if episode is None or not episode.open:
            raise RequestError(
                404,
                "no open episode at this address: it ended, or the URL is not the base_url "
                "the episode's client was given",
                code="episode_not_found",
            )
        route = "/".join(parts[1:])
        known = {"v1/models": "GET", "v1/chat/completions": "POST", "v1/completions": "POST"}
        if route not in known:
            raise RequestError(
                404,
                f"unknown route '/{route}': this endpoint serves /v1/chat/completions, /v1/completions and /v1/models",
                code="unknown_url",
            )
        if method != known[route]:
            raise RequestError(405, f"/{route} takes {known[route]}, not {method}", code="method_not_allowed")
        if route == "v1/models":
            return {
                "object": "list",
                "data": [{"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "tempering"}],
            }
        request = parse_json(body)
        if route == "v1/chat/completions":
            return self.chat(episode, request)
        return self.completions(episode, request)

    def chat(self, episode: EpisodeCalls, request: dict[str, Any]) -> dict[str, Any]:
        """``/v1/chat/completions``: render, sample ``n`` completions, parse each."""
        common = self._common(request)
        messages = check_chat_messages(request.get("messages"))
        tools = check_tools(request.get("tools"), request.get("tool_choice"))
        try:
            with self._text_lock:
                prompt = self.renderer.render_prompt(messages, tools or None)
                # the turns this episode sampled, as sampled: never a re-tokenization of their text
                tokens = spliced_prompt(list(prompt.tokens), episode.snapshot(), self.renderer)
        except Exception as exc:  # noqa: BLE001 - a renderer's refusal is the request's problem
            raise RequestError(
                400,
                f"the messages cannot be rendered in the model's chat format: {type(exc).__name__}: {exc}",
                "messages",
            ) from None
        sampled = self._sample(episode, tokens, common)  # without the lock: batched with other episodes
        with self._text_lock:
            return self._chat_answer(episode, prompt, tokens, sampled, messages, tools, common)

    def _chat_answer(
        self,
        episode: EpisodeCalls,
        prompt: Any,
        tokens: list[int],
        sampled: list[Completion],
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]],
        common: dict[str, Any],
    ) -> dict[str, Any]:
        choices, completions = [], []
        for i, completion in enumerate(sampled):
            completion, cut_text = cut_at_stop(completion, common["stop"], self.renderer.decode)
            response = parse_turn(prompt, completion)
            call = Call(
                tokens, completion, response, messages, tools, canonical=list(prompt.tokens), choices=len(sampled)
            )
            index = episode.add(call)
            assign_call_ids(response.tool_calls, index)
            message: dict[str, Any] = {"role": "assistant", "content": response.text if cut_text is None else cut_text}
            if response.tool_calls:
                message["tool_calls"] = [c.to_openai() for c in response.tool_calls]
            if response.reasoning:
                message["reasoning_content"] = response.reasoning
            call.returned = message
            choice: dict[str, Any] = {
                "index": i,
                "message": message,
                "finish_reason": finish_reason(completion, response),
                "logprobs": None,
            }
            if response.parse_error is not None and completion.stop_reason == "stop":
                choice["parse_error"] = response.parse_error
            if common["logprobs"]:
                choice["logprobs"] = {
                    "content": [self._token_logprob(t, lp) for t, lp in zip(completion.tokens, completion.logprobs)]
                }
            if common["token_ids"]:
                choice["token_ids"] = list(completion.tokens)
            choices.append(choice)
            completions.append(completion)
        return self._answer("chat.completion", tokens, choices, completions, common)

    def completions(self, episode: EpisodeCalls, request: dict[str, Any]) -> dict[str, Any]:
        """``/v1/completions``: a text prompt (tokenized with the tokenizer's special tokens, as
        the ``completion`` sampler does raw text) or token ids (used as they are)."""
        common = self._common(request)
        for key in ("echo", "suffix"):
            if request.get(key):
                raise RequestError(400, f"'{key}' is not supported by this endpoint", key)
        with self._text_lock:
            prompt_ids = self._completion_prompt(request.get("prompt"))
        sampled = self._sample(episode, prompt_ids, common)  # without the lock: batched with other episodes
        with self._text_lock:
            return self._completion_answer(episode, prompt_ids, sampled, common)

    def _completion_answer(
        self, episode: EpisodeCalls, prompt_ids: list[int], sampled: list[Completion], common: dict[str, Any]
    ) -> dict[str, Any]:
        choices, completions = [], []
        for i, completion in enumerate(sampled):
            completion, cut_text = cut_at_stop(completion, common["stop"], self.renderer.decode)
            text = self.tokenizer.decode(completion.tokens, skip_special_tokens=True) if cut_text is None else cut_text
            response = ParsedResponse(text=text, raw=text)
            episode.add(Call(list(prompt_ids), completion, response, choices=len(sampled)))
            choice: dict[str, Any] = {
                "index": i,
                "text": text,
                "finish_reason": finish_reason(completion, response),
                "logprobs": None,
            }
            if common["logprobs"]:
                choice["logprobs"] = {
                    "tokens": [self._token_text(t) for t in completion.tokens],
                    "token_logprobs": list(completion.logprobs),
                    "top_logprobs": None,
                    "text_offset": None,
                }
            if common["token_ids"]:
                choice["token_ids"] = list(completion.tokens)
            choices.append(choice)
            completions.append(completion)
        return self._answer("text_completion", prompt_ids, choices, completions, common)

    # ------------------------------------------------------------------ helpers
    def _common(self, request: dict[str, Any]) -> dict[str, Any]:
        """The parameters both routes share, checked."""
        if request.get("stream"):
            raise RequestError(400, "streaming is not supported by this endpoint: call without stream=True", "stream")
        limits = self.limits
        n = check_int(request, "n", 1, 1, limits.max_n, f"at most {limits.key('max_n')}={limits.max_n}")
        asked = request.get("max_completion_tokens", request.get("max_tokens"))
        name = "max_completion_tokens" if "max_completion_tokens" in request else "max_tokens"
        max_tokens = limits.max_tokens if asked is None else check_int(request, name, limits.max_tokens, 1, None, "")
        for name, value in (("temperature", limits.temperature), ("top_p", limits.top_p)):
            given = request.get(name)
            if given is None:
                continue
            if (
                not isinstance(given, (int, float))
                or isinstance(given, bool)
                or not math.isclose(float(given), value, abs_tol=1e-6)
            ):
                raise RequestError(
                    400,
                    f"{name}={given!r}: this endpoint samples at the stage's {name} {value:g} "
                    f"({limits.key(name)}), which the RL update assumes; leave {name} out or "
                    f"set it to {value:g}",
                    name,
                )
        check_unsupported(request)
        top = request.get("top_logprobs")
        if top not in (None, 0):
            raise RequestError(
                400,
                "top_logprobs is not supported: the sampler records the chosen token's logprob only",
                "top_logprobs",
            )
        return {
            "n": n,
            "max_tokens": min(max_tokens, limits.max_tokens),
            "stop": check_stop(request.get("stop")),
            "logprobs": bool(request.get("logprobs")),
            "token_ids": bool(request.get("return_token_ids")),
            "model": str(request.get("model") or MODEL_NAME),
        }

    def _completion_prompt(self, prompt: object) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            try:
                return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
            except Exception as exc:  # noqa: BLE001 - text the vocabulary cannot spell is the request's problem
                raise RequestError(
                    400,
                    f"the prompt cannot be encoded by the model's tokenizer: {type(exc).__name__}: {exc}",
                    "prompt",
                ) from None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self.tokenizer)
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(
                    400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt"
                )
            return list(prompt)
        raise RequestError(400, "prompt must be one non-empty string or one list of token ids", "prompt")

    def _sample(self, episode: EpisodeCalls, prompt: Sequence[int], common: dict[str, Any]) -> list[Completion]:
        """``n`` completions of ``prompt`` (submitted together, batched with other episodes')."""
        room = common["max_tokens"]
        budget = self.limits.max_total_tokens
        if budget:
            room = min(room, budget - len(prompt))
            if room <= 0:
                raise RequestError(
                    400,
                    f"the prompt has {len(prompt)} tokens, which leaves no room within the context "
                    f"budget {self.limits.key('max_total_tokens')}={budget}",
                    "messages",
                    code="context_length_exceeded",
                )
        futures = [self.model(episode.key, list(prompt), room) for _ in range(common["n"])]
        out = []
        deadline = None if self.limits.timeout is None else time.monotonic() + self.limits.timeout
        try:
            for f in futures:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                out.append(f.result(timeout=left))
        except TimeoutError:
            raise RequestError(
                504,
                f"the model did not answer within {self.limits.timeout:g} s ({self.limits.key('timeout')})",
                kind="timeout",
                code="timeout",
            ) from None
        except RequestError:
            raise
        except Exception as exc:  # noqa: BLE001 - the backend failed: the harness sees a server error
            raise RequestError(500, f"sampling failed: {type(exc).__name__}: {exc}", kind="server_error") from None
        finally:
            for f in futures:
                f.cancel()
        return out

    def _answer(
        self,
        obj: str,
        prompt: Sequence[int],
        choices: list[dict[str, Any]],
        completions: list[Completion],
        common: dict[str, Any],
    ) -> dict[str, Any]:
        used = sum(len(c.tokens) for c in completions)
        version = min((c.policy_version for c in completions), default=0)
        out: dict[str, Any] = {
            "id": f"{'chatcmpl' if obj == 'chat.completion' else 'cmpl'}-{secrets.token_hex(12)}",
            "object": obj,
            "created": int(time.time()),
            "model": common["model"],
            "system_fingerprint": f"tempering-policy-v{version}",
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": used, "total_tokens": len(prompt) + used},
        }
        if common["token_ids"]:
            out["prompt_token_ids"] = list(prompt)
        return out

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def _token_logprob(self, token: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(token)
        return {"token": text, "logprob": float(logprob), "bytes": list(text.encode("utf-8")), "top_logprobs": []}


# ---------------------------------------------------------------------- request checks
def parse_json(body: bytes) -> dict[str, Any]:
    try:
        request = json.loads(body.decode("utf-8") or "null")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(request, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(request).__name__}")
    return request


def check_int(request: Mapping[str, Any], key: str, default: int, low: int, high: int | None, why: str) -> int:
    value = request.get(key, default)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" + (f" ({why})" if why else "") if high is not None else f">= {low}"
        raise RequestError(400, f"{key} must be an integer {bound}, got {value!r}", key)
    return int(value)


#: Sampling controls the endpoint cannot honour, with the value that means "not used" (accepted)
#: and why each is refused: the RL update assumes the stage's sampling distribution, so a request
#: may not reshape it, and a control silently ignored would let a harness believe it was applied.
UNSUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "response_format": (
        (None, {"type": "text"}),
        "constrained decoding would sample from another distribution than the policy's, which the "
        "RL update assumes; ask for JSON in the prompt and parse the text",
    ),
    "logit_bias": ((None, {}), "it changes the sampling distribution the RL update assumes"),
    "presence_penalty": ((None, 0, 0.0), "it changes the sampling distribution the RL update assumes"),
    "frequency_penalty": ((None, 0, 0.0), "it changes the sampling distribution the RL update assumes"),
    "seed": ((None,), "the stage's seed decides sampling (calls are batched with other episodes')"),
    "parallel_tool_calls": (
        (None, True),
        "the policy decides how many tools it calls in a turn; leave it out (or true)",
    ),
    "reasoning_effort": ((None,), "the policy's chat format decides whether and how long it reasons"),
}


def check_unsupported(request: Mapping[str, Any]) -> None:
    """Refuse a sampling control the endpoint would otherwise ignore (:data:`UNSUPPORTED`)."""
    for key, (neutral, why) in UNSUPPORTED.items():
        value = request.get(key)
        if value not in neutral:
            raise RequestError(400, f"{key}={json.dumps(value)} is not supported by this endpoint: {why}", key)


def check_stop(stop: object) -> list[str]:
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(
            400, f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them, got {stop!r}", "stop"
        )
    return list(stops)


def check_chat_messages(messages: object) -> list[dict[str, Any]]:
    """The request's messages in the form the renderers read: roles checked, text content
    parts joined, tool-call arguments decoded once to catch malformed JSON."""
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in (*ROLES, "developer"):
            role = m.get("role") if isinstance(m, dict) else type(m).__name__
            raise RequestError(400, f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}", where)
        m = dict(m, role="system") if m["role"] == "developer" else dict(m)
        content = m.get("content")
        if isinstance(content, list):
            if any(
                not (isinstance(p, dict) and p.get("type", "text") == "text") and not isinstance(p, str)
                for p in content
            ):
                raise RequestError(400, f"{where}.content: only text parts are supported", f"{where}.content")
            m["content"] = text_of(m)
        elif content is not None and not isinstance(content, str):
            raise RequestError(400, f"{where}.content must be a string or a list of text parts", f"{where}.content")
        for j, call in enumerate(m.get("tool_calls") or []):
            try:
                ToolCall.from_openai(call)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise RequestError(
                    400, f"{where}.tool_calls[{j}] is malformed: {type(exc).__name__}: {exc}", f"{where}.tool_calls"
                ) from None
        out.append(m)
    return out


def check_tools(tools: object, tool_choice: object) -> list[dict[str, Any]]:
    if tool_choice not in (None, "auto", "none"):
        raise RequestError(
            400,
            f"tool_choice {tool_choice!r} is not supported: use 'auto' or 'none' (the policy "
            "decides whether to call a tool)",
            "tool_choice",
        )
    if tools is None or tool_choice == "none":
        return []
    if not isinstance(tools, list):
        raise RequestError(
            400, "tools must be a list of {type: function, function: {name, parameters}} objects", "tools"
        )
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function" or not isinstance(fn.get("name"), str):
            raise RequestError(
                400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", f"tools[{i}]"
            )
    return [dict(t) for t in tools]


# ---------------------------------------------------------------------- completions
def parse_turn(prompt: Any, completion: Completion) -> ParsedResponse:
    """The renderer's parse of a sampled turn; a parser that raises is a malformed turn."""
    try:
        return prompt.parse(completion.tokens)
    except Exception as exc:  # noqa: BLE001 - a parser bug is a malformed turn, not a failed request
        return ParsedResponse(parse_error=f"{type(exc).__name__}: {exc}")


def finish_reason(completion: Completion, response: ParsedResponse) -> str:
    if completion.stop_reason != "stop":
        return "length"
    return "tool_calls" if response.tool_calls else "stop"


def cut_at_stop(
    completion: Completion, stops: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> tuple[Completion, str | None]:
    """``completion`` cut after the first token at which its text contains a stop string, and
    that text up to the stop string; ``(completion, None)`` when no stop string occurs. The
    first tokens of a sample are a sample themselves, so the cut completion is what is
    recorded and trained (the tokens after it were never seen by the harness)."""
    if not stops:
        return completion, None
    text = decode(completion.tokens)
    hits = [text.find(s) for s in stops if s in text]
    if not hits:
        return completion, None
    at = min(hits)
    for n in range(1, len(completion.tokens) + 1):
        if len(decode(completion.tokens[:n])) > at:
            cut = replace(
                completion, tokens=completion.tokens[:n], logprobs=completion.logprobs[:n], stop_reason="stop"
            )
            return cut, text[:at]
    return completion, text[:at]


# ---------------------------------------------------------------------- HTTP
_ERROR_KINDS = {401: ("authentication_error", "invalid_api_key"), 403: ("permission_error", "host_not_allowed")}


def openai_error(status: int, message: str) -> dict[str, Any]:
    """OpenAI's error shape for a refusal made before :meth:`PolicyEndpoint.route` runs."""
    kind, code = _ERROR_KINDS.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return RequestError(status, message, code=code, kind=kind).body()


def http_policy(endpoint: PolicyEndpoint) -> Policy:
    """Loopback names only, the bearer token before the body, JSON bodies, OpenAI's error shape.
    ``workers`` as high as the connection cap: every waiting episode's call holds a thread while
    the sampler batches it with the others (fewer would queue calls the batch waits for)."""
    return Policy(
        error_body=openai_error,
        authorize=lambda method, path, headers: (
            None
            if endpoint.authorized(headers.get("authorization"))
            else "missing or wrong API key: use the api_key the episode's client was given"
        ),
        host_hint="the episode's base_url (127.0.0.1)",
        is_json=lambda method, path, headers: method == "POST",
        limits=Limits(max_body=MAX_BODY_BYTES, max_connections=1024, workers=1024),
    )


def http_handler(endpoint: PolicyEndpoint) -> Callable[[HttpCall], Reply]:
    def answer(call: HttpCall) -> Reply:
        try:
            return Reply(200, endpoint.route(call.method, call.path, call.body))
        except RequestError as exc:
            return Reply(exc.status, exc.body())

    return answer
