"""``tempering serve-tinker``: the command line of the Tinker-protocol server.

``tempering``'s core imports no plugin, so its CLI finds this command through the
``tempering.commands`` entry-point group (``serve-tinker = "tempering.plugins.tinker_server.cli"``
in pyproject.toml): it calls :func:`add_arguments` to build the subcommand and :func:`run` to run
it. This module imports only ``argparse`` at the top, so ``tempering --help`` stays fast; the
server (torch, the SDK) is imported when the command runs. ``python -m
tempering.plugins.tinker_server`` takes the same options.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

__all__ = ["HELP", "DESCRIPTION", "add_arguments", "run", "main", "served_models"]

HELP = "serve the Tinker API on this machine: tinker-cookbook and the tinker SDK train and sample here"
DESCRIPTION = (
    "Serve a model tempering can load (built in code, smollm2, a Hugging Face folder) under the name clients ask "
    "for, behind the Tinker API (SDK 0.38): LoRA training runs, sampling, checkpoints that survive a restart. "
    "Clients set TINKER_BASE_URL to the printed URL. See docs/serve-tinker.md."
)


def default_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "tempering", "tinker-server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="tiny_llama",
        help="a registered model builder (tiny_llama, smollm2, ...) or a Hugging Face model folder",
    )
    parser.add_argument("--model-kwargs", default="{}", help="JSON keyword arguments for the model builder")
    parser.add_argument(
        "--name",
        default=None,
        help="the base-model name clients ask for (default: --model), e.g. "
        "HuggingFaceTB/SmolLM2-135M-Instruct; tinker-cookbook wants org/model",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs --api-key")
    parser.add_argument(
        "--allow-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a Host name clients may use besides loopback ones (repeatable; against DNS rebinding, "
        "requests naming other hosts get 403; default on a non-loopback --host: any name)",
    )
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="a key clients must send (TINKER_API_KEY; repeatable; default $TEMPERING_TINKER_API_KEY, "
        "else any key starting with tml- on loopback)",
    )
    parser.add_argument(
        "--root",
        default=None,
        help="folder of checkpoints and the run registry, kept across restarts "
        "(default ~/.cache/tempering/tinker-server)",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=60.0,
        help="seconds without heartbeat or request after which a client's session expires",
    )
    parser.add_argument(
        "--keep-checkpoints",
        type=_at_least_one,
        default=None,
        metavar="N",
        help="keep only each training run's newest N saved states and newest N sampler weights "
        "(older ones are deleted when a new one is saved; published ones stay); default: keep all. "
        "A checkpoint's TTL (ttl_seconds) is enforced either way",
    )
    parser.add_argument(
        "--keep-sampling-clients",
        type=_at_least_one,
        default=16,
        metavar="N",
        help="how many of each training run's newest sampling clients stay in memory (each a copy of the "
        "trained weights; older ones are released: their sessions answer 404, named sampler weights are "
        "loaded again from disk); default 16",
    )
    parser.add_argument(
        "--status",
        action="store_true",
        help="print the runs, checkpoints and disk use under --root, then exit (no server is started)",
    )
    parser.add_argument(
        "--no-tokenizer-cache",
        action="store_true",
        help="do not place the served tokenizer in this machine's Hugging Face cache under --name",
    )


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expects a whole number >= 1, got {text!r}")
    return value


def status(root: str) -> str:
    """What ``--status`` prints: the registry's runs and checkpoints under ``root`` and the disk
    they use, read from ``registry.json`` (no server needed; a running one's state as last saved)."""
    from tempering.plugins.tinker_server.registry import Registry, folder_size

    registry = Registry(root)  # DamagedRegistry: one line, raised to the caller
    open_runs = sum(1 for r in registry.runs.values() if r.closed is None)
    lines = [f"root {root}: {len(registry.runs)} training runs ({open_runs} open)"]
    for kind in ("training", "sampler", "external"):
        found = [c for c in registry.checkpoints.values() if c.checkpoint_type == kind]
        size = sum(folder_size(c.folder) for c in found)
        lines.append(f"  {kind + ' checkpoints:':22} {len(found):5d}  {_mb(size)}")
    lines.append(f"  {'disk use of the root:':22} {'':5}  {_mb(folder_size(root))}")
    return "\n".join(lines)


def _mb(size: int) -> str:
    return f"{size / 2**20:10.1f} MB"


def model_problem(model: str, model_kwargs: object) -> str | None:
    """What is wrong with the served model's source, as one line at the option that sets it
    (``--model-kwargs.hiden_size: unknown key ...``), or ``None``: the local backend's own check
    of ``model`` and ``model_kwargs``, so a typo fails at start, not at the first request."""
    from tempering.errors import ConfigError
    from tempering.plugins.backends.local.model_source import check_model

    try:
        check_model(model, model_kwargs, "server")
    except ConfigError as err:
        key = (err.path or "server.model").removeprefix("server.")
        head, dot, rest = key.partition(".")
        return f"--{head.replace('_', '-')}{dot}{rest}: {err.message}"
    return None


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted (Ctrl-C)."""
    import faulthandler
    import signal
    import threading

    from tempering.plugins.tinker_server.registry import DamagedRegistry
    from tempering.plugins.tinker_server.server import LocalTinkerServer
    from tempering.plugins.tinker_server.service import ServedModel

    if args.status:
        try:
            print(status(args.root or default_root()))
        except DamagedRegistry as err:
            raise SystemExit(str(err)) from err
        return 0
    try:
        kwargs: dict[str, Any] = json.loads(args.model_kwargs)
    except json.JSONDecodeError as err:
        raise SystemExit(f"--model-kwargs: not JSON ({err}); e.g. --model-kwargs '{{\"hidden_size\": 64}}'") from err
    problem = model_problem(args.model, kwargs)
    if problem:
        raise SystemExit(problem)
    keys = set(args.api_key or []) or (
        {os.environ["TEMPERING_TINKER_API_KEY"]} if os.environ.get("TEMPERING_TINKER_API_KEY") else None
    )
    name = args.name or args.model
    try:
        server = LocalTinkerServer(
            {name: ServedModel(args.model, kwargs)},
            host=args.host,
            port=args.port,
            api_keys=keys,
            root=args.root or default_root(),
            session_timeout_seconds=args.session_timeout,
            hold_seconds=20.0,  # a long poll (the SDK waits 45 s): fewer 'try_again' warnings in clients' logs
            batch_sampling=True,  # a cookbook RL step sends groups_per_batch requests at once
            allowed_hosts=args.allow_host,
            request_log=0,  # no request log: the server runs for days
            keep_checkpoints=args.keep_checkpoints,
            keep_sampling_clients=args.keep_sampling_clients,
        )
    except DamagedRegistry as err:
        raise SystemExit(str(err)) from err
    except ValueError as err:
        raise SystemExit(f"{err} (--api-key)") from err
    server.start()
    key_hint = "your key" if keys else "any key starting with tml-"
    print(
        f"serving {name} ({args.model}) at {server.url}\n  TINKER_BASE_URL={server.url} TINKER_API_KEY=<{key_hint}>\n"
        f"  checkpoints and run registry: {server.root}",
        flush=True,
    )
    if name.count("/") == 1 and not args.no_tokenizer_cache:
        print(_place_tokenizer(server, name), flush=True)
    # A process started with SIGINT ignored (a pytest-xdist worker's child, nohup) inherits that,
    # and Python then installs no handler: Ctrl-C / SIGINT would never stop the server (it hung
    # in CI this way). Stop on SIGINT and SIGTERM whatever the parent did.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        # stopping takes ~1-3 s; one stop in a loaded CI run took over 90 s, cause unknown: if it
        # ever hangs again, every thread's stack goes to stderr after 20 s to show where
        faulthandler.dump_traceback_later(20, exit=False)
        server.stop()
        faulthandler.cancel_dump_traceback_later()
    return 0


def _place_tokenizer(server: Any, name: str) -> str:
    """Put the served tokenizer in this machine's Hugging Face cache under ``name`` (a line to print)."""
    from transformers import PreTrainedTokenizerBase

    from tempering.plugins.tinker_server.tokenizers import install_tokenizer

    base = server.service.base(name)
    if not isinstance(base.tokenizer, PreTrainedTokenizerBase):
        kind = type(base.tokenizer).__name__
        return f"tokenizer of {name}: not a Hugging Face tokenizer ({kind}); not placed in the cache"
    written = install_tokenizer(name, base.tokenizer, config=getattr(base.model, "config", None))
    if written:
        return f"tokenizer of {name} placed in the Hugging Face cache ({written}): get_tokenizer() works offline here"
    return f"tokenizer of {name}: the Hugging Face cache has it already (left as it is)"


def served_models(argv: list[str] | None = None) -> tuple[dict[str, Any], argparse.Namespace]:
    """The command line's models (name -> what is served under it) and its other arguments;
    the model source is checked here, so a typo fails at start, not at the first request."""
    from tempering.plugins.tinker_server.service import ServedModel

    parser = argparse.ArgumentParser(prog="python -m tempering.plugins.tinker_server", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    kwargs = json.loads(args.model_kwargs)
    problem = model_problem(args.model, kwargs)
    if problem:
        parser.error(problem)
    return {args.name or args.model: ServedModel(args.model, kwargs)}, args


def main(argv: list[str] | None = None) -> None:
    """``python -m tempering.plugins.tinker_server``: the options of ``tempering serve-tinker``."""
    _, args = served_models(argv)
    raise SystemExit(run(args))
