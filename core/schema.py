"""One validation style: a component's schema is its fields plus one check of its values.

Every configurable thing -- a registered component (a loss, an advantage estimator, ...) or a
nested block of a stage (``optimizer:``) -- is validated the same way, once:

1. its **fields**: a dataclass's (or a factory's ``Params`` dataclass's, or its signature):
   unknown keys (with a suggestion), missing required keys, values of the wrong type
   (:func:`tempering.registry.validate_params`);
2. its **check**, ``check_config(config) -> Iterable[Problem]`` (a static method or function
   attribute): the values that cannot work, as ``(key, message)`` pairs -- ``key`` relative to
   the component (``loss_type``; ``""`` for the component as a whole), ``message`` one line.
   ``config`` holds every field, the user's values over the defaults. A check yields; it never
   raises, never parses another check's message, and may yield ``None`` (nothing wrong), which
   :func:`one_of` returns for a valid choice.

Who runs the check: the registry, when it builds or checks a spec (:func:`check_config_at`,
the first problem as a one-line :class:`~tempering.errors.ConfigError` at the full key path,
``stages[1].loss.loss_type: GRPOLoss.loss_type must be one of ..., got 'dpao'. Did you mean
'dapo'?``); :func:`tempering.training.stage.sub_config` for a nested block; and, for a dataclass built
directly in Python (``GRPOLoss(loss_type="x")``), its ``__post_init__`` through
:func:`raise_problems` (a ``ValueError`` with the same message). One check, every caller.

A third-party loss, complete::

    @dataclass
    class MyLoss:
        temperature: float = 1.0

        @staticmethod
        def check_config(config):
            if not config["temperature"] > 0:
                yield Problem("temperature", f"must be > 0, got {config['temperature']}")

        def __post_init__(self):
            raise_problems(self)

A check that shares a helper with the code building the component -- one that returns the
values the build needs and raises a :class:`~tempering.errors.ConfigError` at a key path (the
local backend's ``check_model``) -- turns that error into its problem with :func:`caught`.

This module imports nothing but the standard library and :mod:`tempering.errors`, so the pure
maths (:mod:`tempering.rlmath`) can declare its checks here too.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from tempering.errors import ConfigError

__all__ = [
    "CHECK_CONFIG",
    "Problem",
    "caught",
    "check_config_at",
    "choice_message",
    "config_problems",
    "field_values",
    "first_problem",
    "one_of",
    "raise_problems",
]

#: The name of a component's check (see the module docstring).
CHECK_CONFIG = "check_config"


class Problem(NamedTuple):
    """One thing wrong with a component's config: ``key`` relative to the component (``""``: the
    component as a whole) and a one-line ``message``."""

    key: str
    message: str


def one_of(key: str, value: object, choices: Iterable[str], message: str) -> Problem | None:
    """A :class:`Problem` at ``key`` when ``value`` is not one of ``choices``: ``message``, plus
    the closest choice when the value is a string (``. Did you mean 'dapo'?``); else ``None``."""
    options = list(choices)
    if value in options:
        return None
    close = difflib.get_close_matches(value, options, n=1) if isinstance(value, str) else []
    return Problem(key, message + (f". Did you mean '{close[0]}'?" if close else ""))


def choice_message(value: object, choices: Iterable[str]) -> str:
    """The stages' wording for a value outside ``choices``: ``use one of a, b (got 'x').`` and
    the closest choice (``Did you mean 'a'?``)."""
    options = list(choices)
    close = difflib.get_close_matches(str(value), options, n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"use one of {', '.join(options)} (got '{value}').{hint}"


def config_problems(factory: Callable[..., Any], config: Mapping[str, Any]) -> list[Problem]:
    """The problems ``factory``'s check finds in ``config`` (every key), in the order it yields
    them; none for a factory without a check."""
    check = getattr(factory, CHECK_CONFIG, None)
    return [p for p in (check(config) if callable(check) else ()) if p is not None]


def first_problem(factory: Callable[..., Any], config: Mapping[str, Any]) -> Problem | None:
    """The first problem ``factory``'s check finds in ``config``, or ``None``. The check runs
    only that far: what it would look at after a problem (the local backend's hub lookup of its
    model name) is not done for an error that will not be shown."""
    check = getattr(factory, CHECK_CONFIG, None)
    return next((p for p in (check(config) if callable(check) else ()) if p is not None), None)


def caught(root: str, helper: Callable[..., object], *args: object) -> Problem | None:
    """What ``helper(*args)`` raises, as a :class:`Problem`; ``None`` when it returns.

    ``helper`` raises a :class:`ConfigError` at a key path under ``root``, a stand-in for the
    component's real path, which a check does not know: the check passes ``root`` (or a path
    under it) wherever the helper takes a path. The error's ``path`` less ``root.`` is the
    problem's key and its bare ``message`` the message, so no text is parsed. An error outside
    ``root`` keeps its whole text at the component. Any other exception (a broken plugin's
    ``PluginError``) is no problem of the config's values and propagates."""
    try:
        helper(*args)
    except ConfigError as error:
        path = error.path or ""
        if path == root:
            return Problem("", error.message)
        if path.startswith(root + "."):
            return Problem(path[len(root) + 1 :], error.message)
        return Problem("", str(error))
    return None


def field_values(component: Any) -> dict[str, Any]:
    """A dataclass instance's fields by name (not deep-copied, unlike ``dataclasses.asdict``)."""
    return {f.name: getattr(component, f.name) for f in dataclasses.fields(component)}


def raise_problems(component: object) -> None:
    """For a dataclass component's ``__post_init__``: run its class's check on its own fields and
    raise the first problem as a ``ValueError`` (a Python caller's error; the registry reports
    the same problem as a :class:`ConfigError` at its key, before building)."""
    problem = first_problem(type(component), field_values(component))
    if problem is not None:
        raise ValueError(problem.message)


def check_config_at(factory: Callable[..., Any], config: Mapping[str, Any], path: str) -> None:
    """Raise the first problem of ``factory``'s check on ``config`` as a one-line
    :class:`ConfigError` at its full key path (``path``: the component's)."""
    problem = first_problem(factory, config)
    if problem is not None:
        key, message = problem
        raise ConfigError(message, f"{path}.{key}" if key else path)
