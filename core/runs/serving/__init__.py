"""The one HTTP stack of every tempering server: Starlette on uvicorn, with shared checks.

``tempering serve-reward``, ``tempering view``, the agent sampler's OpenAI-compatible endpoint
and ``serve-tinker`` each give a :class:`~.guard.Policy` (their error shape, authentication,
allowed hosts, which bodies are JSON) and a synchronous handler (:class:`~.guard.Call` ->
:class:`~.guard.Reply`); :func:`~.guard.guarded_app` makes the checks every server needs --
Host allow-list, authentication before the body, body size and time, JSON depth -- and
:class:`~.server.BackgroundServer` serves it from a thread with a head timeout and a connection
cap. What each server accepts from where, with the measured limits: the security sections of
docs/serve-tinker.md, docs/agents.md, docs/rewards.md and docs/observability.md (the viewer).
"""

from tempering.runs.serving.guard import (
    Call,
    Counters,
    Limits,
    Policy,
    Refused,
    Reply,
    guarded_app,
    host_allowed,
    is_loopback_address,
)
from tempering.runs.serving.server import BackgroundServer

__all__ = [
    "BackgroundServer",
    "Call",
    "Counters",
    "Limits",
    "Policy",
    "Refused",
    "Reply",
    "guarded_app",
    "host_allowed",
    "is_loopback_address",
]
