"""pluggy hook specifications: one hook per component kind.

A plugin module implements any of these with ``@tempering.hookimpl`` and calls ``register``
once per component::

    @hookimpl
    def register_rewards(register):
        register("brier", "my_pkg.rewards:brier", description="Brier score of a forecast")

``register(name, target, *, description="", override=False)`` takes the component's factory or
a lazy ``"module:attr"`` string (preferred: plugins must not import torch at load time so that
``tempering plugins`` stays fast). Hooks return nothing: the registry collects every call, so a
duplicate name from two packages is detected instead of silently shadowed; ``override=True``
says a package replaces another's component of that name on purpose.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

PROJECT = "tempering"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]


@hookspec
def register_backends(register: Register) -> None:
    """Register training backends (``local``, ``tinker``)."""


@hookspec
def register_samplers(register: Register) -> None:
    """Register samplers: turn a batch of examples into groups of scored samples (``completion``:
    single turn; ``environment``: multi-turn episodes with tools)."""


@hookspec
def register_environments(register: Register) -> None:
    """Register environments: classes whose instances play one multi-turn episode each."""


@hookspec
def register_renderers(register: Register) -> None:
    """Register renderers: messages <-> tokens, stop tokens and parsing for a chat format."""


@hookspec
def register_rewards(register: Register) -> None:
    """Register reward functions."""


@hookspec
def register_advantages(register: Register) -> None:
    """Register advantage estimators."""


@hookspec
def register_losses(register: Register) -> None:
    """Register losses."""


@hookspec
def register_algorithms(register: Register) -> None:
    """Register algorithms (training stages)."""


@hookspec
def register_datasets(register: Register) -> None:
    """Register datasets."""


@hookspec
def register_loggers(register: Register) -> None:
    """Register metric loggers."""


@hookspec
def register_models(register: Register) -> None:
    """Register model builders for the local backend: a callable taking the recipe's
    ``model_kwargs`` and returning a :class:`tempering.interfaces.LoadedModel` (the model, its
    tokenizer and the renderer the model declares for ``renderer: auto``) or a plain
    ``(model, tokenizer)`` pair (no declared renderer)."""


@hookspec
def register_recipes(register: Register) -> None:
    """Register bundled recipes: ``target`` is a path to a YAML file (or a callable returning
    a dict), so ``tempering run NAME`` can find it."""


@hookspec
def register_harnesses(register: Register) -> None:
    """Register agent harnesses: ``async def run(client, example)`` functions that play one
    episode against the policy's OpenAI-compatible endpoint (the ``agent`` sampler's
    ``harness:``), returning the episode's reward, ``None``, or ``{"reward": ...}``."""


#: component kind -> hook name. The single source of truth for the kinds.
KINDS: dict[str, str] = {
    "backend": "register_backends",
    "sampler": "register_samplers",
    "reward": "register_rewards",
    "advantage": "register_advantages",
    "loss": "register_losses",
    "algorithm": "register_algorithms",
    "dataset": "register_datasets",
    "logger": "register_loggers",
    "model": "register_models",
    "recipe": "register_recipes",
    "environment": "register_environments",
    "renderer": "register_renderers",
    "harness": "register_harnesses",
}
