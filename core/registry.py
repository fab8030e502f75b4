"""Plugin discovery and the component registry.

Plugins are modules named by entry points of group ``tempering``; the built-ins are one such
entry point of the ``tempering`` distribution itself. Each plugin implements hooks of
:mod:`tempering.hookspecs` and calls ``register(name, target)`` once per component.

Why not ``PluginManager.load_setuptools_entrypoints``: it stops at the first plugin that fails
to import, and silently skips an entry point whose name is taken. We load each entry point
ourselves, catch and record its failure (a warning; the rest keep working; an error in strict
mode), key plugins by distribution, and call each hook implementation with a ``register``
bound to its plugin, so every component knows which package provided it. Two packages
providing the same name is an error that names both -- never silent shadowing.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import importlib.metadata as md
import inspect
import os
import re
import types
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy

import tempering.hookspecs as hookspecs
from tempering.errors import ConfigError, PluginError, UnknownComponentError
from tempering.schema import CHECK_CONFIG, check_config_at

if typing.TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import LoadedModel

ENTRY_POINT_GROUP = "tempering"
ENV_LOAD = "TEMPERING_LOAD_PLUGINS"  # comma list of external plugins to load; "" = none
ENV_STRICT = "TEMPERING_STRICT_PLUGINS"  # "1": a plugin that fails to load is an error
BUILTIN_DIST = "tempering"
# A component's schema is its fields (a dataclass factory's, its ``Params`` dataclass's, or the
# factory's signature: :func:`validate_params`) plus its check, ``check_config(config)`` yielding
# ``(key, message)`` problems (:data:`tempering.schema.CHECK_CONFIG`), the one way to check a
# component. :meth:`Registry.check` and :meth:`Registry.build` run both once, before building,
# and report the first problem as a one-line ``ConfigError`` at its full key path. See
# :mod:`tempering.schema`.

#: A component as a recipe gives it: a registered name (``"local"``), a mapping of the name and
#: its keys (``{"name": "local", "model": "tiny_llama"}``), or, from Python, the built object
#: itself (a ``LocalBackend(...)``). The registry resolves the first two; the third is used as
#: it is, so no narrower type fits.
ComponentSpec = Any
#: A factory may define ``config_blocks``, a mapping of its config keys that hold a nested block
#: to the dataclass of that block (the local backend's ``{"lora": LoraParams}``): ``tempering
#: show --resolved`` fills in the block's defaults and ``docs/reference.md`` lists its keys,
#: both without importing the plugin that defines it.
BLOCKS_HOOK = "config_blocks"
#: A factory may define ``moved_keys``: config keys it no longer takes -> where they went (e.g.
#: ``{"max_steps_off_policy": "stale: {max_steps_off_policy: ...}"}``), so an old recipe gets one
#: line saying where to write it instead of "unknown key".
MOVED_KEYS_HOOK = "moved_keys"
#: A factory may also name the values an ``auto`` setting resolves to, for ``show --resolved``:
#: a static ``resolved_values(settings) -> {key: value}`` (the local backend's ``engine: auto``).
RESOLVE_HOOK = "resolved_values"


@dataclass(frozen=True)
class PluginInfo:
    """One loaded (or failed) plugin: an entry point of some distribution."""

    name: str
    dist: str
    version: str
    module: str
    error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.dist}:{self.name}"

    @property
    def builtin(self) -> bool:
        return self.dist == BUILTIN_DIST


class PluginOverrideWarning(UserWarning):
    """A plugin replaces another package's component with ``override=True`` (said at run start)."""


@dataclass
class Component:
    """A registered component: a factory (or lazy ``"module:attr"``) plus where it came from."""

    kind: str
    name: str
    target: Callable[..., Any] | str
    plugin: PluginInfo
    description: str = ""
    override: bool = False

    def load(self) -> Callable[..., Any]:
        """Import a lazy target on first use, so listing plugins never imports torch."""
        if isinstance(self.target, str):
            module, _, attr = self.target.partition(":")
            try:
                obj: Any = importlib.import_module(module)
                for part in attr.split(".") if attr else []:
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as exc:
                raise PluginError(
                    f"{self.kind} '{self.name}' from {self.plugin.dist} points to '{self.target}', "
                    f"which cannot be loaded: {exc!r}. Reinstall or fix that plugin."
                ) from exc
            self.target = obj
            return obj
        return self.target

    @property
    def qualified(self) -> str:
        return f"{self.plugin.dist}:{self.name}"


