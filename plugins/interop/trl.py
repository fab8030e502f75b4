"""tempering's environments and rewards inside TRL's ``GRPOTrainer``.

A TRL user keeps TRL's trainer and takes tempering's pieces by name::

    from tempering.plugins.interop import trl as tt

    calc = tt.environment_factory("calculator")
    trainer = GRPOTrainer(model, args=GRPOConfig(...), train_dataset=rows,
                          environment_factory=calc, reward_funcs=[tt.environment_reward])

or scores plain completions with registered rewards: ``reward_funcs=tt.reward_funcs("exact_match")``.

How an environment maps onto TRL's ``environment_factory`` contract (TRL 1.16, read from
``GRPOTrainer._generate_and_score_completions`` and ``_tool_call_loop``): TRL builds a pool of
instances and calls ``reset(**row)`` before each rollout, appends the string it returns to the
prompt's last user message, exposes every public method as a tool, and calls the tool methods
itself while it generates. The instance this module returns is a thin shell around one tempering
:class:`~tempering.rollouts.environment.Environment` per episode (a fresh one at every ``reset``,
as tempering's own sampler does): its public methods are the environment's ``@tool``s with their
signatures and docstrings, and each call is played through the environment's ``step`` -- so an
environment that counts or checks calls (the calculator's ``right_calls``) sees them as in
tempering. The final answer is not a tool call, so TRL never shows it to the environment; the
:func:`environment_reward` reward function does: it plays the final turn through ``step`` (which
scores it with the environment's ``score``) and returns the episode's summed reward.

Differences from tempering's own episodes, by TRL's design: TRL renders with the tokenizer's
chat template (not a tempering renderer), runs a turn's calls one at a time (each is one
``step`` here), and stops a rollout on its ``max_completion_length`` rather than on the
environment's limits. The async environment code runs on one event loop in a daemon thread of
this module, each call bounded by ``timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import json
import logging
import threading
import traceback
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

from tempering.registry import get_registry
from tempering.rollouts.chat import ParsedResponse, ToolCall
from tempering.rollouts.environment import Environment
from tempering.rollouts.scoring import reward_number
from tempering.rollouts.tools import Tool

T = TypeVar("T")
log = logging.getLogger(__name__)

__all__ = [
    "ROW_PROMPT",
    "TRLEnvironment",
    "ToolFailed",
    "environment_factory",
    "environment_reward",
    "prompts",
    "reward_funcs",
    "tiny_chat_template",
]


# ---------------------------------------------------------------------------------------- loop
class _Loop:
    """One event loop in a daemon thread, where every wrapped environment's async code runs.

    Why not ``asyncio.run`` per call: TRL calls tools from its training thread, which may already
    run a loop (TRL's own, for async rewards); and a tool of ours may leave a daemon thread
    behind that refers to the loop it started on."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="tempering-trl", daemon=True).start()
            loop = cls._loop
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            future.cancel()
            limit = f"{timeout:g} s"
            raise TimeoutError(f"{what} did not return within {limit} (environment_factory(timeout=...))") from None


async def _value(x: object) -> Any:
    return await x if inspect.isawaitable(x) else x


# ---------------------------------------------------------------------------------------- environments
#: The column :func:`prompts` keeps a row's own ``prompt`` in (TRL's ``prompt`` column becomes
#: the environment's first messages); ``reset`` gives it back to the environment as ``prompt``.
ROW_PROMPT = "tempering_prompt"


class ToolFailed(RuntimeError):
    """A tool call the environment reports as failed (bad arguments, the tool raised or timed
    out), raised from the tool method so that TRL counts it in ``tools/failure_frequency`` and
    shows the model its text (TRL's ``{"error": ...}``). The environment has counted it too
    (``env/tool_errors``)."""


class TRLEnvironment:
    """One TRL rollout's environment (see the module docs). Subclassed per environment by
    :func:`environment_factory`, which adds one public method per tool; everything else here is
    private or named ``reset``, because TRL offers every other public method to the model.

    After a rollout: ``_reward`` (the summed turn rewards, ``None`` until the final turn is
    scored), ``_metrics`` (the environment's metrics, summed), ``_errors`` (tool errors and
    failures, in order) and ``_transcript`` (the messages as the environment saw them)."""

    _make: Callable[[], Environment]
    _timeout: float | None = 60.0

    def __init__(self) -> None:
        self._env: Environment | None = None
        self._clear()

    def _clear(self) -> None:
        self._reward: float | None = None
        self._done = False
        self._metrics: dict[str, float] = {}
        self._errors: list[str] = []
        self._transcript: list[dict[str, Any]] = []

    def reset(self, **row: object) -> str | None:
        """Start a new episode from a dataset row. Returns the environment's first user message
        for TRL to append to the (empty) prompt, or ``None`` when the row's ``prompt`` already is
        the environment's first messages."""
        self._close()
        self._clear()  # a pooled instance starts each episode clean
        self._env = type(self)._make()
        example = {k: v for k, v in row.items() if k != "prompt"}
        if ROW_PROMPT in example:  # the row's own prompt, which prompts() kept for the environment
            example["prompt"] = example.pop(ROW_PROMPT)
        messages = self._run(self._env.reset(example), "environment.reset()")
        self._transcript = [dict(m) for m in messages]
        prompt = row.get("prompt")
        if prompt is not None and _same_messages(prompt, messages):
            return None
        one_user_message = len(messages) == 1 and messages[0].get("role") == "user"
        if prompt in (None, [], [{"role": "user", "content": ""}]) and one_user_message:
            return str(messages[0].get("content") or "")
        raise ValueError(
            f"environment.reset() gave {len(messages)} message(s) that the row's 'prompt' does not hold: leave "
            "'prompt' out of the dataset (a single user message is then appended to TRL's empty prompt), or fill it "
            "with tempering.plugins.interop.trl.prompts(...)"
        )

    def _tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Play one tool call as one environment turn; the tool message's content is the result."""
        response = ParsedResponse(tool_calls=[ToolCall(name, dict(arguments))])
        result = self._step(response)
        contents = [str(m.get("content", "")) for m in result.messages if m.get("role") == "tool"]
        if result.errors:
            raise ToolFailed("\n".join(contents) or "; ".join(result.errors))
        return "\n".join(contents)

    def _finish(self, message: Mapping[str, Any] | None) -> float | None:
        """Play the final assistant turn (its text) and return the episode's reward; a rollout
        that ended on a tool call (TRL's length or iteration limit) is worth 0, as tempering's
        ``on_max_turns: zero``."""
        if self._env is None:
            raise RuntimeError("environment_reward: this environment was never reset")
        if self._done:
            return self._reward
        if message is None or message.get("tool_calls"):
            self._done, self._reward = True, 0.0
            return 0.0
        text = str(message.get("content") or "")
        result = self._step(ParsedResponse(text=text, raw=text))
        if not result.done:  # an environment that wants more turns than TRL gave it
            self._done, self._reward = True, 0.0
        return self._reward

    def _step(self, response: ParsedResponse) -> Any:
        assert self._env is not None
        self._transcript.append(response.to_message())
        result = self._run(self._env.step(response), "environment.step()")
        self._transcript.extend(dict(m) for m in result.messages)
        for k, v in result.metrics.items():
            self._metrics[k] = self._metrics.get(k, 0.0) + float(v)
        self._errors.extend(result.errors)
        if result.reward is not None or not result.done:
            self._reward = (self._reward or 0.0) + reward_number(result.reward or 0.0)
        elif result.done:
            self._reward = None  # the environment leaves the final answer to a reward component
        self._done = result.done
        return result

    def _run(self, coro: Coroutine[Any, Any, T], what: str) -> T:
        try:
            return _Loop.run(coro, type(self)._timeout, what)
        except Exception as exc:
            self._errors.append(f"{what} raised {type(exc).__name__}: {exc}")
            _first_traceback(type(self).__name__, exc)
            raise

    def _close(self) -> None:
        """Run the finished episode's ``cleanup`` (at the next ``reset``: TRL has no end-of-rollout hook)."""
        env, self._env = getattr(self, "_env", None), None
        if env is not None:
            try:
                _Loop.run(_value(env.cleanup()), type(self)._timeout, "environment.cleanup()")
            except Exception as exc:  # noqa: BLE001 - a failing cleanup is logged, not fatal to training
                _first_traceback(type(self).__name__, exc)


_shown: set[str] = set()


def _first_traceback(label: str, exc: BaseException) -> None:
    """Log the first traceback of each environment class (later failures only count)."""
    if label not in _shown:
        _shown.add(label)
        log.warning("%s: first environment failure:\n%s", label, "".join(traceback.format_exception(exc)))


def _same_messages(prompt: object, messages: Sequence[Mapping[str, Any]]) -> bool:
    if not isinstance(prompt, list) or len(prompt) != len(messages):
        return False
    return all(
        p.get("role") == m.get("role") and p.get("content") == m.get("content") for p, m in zip(prompt, messages)
    )


#: JSON schema types as the Python annotations transformers' ``get_json_schema`` maps back to them.
_JSON_TYPES: dict[str, Any] = {
    "integer": int,
    "number": float,
    "string": str,
    "boolean": bool,
    "array": list,
    "object": dict,
}


def _tool_method(tool: Tool) -> Callable[..., str]:
    """A method named after the tool whose signature and Google-style docstring are built from
    the tool's JSON schema (what TRL and transformers' ``get_json_schema`` read back), and which
    plays the call through the environment. Built from the schema rather than copied from the
    tool's function, so a tool whose function takes ``**kwargs`` (the ``openenv`` action) works
    too."""
    name = tool.name

    def method(self: TRLEnvironment, **arguments: object) -> str:
        return self._tool(name, arguments)

    props: dict[str, Any] = dict((tool.parameters or {}).get("properties") or {})
    required = set((tool.parameters or {}).get("required") or [])
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {"return": str}
    lines = [tool.description or f"The {name} tool.", "", "Args:"]
    for key, prop in sorted(props.items(), key=lambda kv: kv[0] not in required):  # required first
        kind = _JSON_TYPES.get(str(prop.get("type")), Any)
        annotations[key] = kind if key in required else kind | None
        default = inspect.Parameter.empty if key in required else prop.get("default")
        params.append(
            inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotations[key])
        )
        said = " ".join(str(prop.get("description") or prop.get("title") or key).split())
        lines.append(f"    {key}: {said}")
    method.__name__ = method.__qualname__ = name
    method.__doc__ = "\n".join(lines if props else lines[:1])
    method.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    return method


