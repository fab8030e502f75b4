"""The ``python`` reward: a reward function the user wrote, named by its import path.

```yaml
reward: {name: python, function: my_rewards:score}                 # def score(completion, example)
reward: {name: python, function: my_rewards:Judge, params: {strict: true}}   # a class: Judge(strict=True)
```

Components are otherwise named through the registry only (a config that could name any import
path would run any code). This one component is the documented exception, and an explicit one:
the import path sits in its own ``function`` key, so reading a recipe shows that it runs the
user's code. ``tempering serve-reward MODULE:FUNC`` imports the same way.

The working folder goes on ``sys.path`` first, as ``python script.py`` and ``python -m`` do:
``my_rewards.py`` next to where the user runs ``tempering`` imports without being packaged
(a console script such as ``tempering`` otherwise has only its own folder there).

Everything is checked when the recipe is validated -- import errors, a name that is not there,
``params`` a class does not take -- as one line under the key's path, before anything trains.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

from tempering.errors import ConfigError
from tempering.schema import Problem, caught


def working_folder_on_path() -> None:
    """Put the working folder first on ``sys.path`` unless it is already there."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)


def load_function(target: Any, path: str) -> Any:
    """Import ``"module:attr"`` (``attr`` may be dotted: ``mod:Class.method``) with the working
    folder on ``sys.path``; any failure is one :class:`ConfigError` under ``path``."""
    from tempering.plugins.rewards.common import load_target

    module, sep, attr = target.partition(":") if isinstance(target, str) else ("", "", "")
    if not (sep and module and attr):
        raise ConfigError(f"expected 'module:function' (e.g. my_rewards:score), got {target!r}", path)
    working_folder_on_path()
    try:
        return load_target(target)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):  # the module itself
            raise ConfigError(
                f"cannot import '{target}': {exc} (looked in the working folder {os.getcwd()} "
                "and the installed packages)",
                path,
            ) from None
        raise ConfigError(f"importing '{module}' failed: {exc} (a module it imports is not installed)", path) from None
    except AttributeError:
        raise ConfigError(f"module '{module}' has no '{attr}'", path) from None
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise ConfigError(f"importing '{module}' raised {type(exc).__name__}: {exc}", path) from None


def bind(obj: object, params: Mapping[str, Any] | None, path: str, build: bool = True) -> Callable[..., Any] | None:
    """The reward for the imported ``obj``: a class instantiated with ``params``, a function
    with ``params`` bound as keyword arguments, a callable object as it is. ``path`` is the
    component's config path; ``build=False`` only checks."""
    from tempering.registry import validate_params

    params = dict(params or {})
    if inspect.isclass(obj):
        kwargs = validate_params(obj, params, f"{path}.params")
        return cast("Callable[..., Any]", obj(**kwargs)) if build else None
    if not callable(obj):
        raise ConfigError(f"expected a function or class, got a {type(obj).__name__}", f"{path}.function")
    if not params:
        return obj if build else None
    try:
        inspect.signature(obj).bind_partial(None, None, **params)  # (completion, example, **params)
    except TypeError as exc:
        raise ConfigError(f"the reward function does not take these params ({exc})", f"{path}.params") from None
    except ValueError:  # a builtin without a signature: let the call decide
        pass
    return functools.update_wrapper(functools.partial(obj, **params), obj) if build else None


def python_reward(function: str, params: Mapping[str, Any] | None = None) -> Callable[..., Any]:
    """The reward ``function`` names (``module:attr``); ``params`` are passed to a class's
    constructor, or bound as keyword arguments of a function."""
    reward = bind(load_function(function, "reward.function"), params, "reward")
    assert reward is not None
    return reward


def check_reward(function: object, params: Mapping[str, Any] | None, path: str) -> None:
    """Import ``function`` and fit ``params`` to it without building the reward; a
    :class:`ConfigError` under ``path`` (the component's path) for the first thing wrong."""
    bind(load_function(function, f"{path}.function"), params, path, build=False)


def check_config(config: Mapping[str, Any]) -> Iterator[Problem | None]:
    """The reward's check: import and fit now, before anything trains, so a typo in the
    import path is one line at its key (``function``, ``params.strict``)."""
    yield caught("reward", check_reward, config["function"], config["params"], "reward")


python_reward.check_config = check_config  # type: ignore[attr-defined]