def _norm(name: str) -> str:
    """Distribution names compare normalised (PEP 503): ``My_Plugin`` is ``my-plugin``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _count_word(n: int) -> str:
    return {2: "two", 3: "three", 4: "four"}.get(n, str(n))


def _allowed_external() -> set[str] | None:
    """Which external plugins ``TEMPERING_LOAD_PLUGINS`` allows (None = all), normalised."""
    raw = os.environ.get(ENV_LOAD)
    if raw is None:
        return None
    return {_norm(p.strip()) for p in raw.split(",") if p.strip()}


def _dist_of(ep: md.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:  # pragma: no cover - very old importlib.metadata
        return "unknown", "?"
    return dist.metadata["Name"] or "unknown", dist.version or "?"


class Registry:
    """Loads plugins and resolves component names of every kind.

    ``Registry()`` loads the entry points of the environment; ``Registry(entry_points=False)``
    starts empty (tests, embedding). :meth:`add_plugin` registers a module or object directly.
    """

    def __init__(self, entry_points: bool = True, strict: bool | None = None) -> None:
        self.strict = os.environ.get(ENV_STRICT, "") == "1" if strict is None else strict
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self._components: dict[str, dict[str, list[Component]]] = {k: {} for k in hookspecs.KINDS}
        if entry_points:
            self.load_entry_points()

    # ------------------------------------------------------------------ loading
    def load_entry_points(self, external: bool = True) -> None:
        """Load the ``tempering`` entry points; ``external=False``: tempering's own only."""
        allowed = _allowed_external() if external else set()
        seen: set[tuple[str, str]] = set()
        for ep in sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist, version = _dist_of(ep)
            if (dist, ep.name) in seen:  # the same distribution visible twice on sys.path
                continue
            seen.add((dist, ep.name))
            if dist != BUILTIN_DIST and allowed is not None and not ({_norm(ep.name), _norm(dist)} & allowed):
                continue
            try:
                module = ep.load()
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not stop the rest
                self._fail(PluginInfo(ep.name, dist, version, ep.value, f"{type(exc).__name__}: {exc}"))
                continue
            self.add_plugin(module, PluginInfo(ep.name, dist, version, ep.value))

    def _fail(self, info: PluginInfo) -> None:
        self.plugins.append(info)
        what = (
            f"plugin '{info.name}' ({info.dist} {info.version}, entry point '{info.module}') "
            f"failed to load: {info.error}."
        )
        fix = f"fix or uninstall it, or exclude it with {ENV_LOAD}"
        if self.strict:  # nothing else loads after this: say so, and how to load the rest anyway
            raise PluginError(
                f"{what} Strict mode ({ENV_STRICT}=1) stops at a broken plugin; {fix}, "
                f"or unset {ENV_STRICT} to load the other plugins without it."
            )
        warnings.warn(f"tempering: {what} The other plugins keep working; {fix}.", RuntimeWarning, stacklevel=3)

    def add_plugin(self, plugin: object, info: PluginInfo | None = None) -> PluginInfo:
        """Register a plugin module/object and collect the components it registers."""
        if info is None:
            name = getattr(plugin, "__name__", type(plugin).__name__)
            info = PluginInfo(name, name, "0", name)
        if self.pm.is_registered(plugin) or self.pm.has_plugin(info.key):  # pluggy would raise ValueError
            self._fail(dataclasses.replace(info, error="already registered (the same module or name twice)"))
            return info
        try:
            self.pm.register(plugin, name=info.key)
            self.pm.check_pending()  # a misspelt hook name is an error, not silently ignored
        except pluggy.PluginValidationError as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._fail(dataclasses.replace(info, error=f"invalid hook: {exc}"))
            return info
        errors = []
        for kind, hook_name in hookspecs.KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin is plugin:
                    try:
                        impl.function(register=self._register_fn(kind, info))
                    except Exception as exc:  # noqa: BLE001
                        errors.append(f"{hook_name} raised {type(exc).__name__}: {exc}")
        if errors:  # listed once, as failed; what its other hooks registered stays usable
            info = dataclasses.replace(info, error="; ".join(errors))
            self._fail(info)
            return info
        self.plugins.append(info)
        return info

    def _register_fn(self, kind: str, info: PluginInfo) -> Callable[..., None]:
        def register(
            name: str, target: Callable[..., Any] | str, *, description: str = "", override: bool = False
        ) -> None:
            if not isinstance(name, str) or not name or ":" in name:
                raise PluginError(f"{info.dist}: invalid {kind} name {name!r} (a non-empty string without ':')")
            comp = Component(kind, name, target, info, description, override)
            self._components[kind].setdefault(name, []).append(comp)

        return register

    # ------------------------------------------------------------------ lookup
    def names(self, kind: str) -> list[str]:
        return sorted(self._components[self._kind(kind)])

    def components(self, kind: str | None = None) -> list[Component]:
        kinds = [self._kind(kind)] if kind else list(self._components)
        return [c for k in kinds for name in sorted(self._components[k]) for c in self._components[k][name]]

    def conflicts(self) -> list[list[Component]]:
        """Names provided by more than one distribution (and not resolved by ``override``)."""
        out = []
        for by_name in self._components.values():
            for comps in by_name.values():
                if len({c.plugin.dist for c in comps}) > 1 and not self._override(comps):
                    out.append(comps)
        return out

    def overrides(self) -> list[str]:
        """One line per name that an ``override=True`` registration takes from another package,
        naming both and how to reach the replaced one. Said at run start (see
        :func:`tempering.training.recipe.run_recipe`): an override otherwise replaces a built-in such
        as ``exact_match`` silently, and a run's numbers change with what is installed."""
        lines = []
        for by_name in self._components.values():
            for name, comps in sorted(by_name.items()):
                chosen = self._override(comps) if len({c.plugin.dist for c in comps}) > 1 else None
                if chosen is None:
                    continue
                others = [c for c in comps if c is not chosen]
                replaced = " and ".join(f"{c.plugin.dist} {c.plugin.version}" for c in others)
                pins = " or ".join(f"'{c.qualified}'" for c in others)
                lines.append(
                    f"tempering: plugin {chosen.plugin.dist} {chosen.plugin.version} overrides {chosen.kind} "
                    f"'{name}' of {replaced} (override=True); name {pins} to use the replaced one"
                )
        return lines

    @staticmethod
    def _override(comps: list[Component]) -> Component | None:
        """A single ``override=True`` registration deliberately replaces the others."""
        overrides = [c for c in comps if c.override]
        return overrides[0] if len(overrides) == 1 else None

    def _kind(self, kind: str) -> str:
        if kind not in self._components:
            raise PluginError(f"unknown component kind '{kind}'; kinds are: {', '.join(self._components)}")
        return kind

    def get(self, kind: str, name: str) -> Component:
        """Resolve ``name`` (or ``dist:name`` to pin a provider) to one component."""
        kind = self._kind(kind)
        dist, _, bare = name.rpartition(":")
        comps = self._components[kind].get(bare, [])
        if dist:
            comps = [c for c in comps if _norm(c.plugin.dist) == _norm(dist)]
        if not comps:
            raise UnknownComponentError(self._unknown_message(kind, name))
        if len(comps) > 1:
            chosen = self._override(comps)
            if chosen is not None:
                return chosen
            if len({c.plugin.dist for c in comps}) == 1:
                raise PluginError(
                    f"{kind} '{bare}' is registered {len(comps)} times by {comps[0].plugin.dist}; "
                    "register each name once."
                )
            providers = " and ".join(f"'{c.plugin.dist}' ({c.plugin.version})" for c in comps)
            raise PluginError(
                f"{kind} '{bare}' is registered by {_count_word(len(comps))} packages: {providers}. Pin one with "
                + " or ".join(f"'{c.qualified}'" for c in comps)
                + ", uninstall one of them, or have the replacement register with override=True."
            )
        return comps[0]

    def _unknown_message(self, kind: str, name: str) -> str:
        known = self.names(kind)
        lines = [f"unknown {kind} '{name}'."]
        close = difflib.get_close_matches(name.rpartition(":")[2], known, n=3)
        if close:
            lines[0] += " Did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
        if known:
            listing = ", ".join(
                f"{n} ({'/'.join(sorted({c.plugin.dist for c in self._components[kind][n]}))})" for n in known
            )
            lines.append(f"Known {plural(kind)}: {listing}.")
        else:
            lines.append(f"No {kind} is registered.")
        failed = [p for p in self.plugins if p.error]
        if failed:
            lines.append(
                "Note: these plugins failed to load and may provide it: "
                + "; ".join(f"{p.key} ({p.error})" for p in failed)
            )
        lines.append(
            f"Install a plugin that provides it (pip install <package>), check `tempering plugins`, "
            f"or unset {ENV_LOAD} if it restricts loading."
        )
        return "\n".join(lines)

    # ------------------------------------------------------------------ building
    def build(self, kind: str, spec: object, path: str = "", **context: object) -> Any:
        """Build a component from ``spec``: a name, or a mapping ``{name: ..., <params>}``.

        Params are validated against the factory's schema (see :func:`params_schema`) so that a
        misspelt key fails with its full path; ``context`` passes runtime objects (backend,
        tokenizer) that are not config.
        """
        if not isinstance(spec, (str, Mapping)) and not _is_omegaconf(spec):
            return spec  # already an object (Python-composed recipe): use it as it is
        factory, kwargs = self._resolve(kind, spec, path, set(context))
        return factory(**kwargs, **context)

    def factory(self, kind: str, spec: object, path: str = "", **context: object) -> Callable[[], Any]:
        """A zero-argument callable that builds a *new* component per call, validated once now.

        For components used one instance per use (an environment: one per episode). A Python
        class or zero-argument callable given in place of a spec is used as the factory."""
        if isinstance(spec, (str, Mapping)) or _is_omegaconf(spec):
            factory, kwargs = self._resolve(kind, spec, path, set(context))
            return functools.partial(factory, **kwargs, **context)
        if callable(spec):
            return spec
        raise ConfigError(
            f"expected a registered {kind} name, a mapping with 'name:', or a class; got {type(spec).__name__}",
            path or kind,
        )

    def check(self, kind: str, spec: object, path: str = "", context: Iterable[str] = ()) -> None:
        """Validate ``spec`` (its name, keys and the factory's ``check_config``) without building
        it: lets a recipe fail on a typo in its last stage before its first stage trains."""
        if isinstance(spec, (str, Mapping)) or _is_omegaconf(spec):
            self._resolve(kind, spec, path, set(context))

    def _resolve(
        self, kind: str, spec: object, path: str, context: set[str]
    ) -> tuple[Callable[..., Any], dict[str, Any]]:
        path = path or kind
        name, params = split_spec(spec, path)
        try:
            factory = self.get(kind, name).load()
        except UnknownComponentError as exc:
            raise UnknownComponentError(f"{path}.name: {exc}") from None
        except PluginError as exc:  # two packages provide the name, or it fails to import
            raise PluginError(f"{path}.name: {exc}") from None
        kwargs = validate_params(factory, params, path, exclude=context)  # the schema's fields
        if callable(getattr(factory, CHECK_CONFIG, None)):  # its check, on every key
            check_config_at(factory, {**factory_defaults(factory), **kwargs}, path)
        return factory, kwargs