def environment_factory(
    spec: str | Mapping[str, Any] | Callable[[], Environment], *, timeout: float | None = 60.0, **args: object
) -> type[TRLEnvironment]:
    """A TRL ``environment_factory`` for a tempering environment.

    ``spec``: a registered environment's name (``"calculator"``), a mapping ``{name: ..., <keys>}``,
    or an :class:`Environment` class; ``args`` are its config keys. ``timeout``: seconds per
    environment call (reset, step, cleanup). Bad names and keys fail here, before TRL starts.
    Returns a class: TRL calls it to make each pooled instance."""
    if isinstance(spec, str) or isinstance(spec, Mapping):
        named = {"name": spec, **args} if isinstance(spec, str) else {**spec, **args}
        make = get_registry().factory("environment", named, path="environment_factory")
        label = str(named["name"])
    elif callable(spec):
        make = functools.partial(spec, **args)
        label = getattr(spec, "__name__", "environment")
    else:
        got = type(spec).__name__
        raise TypeError(f"environment_factory: expected a name, a mapping or an Environment class, got {got}")
    probe = make()
    if not isinstance(probe, Environment):
        raise TypeError(f"environment_factory: '{label}' built a {type(probe).__name__}, not a tempering Environment")
    tools = probe.tools()
    clash = [t.name for t in tools if t.name in ("reset", "get_reward") or t.name.startswith("_")]
    if clash:
        raise ValueError(f"environment_factory: tool name(s) {clash} clash with TRL's environment methods; rename them")
    attrs: dict[str, Any] = {t.name: _tool_method(t) for t in tools}
    attrs.update(_make=staticmethod(make), _timeout=timeout, __doc__=f"The '{label}' environment for TRL.")
    cls_name = "".join(part.capitalize() for part in label.replace("-", "_").split("_")) + "TRLEnvironment"
    return type(cls_name, (TRLEnvironment,), attrs)


