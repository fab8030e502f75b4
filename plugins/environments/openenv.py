"""``openenv``: an environment served by an OpenEnv server (openenv-core 0.3), played as episodes.

OpenEnv environments run behind HTTP/WebSocket with a typed action and a typed observation
(pydantic models on the server) and a gym-style ``reset``/``step``. tempering plays one episode per
WebSocket session (openenv-core's own ``GenericEnvClient``: dict actions and observations, so no
environment package is installed on the training side)::

    sampler: {name: environment, environment: {name: openenv, url: "http://127.0.0.1:8000"}}

Two ways to map the typed action onto a chat model's turns:

* **as a tool** (the default): the action's JSON schema (the server's ``/schema``) is offered as
  one tool, ``act`` (``tool_name``); each call is one ``step`` and its observation is the tool's
  answer. A turn without a call ends the episode (an agent that is done).
* **as text** (``action_field: message``): the turn's text is the action's ``message`` field, and
  the observation comes back as a user message.

The episode's reward is the sum of the server's step rewards; it ends when the server says
``done`` (or at the sampler's ``max_turns``). ``reset_keys`` name example columns passed to the
server's ``reset`` (its ``seed``, a task id: the server keeps only the keywords its ``reset``
accepts); the example's ``prompt`` (``prompt_key``), when present, is shown before the first
observation. An observation is shown as its ``observation_field`` or, by default, as JSON
without its ``reward``/``done``/``metadata``.

Every network call is bounded by ``timeout`` seconds. The config check asks the server's
``/health`` before anything trains, so a wrong ``url`` is one line naming it.

**Sessions.** An OpenEnv server holds at most ``max_concurrent_envs`` WebSocket sessions
(openenv-core's default, and the published apps': 1) and refuses the next with
``CAPACITY_REACHED``. ``max_sessions`` caps the episodes in flight (the ``environment``
sampler starts no more, :attr:`~tempering.rollouts.environment.Environment.max_concurrent`):
null takes the number the server states in its ``/health`` or ``/metadata``
(``max_concurrent_envs`` or ``max_sessions``; openenv-core 0.3 states none), else
:data:`DEFAULT_SESSIONS`. A session refused for capacity (another client holds one, or a
closed one is not yet freed) is retried with backoff for up to ``timeout`` seconds.

**A turn cut at max_tokens** (no stop token: its action is incomplete) is never a silent 0,
which could beat a real answer: ``cut_turn: penalty`` (default) ends the episode with
``cut_turn_reward`` (default -1, below any answer of a server whose rewards are in [0, 1]: set
it below your server's lowest), counted as ``env/cut_turns``; ``cut_turn: send`` sends it as it
is -- the text as the action (``action_field``), or the turn's complete tool calls (a turn with
none gets the penalty) -- and the server scores it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse
from tempering.rollouts.environment import Environment, StepResult
from tempering.rollouts.episode import CUT_TURN
from tempering.rollouts.tools import Tool
from tempering.schema import Problem

#: Sessions in flight when neither ``max_sessions`` nor the server says (openenv-core's default
#: ``max_concurrent_envs``).
DEFAULT_SESSIONS = 1
#: What a turn cut at the token limit does (see the module docs).
CUT_TURN_POLICIES = ("penalty", "send")
#: The error code an OpenEnv server answers a session over its limit with.
CAPACITY_REACHED = "CAPACITY_REACHED"
OPENENV_HINT = "pip install 'tempering[openenv]' (openenv-core 0.3; it pins its own mcp: keep it apart from verifiers)"
#: Observation fields that are the step's bookkeeping rather than what the agent sees.
BOOKKEEPING = ("reward", "done", "metadata")

_schemas: dict[str, dict[str, Any]] = {}
_schemas_lock = threading.Lock()


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read().decode("utf-8"))


def action_schema(url: str, timeout: float) -> dict[str, Any]:
    """The server's action JSON schema (``GET {url}/schema``), once per URL; ``metadata``
    (every OpenEnv action has it) is left out of what the model is asked to fill in."""
    with _schemas_lock:
        if url not in _schemas:
            schema = dict(_get_json(f"{url.rstrip('/')}/schema", timeout)["action"])
            props = {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}
            required = [k for k in schema.get("required") or [] if k in props]
            _schemas[url] = {**schema, "properties": props, "required": required}
        return _schemas[url]


_sessions: dict[str, int] = {}


def server_sessions(url: str, timeout: float) -> int:
    """How many sessions the server at ``url`` holds at once: the ``max_concurrent_envs`` (or
    ``max_sessions``) its ``/health`` or ``/metadata`` states, else :data:`DEFAULT_SESSIONS`;
    asked once per URL."""
    with _schemas_lock:
        if url not in _sessions:
            found = None
            for route in ("health", "metadata"):
                try:
                    reply = _get_json(f"{url.rstrip('/')}/{route}", timeout)
                except (OSError, ValueError):
                    continue
                for key in ("max_concurrent_envs", "max_sessions"):
                    value = reply.get(key) if isinstance(reply, dict) else None
                    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                        found = found or value
            _sessions[url] = found or DEFAULT_SESSIONS
        return _sessions[url]


def observation_text(observation: Mapping[str, Any], field: str | None) -> str:
    """What the model sees of an observation: one field, or the rest as compact JSON."""
    if field is not None:
        value = observation.get(field, "")
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    shown = {k: v for k, v in observation.items() if k not in BOOKKEEPING}
    return json.dumps(shown, ensure_ascii=False, separators=(",", ":"))


class OpenEnv(Environment):
    """Config keys: ``url`` (required), ``action_field`` (None: the action is a tool),
    ``tool_name``, ``observation_field``, ``reset_keys``, ``prompt_key``, ``timeout``,
    ``max_sessions``, ``cut_turn``, ``cut_turn_reward`` (see the module docs)."""

    def __init__(
        self,
        url: str,
        action_field: str | None = None,
        tool_name: str = "act",
        observation_field: str | None = None,
        reset_keys: list[str] | None = None,
        prompt_key: str = "prompt",
        timeout: float = 30.0,
        max_sessions: int | None = None,
        cut_turn: str = "penalty",
        cut_turn_reward: float = -1.0,
    ) -> None:
        self.url = url.rstrip("/")
        self.max_concurrent = max_sessions or server_sessions(self.url, min(float(timeout), 10.0))
        self.cut_turn, self.cut_turn_reward = cut_turn, float(cut_turn_reward)
        self.action_field, self.tool_name = action_field, tool_name
        self.observation_field, self.prompt_key = observation_field, prompt_key
        self.reset_keys = list(reset_keys or [])
        self.timeout = float(timeout)
        self.client: Any = None
        self.pending_reward = 0.0  # the step rewards of this turn's tool calls
        self.server_done = False

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem]:
        if importlib.util.find_spec("openenv") is None:
            yield Problem("", f"the openenv environment needs openenv-core: {OPENENV_HINT}")
            return
        url = str(config.get("url") or "")
        if not url.startswith(("http://", "https://")):
            yield Problem("url", f"must be the OpenEnv server's http(s):// address, got {url!r}")
            return
        if not float(config.get("timeout") or 0) > 0:
            yield Problem("timeout", f"must be > 0 seconds, got {config.get('timeout')}")
            return
        if config.get("cut_turn", "penalty") not in CUT_TURN_POLICIES:
            yield Problem("cut_turn", f"must be one of {', '.join(CUT_TURN_POLICIES)}, got {config.get('cut_turn')!r}")
        sessions = config.get("max_sessions")
        if sessions is not None and not (isinstance(sessions, int) and sessions >= 1):
            yield Problem("max_sessions", f"must be an integer >= 1 or null (the server's), got {sessions!r}")
        try:
            _get_json(f"{url.rstrip('/')}/health", min(float(config["timeout"]), 10.0))
        except (OSError, ValueError) as exc:  # URLError, a timeout, a reply that is not JSON
            reason = getattr(exc, "reason", exc)
            yield Problem("url", f"no OpenEnv server answers at {url} ({reason}); start it or fix the url")

    # ------------------------------------------------------------------ episode
    async def reset(self, example: dict[str, Any]) -> list[Message]:

        missing = [k for k in self.reset_keys if k not in example]
        if missing:
            raise KeyError(f"openenv: reset_keys {missing} are not columns of the example (columns: {sorted(example)})")
        result = await self._open_session({k: example[k] for k in self.reset_keys})
        self.pending_reward = float(result.reward or 0.0)
        shown = observation_text(result.observation, self.observation_field)
        prompt = example.get(self.prompt_key)
        return [{"role": "user", "content": f"{prompt}\n\n{shown}" if prompt else shown}]

    async def _open_session(self, keys: dict[str, Any]) -> Any:
        """A new session's ``reset``, retried with backoff while the server is at capacity
        (for up to ``timeout`` seconds; then one line saying so)."""
        from openenv import GenericEnvClient

        deadline = time.monotonic() + self.timeout
        wait = 0.1
        while True:
            self.client = GenericEnvClient(
                base_url=self.url, connect_timeout_s=self.timeout, message_timeout_s=self.timeout
            )
            try:
                return await self.client.reset(**keys)
            except RuntimeError as exc:
                if CAPACITY_REACHED not in str(exc):
                    raise
                client, self.client = self.client, None
                await client.close()
                if time.monotonic() + wait > deadline:
                    raise RuntimeError(
                        f"openenv: the server at {self.url} stayed at its session limit for {self.timeout:g} s "
                        f"({exc}); lower max_sessions (now {self.max_concurrent}) or raise the server's "
                        "max_concurrent_envs"
                    ) from None
                await asyncio.sleep(wait)
                wait = min(wait * 2, 2.0)

    def tools(self) -> list[Tool]:
        if self.action_field is not None:
            return []
        schema = action_schema(self.url, self.timeout)
        description = str(schema.get("description") or f"Act in the {schema.get('title', 'OpenEnv')} environment.")
        parameters = {"type": "object", "properties": schema["properties"], "required": schema["required"]}
        return [Tool(name=self.tool_name, fn=self.act, description=description, parameters=parameters)]

    async def act(self, **action: object) -> str:
        """One ``step`` with the tool call's arguments as the action; its observation as text."""
        if self.server_done:
            raise RuntimeError("the episode is over (the server said done)")
        result = await self.client.step(action)
        self.pending_reward += float(result.reward or 0.0)
        self.server_done = bool(result.done)
        return observation_text(result.observation, self.observation_field)

    async def step(self, response: ParsedResponse) -> StepResult:
        if response.parse_error == CUT_TURN:
            cut = self._cut_turn(response)
            if cut is not None:
                return cut
            response = replace(response, parse_error=None)  # cut_turn: send -- as it is
        if response.parse_error is not None:
            return await super().step(response)
        if self.action_field is not None:
            result = await self.client.step({self.action_field: response.text})
            reward, done = float(result.reward or 0.0) + self.take_reward(), bool(result.done)
            shown = (
                []
                if done
                else [{"role": "user", "content": observation_text(result.observation, self.observation_field)}]
            )
            return StepResult(shown, reward=reward, done=done)
        if not response.tool_calls:  # the agent stops acting: the episode ends, worth what it earned
            return StepResult(reward=self.take_reward(), done=True)
        result = await super().step(response)
        result.reward = self.take_reward()
        result.done = self.server_done
        return result

    def _cut_turn(self, response: ParsedResponse) -> StepResult | None:
        """The penalty for a turn cut at the token limit, or None to send it (``cut_turn``)."""
        sendable = self.action_field is not None or bool(response.tool_calls)
        if self.cut_turn == "send" and sendable:
            return None
        self.take_reward()
        return StepResult(
            reward=self.cut_turn_reward,
            done=True,
            metrics={"cut_turns": 1.0},
            feedback=f"the turn was cut at the token limit: reward {self.cut_turn_reward:g} (cut_turn_reward)",
        )

    def take_reward(self) -> float:
        reward, self.pending_reward = self.pending_reward, 0.0
        return reward

    async def cleanup(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