def _is_omegaconf(obj: object) -> bool:
    return type(obj).__module__.startswith("omegaconf")


def plural(kind: str) -> str:
    """``rewards``, ``harnesses``: a kind's name in the plural, for messages."""
    return kind + ("es" if kind.endswith(("s", "sh", "ch", "x")) else "s")


def split_spec(spec: object, path: str) -> tuple[str, dict[str, Any]]:
    """``"name"`` or ``{name: ..., **params}`` -> (name, params)."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, DictConfig):
        spec = OmegaConf.to_container(spec, resolve=True)
    if not isinstance(spec, Mapping):
        raise ConfigError(f"expected a component name or a mapping with 'name:', got {type(spec).__name__}", path)
    if "name" not in spec or not isinstance(spec["name"], str):
        raise ConfigError("a component needs 'name: <registered name>'", path)
    params = {k: v for k, v in spec.items() if k != "name"}
    return spec["name"], params


def params_schema(factory: Callable[..., Any], exclude: Iterable[str] = ()) -> type | None:
    """The dataclass describing a factory's config keys.

    A dataclass factory is its own schema; a factory with a ``Params`` dataclass attribute uses
    that; otherwise one is derived from the signature. ``None`` means "accepts any keys"
    (the factory takes ``**kwargs``).
    """
    if dataclasses.is_dataclass(factory) and isinstance(factory, type):
        fields = [f for f in dataclasses.fields(factory) if f.init and f.name not in set(exclude)]
        return _make_schema(
            factory.__name__, [(f.name, _hint(factory, f.name, f.type), _default_of(f)) for f in fields]
        )
    params = getattr(factory, "Params", None)
    if dataclasses.is_dataclass(params):
        return params  # type: ignore[return-value]
    sig = inspect.signature(factory)
    entries = []
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.kind is p.VAR_POSITIONAL or p.name in set(exclude) or p.name == "self":
            continue
        default = dataclasses.MISSING if p.default is p.empty else p.default
        entries.append((p.name, _hint(factory, p.name, p.annotation), default))
    return _make_schema(getattr(factory, "__name__", "Params"), entries)


def factory_defaults(factory: Callable[..., Any]) -> dict[str, Any]:
    """The default value of each of a factory's config keys that has one: a dataclass's (or its
    ``Params`` dataclass's) field defaults, default factories called, else the signature's.
    What ``docs/reference.md`` lists and ``tempering show --resolved`` fills in."""
    target = getattr(factory, "Params", None) if not dataclasses.is_dataclass(factory) else factory
    if target is not None and dataclasses.is_dataclass(target):
        out = {}
        for f in dataclasses.fields(target):
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out
    return {p.name: p.default for p in inspect.signature(factory).parameters.values() if p.default is not p.empty}


def config_blocks(factory: Callable[..., Any]) -> dict[str, type]:
    """The nested config blocks a factory declares (:data:`BLOCKS_HOOK`): key -> dataclass."""
    return dict(getattr(factory, BLOCKS_HOOK, None) or {})


def resolved_values(factory: Callable[..., Any], settings: Mapping[str, Any]) -> dict[str, Any]:
    """What the factory's ``auto`` settings resolve to for ``settings`` (:data:`RESOLVE_HOOK`)."""
    hook = getattr(factory, RESOLVE_HOOK, None)
    return dict(hook(settings)) if callable(hook) else {}


def registered_builder(
    name: str, registry: Registry | None = None
) -> Callable[..., LoadedModel | tuple[Any, Any]] | None:
    """The model builder a plugin registered under ``name`` (or ``dist:name``), or ``None``:
    then the name is a folder or a hub id (``registry``: the process-wide one by default). Used
    by every backend that builds a model locally, and by ``tempering export`` to rebuild the
    base of a LoRA adapter trained on a service."""
    registry = registry or get_registry()
    if name.rpartition(":")[2] not in registry.names("model"):
        return None
    return registry.get("model", name).load()


_SIMPLE = (int, float, bool, str)


def _hint(owner: Any, name: str, annotation: object) -> Any:
    """An omegaconf-friendly type for ``name``: the real hint when omegaconf can check it."""
    # a plain class's config keys are its __init__'s parameters (``owner`` is Any: any class)
    is_plain_class = isinstance(owner, type) and not dataclasses.is_dataclass(owner)
    target = owner.__init__ if is_plain_class else owner
    try:
        annotation = typing.get_type_hints(target).get(name, annotation)
    except Exception:  # noqa: BLE001 - another annotation is unresolvable (a TYPE_CHECKING import)
        try:  # resolve this one alone, so ``hidden_size: int`` is still checked
            module = importlib.import_module(getattr(owner, "__module__", "") or "builtins")
            shim = types.SimpleNamespace(__annotations__={name: annotation})
            annotation = typing.get_type_hints(shim, globalns=vars(module)).get(name, Any)
        except Exception:  # noqa: BLE001 - unresolvable: accept any value
            return Any
    return _omegaconf_type(annotation)


def _omegaconf_type(t: object) -> Any:
    if t in _SIMPLE:
        return t
    origin = typing.get_origin(t)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if len(args) == 1 and args[0] in _SIMPLE:
            return args[0] | None
    return Any


def _default_of(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _make_schema(name: str, entries: list[tuple[str, Any, Any]]) -> type:
    spec: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for fname, ftype, default in entries:
        if default is dataclasses.MISSING:
            spec.append((fname, ftype))
        elif isinstance(default, (list, dict)):
            # Any with no default: a dict-valued default would make omegaconf refuse a list
            # (a dataset given inline as rows). Defaults are the factory's business anyway.
            spec.append((fname, Any, field(default=None)))
        elif default is None or isinstance(default, _SIMPLE):
            spec.append((fname, ftype, field(default=default)))
        else:  # non-config default (a callable, an object): keep it out of omegaconf's checks
            spec.append((fname, Any, field(default=None)))
    return dataclasses.make_dataclass(f"{name}Params", spec)


def validate_params(
    factory: Callable[..., Any], params: Mapping[str, Any], path: str, exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """Check ``params`` against the factory's schema; errors name the key's full path.

    Only the keys the user gave are passed on, so the factory's own defaults (which may be
    objects omegaconf cannot hold) stay in charge of the rest.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    schema = params_schema(factory, exclude)
    if schema is None:
        return dict(params)
    known = {f.name for f in dataclasses.fields(schema)}
    moved: Mapping[str, str] = getattr(factory, MOVED_KEYS_HOOK, None) or {}
    for key in params:
        if key not in known and key in moved:
            raise ConfigError(f"'{key}' moved: write it as {moved[key]} (see CHANGELOG.md)", f"{path}.{key}")
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown key '{key}'.{hint} Valid keys: {', '.join(sorted(known)) or '(none)'}", f"{path}.{key}"
            )
    missing = [f.name for f in dataclasses.fields(schema) if f.name not in params and _is_required(f)]
    if missing:
        raise ConfigError(f"missing required key '{missing[0]}'", f"{path}.{missing[0]}")
    # omegaconf holds plain data only: Python objects (a reward function in a Python-composed
    # recipe) skip its type checks and are passed on as they are.
    plain = {k: v for k, v in params.items() if _is_plain(v)}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), plain)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or ""
        raise ConfigError(str(exc).splitlines()[0], f"{path}.{key}" if key else path) from exc
    container = OmegaConf.to_container(merged, resolve=True)
    assert isinstance(container, dict)
    return {k: container[k] if k in plain else v for k, v in params.items()}


def is_plain_data(value: object, leaf: Callable[[Any], bool] = lambda value: False) -> bool:
    """Config-file data: None, bool, int, float, str, and str-keyed mappings and lists of them,
    plus whatever ``leaf`` admits (the validator admits OmegaConf nodes)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and is_plain_data(v, leaf) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(is_plain_data(v, leaf) for v in value)
    return leaf(value)


def _is_plain(value: object) -> bool:
    return is_plain_data(value, _is_omegaconf)


def _is_required(f: dataclasses.Field[Any]) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


_default: Registry | None = None


def get_registry(reload: bool = False) -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _default
    if _default is None or reload:
        _default = Registry()
    return _default