def environment_reward(
    completions: Sequence[Any],
    environments: Sequence[Any] | None = None,
    log_metric: Callable[[str, float], None] | None = None,
    **_: object,
) -> list[float | None]:
    """TRL reward function: the episode's reward from the tempering environment.

    Plays each rollout's final assistant message through the environment's ``step`` (its
    ``score``) and returns the summed turn rewards (``None``, which TRL skips, where the
    environment leaves scoring to a reward component). An environment that raises or times out
    on the final turn gives ``None`` too (its first traceback is logged) and is counted in
    ``env/failed``, the share of the batch. Logs the environments' metrics averaged over the
    batch as ``env/<name>`` through TRL's ``log_metric``."""
    if environments is None:
        raise ValueError("environment_reward needs GRPOTrainer(environment_factory=environment_factory(...))")
    rewards: list[float | None] = []
    failed = 0
    for completion, env in zip(completions, environments, strict=True):
        if not isinstance(env, TRLEnvironment):
            rewards.append(None)
            continue
        try:
            rewards.append(env._finish(_last_assistant(completion)))
        except Exception:  # noqa: BLE001 - one episode's failure must not stop training; _run logged it
            failed += 1
            rewards.append(None)
    ours = [e for e in environments if isinstance(e, TRLEnvironment)]
    if log_metric is not None and ours:
        log_metric("env/failed", failed / len(ours))
        for key in sorted({k for e in ours for k in e._metrics}):
            log_metric(f"env/{key}", sum(e._metrics.get(key, 0.0) for e in ours) / len(ours))
    return rewards


