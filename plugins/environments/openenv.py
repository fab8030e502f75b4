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
"""

from __future__ import annotations

import importlib.util
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

from tempering.rollouts.chat import Message, ParsedResponse
from tempering.rollouts.environment import Environment, StepResult
from tempering.rollouts.tools import Tool
from tempering.schema import Problem

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


def observation_text(observation: Mapping[str, Any], field: str | None) -> str:
    """What the model sees of an observation: one field, or the rest as compact JSON."""
    if field is not None:
        value = observation.get(field, "")
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    shown = {k: v for k, v in observation.items() if k not in BOOKKEEPING}
    return json.dumps(shown, ensure_ascii=False, separators=(",", ":"))


class OpenEnv(Environment):
    """Config keys: ``url`` (required), ``action_field`` (None: the action is a tool),
    ``tool_name``, ``observation_field``, ``reset_keys``, ``prompt_key``, ``timeout`` (see the
    module docs)."""

    def __init__(
        self,
        url: str,
        action_field: str | None = None,
        tool_name: str = "act",
        observation_field: str | None = None,
        reset_keys: list[str] | None = None,
        prompt_key: str = "prompt",
        timeout: float = 30.0,
    ) -> None:
        self.url = url.rstrip("/")
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
        try:
            _get_json(f"{url.rstrip('/')}/health", min(float(config["timeout"]), 10.0))
        except (OSError, ValueError) as exc:  # URLError, a timeout, a reply that is not JSON
            reason = getattr(exc, "reason", exc)
            yield Problem("url", f"no OpenEnv server answers at {url} ({reason}); start it or fix the url")

    # ------------------------------------------------------------------ episode
    async def reset(self, example: dict[str, Any]) -> list[Message]:
        from openenv import GenericEnvClient

        missing = [k for k in self.reset_keys if k not in example]
        if missing:
            raise KeyError(f"openenv: reset_keys {missing} are not columns of the example (columns: {sorted(example)})")
        self.client = GenericEnvClient(
            base_url=self.url, connect_timeout_s=self.timeout, message_timeout_s=self.timeout
        )
        result = await self.client.reset(**{k: example[k] for k in self.reset_keys})
        self.pending_reward = float(result.reward or 0.0)
        shown = observation_text(result.observation, self.observation_field)
        prompt = example.get(self.prompt_key)
        return [{"role": "user", "content": f"{prompt}\n\n{shown}" if prompt else shown}]

    def tools(self) -> list[Tool]:
        if self.action_field is not None:
            return []
        schema = action_schema(self.url, self.timeout)
        description = str(schema.get("description") or f"Act in the {schema.get('title', 'OpenEnv')} environment.")
        parameters = {"type": "object", "properties": schema["properties"], "required": schema["required"]}
        return [Tool(name=self.tool_name, fn=self.act, description=description, parameters=parameters)]

    async def act(self, **action: Any) -> str:
        """One ``step`` with the tool call's arguments as the action; its observation as text."""
        if self.server_done:
            raise RuntimeError("the episode is over (the server said done)")
        result = await self.client.step(action)
        self.pending_reward += float(result.reward or 0.0)
        self.server_done = bool(result.done)
        return observation_text(result.observation, self.observation_field)

    async def step(self, response: ParsedResponse) -> StepResult:
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

    def take_reward(self) -> float:
        reward, self.pending_reward = self.pending_reward, 0.0
        return reward

    async def cleanup(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await client.close()
