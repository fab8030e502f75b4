"""Tools: plain typed Python functions (sync or async) that a model may call.

A tool's JSON schema -- what the renderer shows the model -- is derived from its signature and
Google-style docstring by ``transformers.utils.get_json_schema`` (the function Hugging Face chat
templates use for ``tools=``), so a tool is documented exactly once, in its docstring, and a
tool without a description for every argument is refused when the environment is built rather
than shown to the model half-described.

Calling a tool never raises: a tool that raises, is called with bad arguments, does not exist
or runs past its timeout returns a :class:`ToolResult` whose ``content`` is an error text the
model sees as the tool's answer (so it can recover), and whose ``error`` the sampler counts.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__tempering_tool__"


def tool(fn: F | None = None, *, name: str | None = None, timeout: float | None = None) -> Any:
    """Mark a function or an environment method as a tool: ``@tool`` or ``@tool(timeout=5)``.

    ``name`` defaults to the function's name; ``timeout`` (seconds) overrides the environment's
    ``tool_timeout`` for this tool.
    """

    def mark(f: F) -> F:
        setattr(f, _MARK, {"name": name or f.__name__, "timeout": timeout})
        return f

    return mark(fn) if fn is not None else mark


def is_tool(obj: object) -> bool:
    return callable(obj) and hasattr(obj, _MARK)


@dataclass
class ToolResult:
    """What one call returned: ``content`` for the model, ``error`` (None on success) for the
    metrics and the episode's feedback -- it names the tool (``tool mul raised ValueError: ...``,
    ``tool mul timed out after 5s``, ``bad arguments for mul: ...``) --, ``timed_out``, the
    wall time, and ``arguments``: the call's arguments as the tool received them, defaults
    filled in (empty when they did not bind), so an environment that acts on them (which
    documents a search showed) need not bind them again."""

    content: str
    error: str | None = None
    timed_out: bool = False
    seconds: float = 0.0
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class Tool:
    """A callable with the JSON schema a renderer declares to the model."""

    name: str
    fn: Callable[..., Any]
    description: str
    parameters: dict[str, Any]
    timeout: float | None = None

    @classmethod
    def from_function(cls, fn: Callable[..., Any], name: str | None = None, timeout: float | None = None) -> Tool:
        """Build a tool from a typed, documented function (bound methods included).

        Raises ``ValueError`` naming the function when its docstring does not describe it and
        each argument (``transformers.utils.get_json_schema``'s rules)."""
        from transformers.utils import get_json_schema

        mark = getattr(fn, _MARK, {}) or {}
        try:
            schema = get_json_schema(fn)["function"]
        except Exception as exc:  # noqa: BLE001 - DocstringParsingException, TypeHintParsingException
            label = getattr(fn, "__qualname__", repr(fn))
            raise ValueError(
                f"tool {label}: {str(exc).rstrip('!.')}. Give it type hints and a Google-style docstring with an "
                "'Args:' entry per argument"
            ) from None
        return cls(
            name=name or mark.get("name") or schema["name"],
            fn=fn,
            description=schema.get("description", ""),
            parameters=schema.get("parameters", {"type": "object", "properties": {}}),
            timeout=timeout if timeout is not None else mark.get("timeout"),
        )

    def spec(self) -> dict[str, Any]:
        """The OpenAI ``tools=[...]`` entry."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    async def call(self, arguments: Mapping[str, Any], timeout: float | None = None) -> ToolResult:
        """Run the tool; never raises (except cancellation). ``timeout`` applies unless the tool
        has its own. A sync tool runs in a daemon thread, so a slow one does not stall the
        other episodes; past its timeout the episode moves on and the thread is left behind
        (a thread cannot be killed: a tool that may hang for good belongs in a subprocess)."""
        limit = self.timeout if self.timeout is not None else timeout
        t0 = time.perf_counter()
        try:
            bound = inspect.signature(self.fn).bind(**dict(arguments))
        except TypeError as exc:
            return ToolResult(f"Error: bad arguments for {self.name}: {exc}", f"bad arguments for {self.name}: {exc}")
        bound.apply_defaults()
        received = dict(bound.arguments)
        try:
            if inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None)):
                value = await asyncio.wait_for(self.fn(*bound.args, **bound.kwargs), limit)
            else:
                call = functools.partial(self.fn, *bound.args, **bound.kwargs)
                value = await asyncio.wait_for(_in_daemon_thread(call), limit)
                if inspect.isawaitable(value):
                    value = await asyncio.wait_for(value, limit)
        except (asyncio.TimeoutError, TimeoutError):
            seconds = time.perf_counter() - t0
            msg = f"tool {self.name} timed out after {limit:g}s"
            return ToolResult(f"Error: {msg}", msg, timed_out=True, seconds=seconds, arguments=received)
        except Exception as exc:  # noqa: BLE001 - a tool bug is the model's observation, not a crash
            return ToolResult(
                f"Error: {type(exc).__name__}: {exc}",
                f"tool {self.name} raised {type(exc).__name__}: {exc}",
                seconds=time.perf_counter() - t0,
                arguments=received,
            )
        return ToolResult(format_result(value), seconds=time.perf_counter() - t0, arguments=received)


def _in_daemon_thread(call: Callable[[], Any]) -> asyncio.Future[Any]:
    """Run a sync tool on a daemon thread of its own. Not the loop's default executor: a tool
    that never returns would then hold up the end of every rollout (``asyncio.run`` waits for
    that executor) and the interpreter's exit; a daemon thread is simply left behind."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def run() -> None:
        try:
            value, ok = call(), True
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting episode
            value, ok = exc, False
        try:
            loop.call_soon_threadsafe(settle, ok, value)
        except RuntimeError:  # the loop closed while the tool ran past its timeout
            pass

    threading.Thread(target=run, name="tempering-tool", daemon=True).start()
    return future


def format_result(value: object) -> str:
    """A tool's return value as the text of its tool message: strings as they are, JSON for
    containers, ``str()`` otherwise."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple, bool)) or value is None:
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def tools_of(obj: object) -> list[Tool]:
    """The ``@tool``-marked methods of ``obj`` (an environment), in definition order."""
    found = []
    seen: set[str] = set()
    for klass in reversed(type(obj).__mro__):
        for attr, member in vars(klass).items():
            if is_tool(member) and attr not in seen:
                seen.add(attr)
                found.append(attr)
    return [Tool.from_function(getattr(obj, attr)) for attr in found]


def as_tools(items: Sequence[Any]) -> list[Tool]:
    """Tools from a mix of :class:`Tool` objects and plain functions; names must be unique."""
    out = [t if isinstance(t, Tool) else Tool.from_function(t) for t in items]
    names = [t.name for t in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"two tools are named {', '.join(dupes)}: tool names must be unique")
    return out