def _last_assistant(completion: Any) -> Mapping[str, Any] | None:
    if isinstance(completion, str):
        return {"role": "assistant", "content": completion}
    for message in reversed(list(completion)):
        if message.get("role") == "assistant":
            return message
        if message.get("role") == "tool":
            return None  # the rollout stopped after a tool result, before the model answered
    return None


# ---------------------------------------------------------------------------------------- rewards
def reward_funcs(*specs: str | Mapping[str, Any]) -> list[Callable[..., list[float | None]]]:
    """TRL reward functions from registered tempering rewards (``"exact_match"``,
    ``{"name": "math_answer", ...}``): each is called with the completion's final text and the
    row's other columns as the example. A reward that raises or returns a non-number gives
    ``None`` for that completion (TRL leaves it out) and its first traceback is logged."""
    registry = get_registry()
    out = []
    for i, spec in enumerate(specs):
        reward = registry.build("reward", spec, path=f"reward_funcs[{i}]")
        name = spec if isinstance(spec, str) else str(spec["name"])
        out.append(_reward_function(reward, name))
    return out


def _reward_function(reward: Callable[..., Any], name: str) -> Callable[..., list[float | None]]:
    def score(prompts: Sequence[Any], completions: Sequence[Any], **columns: object) -> list[float | None]:
        rows = _rows(len(completions), columns)
        out: list[float | None] = []
        for completion, example in zip(completions, rows, strict=True):
            final = _last_assistant(completion)
            text = str((final or {}).get("content") or "")
            try:
                out.append(reward_number(_Loop.run(_value(reward(text, example)), 600.0, f"reward {name}")))
            except Exception as exc:  # noqa: BLE001 - TRL skips a None; the failure is logged once
                _first_traceback(f"reward {name}", exc)
                out.append(None)
        return out

    score.__name__ = score.__qualname__ = name
    return score


_TRL_KWARGS = {"trainer_state", "log_extra", "log_metric", "environments", "completion_ids"}


def _rows(n: int, columns: Mapping[str, Any]) -> list[dict[str, Any]]:
    keys = [k for k in columns if k not in _TRL_KWARGS]
    return [{k: columns[k][i] for k in keys} for i in range(n)]


# ---------------------------------------------------------------------------------------- tiny_chat
#: A Jinja chat template that renders the ``tiny_chat`` format token for token, so TRL (which
#: renders prompts with the tokenizer's chat template) can drive the tiny in-code chat models.
#: ``ALPHABET`` is replaced by the tokenizer's characters: text the model reads but did not
#: write is kept inside them as the ``tiny_chat`` renderer does (a letter outside it lower-cased,
#: anything else ``?``), since a character tokenizer has no unknown token.
TINY_CHAT_TEMPLATE = (
    "{%- set alphabet = ALPHABET %}"
    "{%- macro seen(text) %}{% for ch in text %}{% if ch in alphabet %}{{ ch }}"
    "{% elif ch|lower in alphabet %}{{ ch|lower }}{% elif '?' in alphabet %}?{% endif %}{% endfor %}{% endmacro %}"
    "{{ bos_token }}"
    "{%- if tools %}{% set ns = namespace(line='tools:') %}{% for t in tools %}"
    "{% set f = t.function if t.function is defined else t %}"
    "{% set ns.line = ns.line ~ ' ' ~ f.name ~ '(' ~ (f.parameters.properties or {}).keys()|join(',') ~ ')' %}"
    "{% endfor %}<|system|>{{ seen(ns.line) }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{%- for c in m.tool_calls or [] %}{% set f = c.function if c.function is defined else c %}<|call|>{{ f.name }}("
    "{%- for k, v in f.arguments.items() %}{{ k }}={{ v|tojson }}{% if not loop.last %},{% endif %}{% endfor %})"
    "{%- endfor %}{{ eos_token }}"
    "{%- else %}<|{{ m.role }}|>{{ seen(m.content) }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: How transformers' ``parse_response`` (>= 5.13) reads a ``tiny_chat`` turn back: text up to
#: EOS, and ``<|call|>name(k=v,...)`` calls with JSON (or single-quoted) literal values.
TINY_CHAT_RESPONSE_TEMPLATE: dict[str, Any] = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|assistant|>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<\|call\|>(?P<name>\w+)\(",
            "close_pattern": r"\)",
            "repeats": True,
            "content": "xml-inline",
            "content_args": {
                "tag_pattern": r"(?P<key>\w+)=(?P<value>\"[^\"]*\"|'[^']*'|[^,)]*)",
                "value_parser": {"name": "json", "args": {"string_delims": [["'", "'"]], "allow_non_json": True}},
            },
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"<eos>", "content": "text"},
    },
}


def tiny_chat_template(tokenizer: PreTrainedTokenizerBase) -> Any:
    """Give a ``tiny_chat`` tokenizer (``tiny_llama(chat=True)``) the chat and response templates
    TRL's tool loop needs; returns the tokenizer. Real chat models ship their own."""
    if tokenizer.convert_tokens_to_ids("<|call|>") in (None, tokenizer.unk_token_id):
        raise ValueError("tiny_chat_template: the tokenizer has no <|call|> token (build the model with chat=True)")
    alphabet = "".join(sorted(t for t in tokenizer.get_vocab() if len(t) == 1))
    tokenizer.chat_template = TINY_CHAT_TEMPLATE.replace("ALPHABET", json.dumps(alphabet), 1)
    tokenizer.response_template = TINY_CHAT_RESPONSE_TEMPLATE
    return tokenizer


def prompts(rows: Iterable[Mapping[str, Any]], environment: type[TRLEnvironment]) -> list[dict[str, Any]]:
    """``rows`` with a ``prompt`` column holding each environment's first messages (for
    environments whose ``reset`` gives more than one user message). A row's own ``prompt`` is
    kept as ``tempering_prompt`` (:data:`ROW_PROMPT`) and given back to the environment's
    ``reset`` as ``prompt``, so an environment that reads it still does under TRL."""
    out = []
    for row in rows:
        env = environment._make()
        try:
            messages = _Loop.run(env.reset(dict(row)), environment._timeout, "environment.reset()")
        finally:
            _Loop.run(_value(env.cleanup()), environment._timeout, "environment.cleanup()")
        kept = {ROW_PROMPT: row["prompt"]} if "prompt" in row else {}
        out.append({**row, **kept, "prompt": [dict(m) for m in messages]})
    return out
