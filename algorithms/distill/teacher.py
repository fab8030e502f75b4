"""The distillation teacher: another model, loaded by a backend, that scores the student's tokens.

The teacher of on-policy distillation is a model of its own (a bigger or a trained one), not the
student re-prompted (that is SDFT's and SDPO's self-teacher, :mod:`tempering.training.teacher`).
The ``teacher:`` block says which, in one of three ways:

* ``model``: anything the student's backend can load -- a Hugging Face folder, a ``tempering
  export`` folder, a GGUF file, a hub id, a model plugin's name with ``model_kwargs``
  (``tiny_llama``); built as a second backend of the student's kind, with the student's
  settings (device, dtype, threads, seed) but no adapter. On a backend that scores weights by
  path (Tinker: ``weight_path_schemes``), a ``tinker://`` sampler-weights path is scored by the
  student's own backend (``weights=path``), the cookbook's ``teacher_checkpoint``;
* ``run``: a run folder, its latest checkpoint (or ``step``), rebuilt as the run built it;
* ``backend``: a whole backend spec, for full control (another backend kind, another device).

The teacher scores the student's token ids, so both must share one vocabulary: a teacher whose
tokenizer maps any token to another id is refused in one line, before anything trains
(:func:`vocab_difference`; vocabularies are compared, not tokenizer objects).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tempering.errors import ConfigError
from tempering.interfaces import Backend, Closeable, RunContext
from tempering.runs.rng import kept_rng
from tempering.schema import Problem
from tempering.training.progress import phase
from tempering.training.recipe import backend_spec
from tempering.training.rundata import RUN_FILE, RunDir, run_backend
from tempering.training.stage import sub_config

#: Keys of the student's backend spec that say *which* weights train or how they sample; a
#: ``model`` teacher does not inherit them (it is a frozen model of its own, scored only).
NOT_INHERITED = (
    "model",
    "base_model",
    "model_kwargs",
    "lora",
    "rank",
    "init_state",
    "tokenizer",
    "engine",
    "vllm",
    "gradient_checkpointing",
)


@runtime_checkable
class Vocabulary(Protocol):
    """What the tokenizer check reads of a tokenizer: its token -> id map."""

    def get_vocab(self) -> Mapping[str, int]: ...


@dataclass
class TeacherSpec:
    """The ``teacher:`` block, exactly one of: ``model`` (a Hugging Face folder, a ``tempering
    export`` folder, a GGUF file, a hub id, or a model plugin's name with ``model_kwargs``; on
    Tinker a ``tinker://`` sampler-weights path), ``run`` (a run folder: its latest checkpoint,
    or ``step``) or ``backend`` (a whole backend spec). A string is shorthand: a folder holding
    a run (``run.json``) is ``{run: ...}``, anything else ``{model: ...}``."""

    model: str | None = None
    model_kwargs: dict[str, Any] | None = None
    run: str | None = None
    step: int | None = None
    backend: Any = None  # a backend spec: a name, or a mapping with name: and its keys

    @staticmethod
    def check_config(config: Mapping[str, Any]) -> Iterator[Problem]:
        """Exactly one source; ``model_kwargs`` go with ``model``, ``step`` with ``run``."""
        given = [k for k in ("model", "run", "backend") if config[k] is not None]
        if len(given) != 1:
            yield Problem(
                "",
                f"give exactly one of model, run or backend (got {', '.join(given) or 'none'}): "
                "e.g. teacher: exports/my_model, teacher: {run: runs/my_run}",
            )
        if config["model_kwargs"] is not None and config["model"] is None:
            yield Problem("model_kwargs", "go with model: (the teacher model's builder arguments)")
        if config["step"] is not None and config["run"] is None:
            yield Problem("step", "goes with run: (a checkpoint of that run)")

    @property
    def source(self) -> str:
        """The block's key that names the teacher, for error paths."""
        return "model" if self.model is not None else "run" if self.run is not None else "backend"


def teacher_spec(value: object, path: str) -> TeacherSpec:
    """The ``teacher:`` block at ``path`` (the stage's ``teacher`` key), checked; a missing
    teacher is one line saying what to give."""
    if value is None:
        raise ConfigError(
            "distillation needs a teacher: a model the backend can load (teacher: path/to/hf_folder, "
            "an export, a model name), a run ({run: runs/NAME}) or a tinker:// path on Tinker",
            path,
        )
    if isinstance(value, str):
        is_run = os.path.isfile(os.path.join(os.path.expanduser(value), RUN_FILE))
        value = {"run": value} if is_run else {"model": value}
    return sub_config(TeacherSpec, value, path)


def by_path(spec: TeacherSpec, student: object) -> bool:
    """Whether ``spec`` names weights the student's backend scores itself by path (Tinker's
    ``tinker://``): the backend lists the schemes in ``weight_path_schemes``."""
    schemes = tuple(getattr(student, "weight_path_schemes", ()))
    return spec.model is not None and bool(schemes) and spec.model.startswith(schemes)


def model_backend_spec(spec: TeacherSpec, ctx: RunContext, key: str = "teacher") -> dict[str, Any]:
    """The backend spec that loads a ``model`` teacher: the student's backend kind and settings
    (:data:`NOT_INHERITED` left out) with the teacher's model."""
    if not isinstance(ctx.config.get("backend"), (str, Mapping)):
        raise ConfigError(
            "the student's backend is a Python object, so the teacher cannot be built like it; "
            "give the teacher's whole backend spec as teacher.backend",
            f"{ctx.path}.{key}.model",
        )
    student = backend_spec(ctx.registry, ctx.config)
    base = {"name": student} if isinstance(student, str) else dict(student)
    out = {k: v for k, v in base.items() if k not in NOT_INHERITED}
    out["model"] = spec.model
    if spec.model_kwargs is not None:
        out["model_kwargs"] = dict(spec.model_kwargs)
    return out


def check_teacher(spec: TeacherSpec, ctx: RunContext, key: str = "teacher") -> None:
    """What can be checked before anything is built (``key``: the block's key under the
    stage): the teacher's backend spec (name, keys, the model source: a folder without a
    config.json, a misspelt builder), or the run folder and its checkpoint."""
    path = f"{ctx.path}.{key}"
    if spec.run is not None:
        run = RunDir.open(os.path.expanduser(spec.run), key=f"{path}.run")
        run.checkpoint(spec.step, key=f"{path}.step" if spec.step is not None else f"{path}.run")
    elif spec.backend is not None:
        ctx.check("backend", spec.backend, f"{key}.backend")
    elif spec.model is not None and "://" in spec.model:
        if ctx.backend is None or by_path(spec, ctx.backend):
            return  # the service checks its own paths; without the backend, which one is not known yet
        raise ConfigError(
            f"'{spec.model}' is a weights path only its service scores (a tinker:// path needs "
            "backend: {name: tinker}); on this backend give a folder, an export or a model name",
            f"{path}.model",
        )
    else:
        ctx.check("backend", model_backend_spec(spec, ctx, key), key)


@dataclass
class Teacher:
    """An opened teacher: the backend that scores (``scorer``), the keywords its scoring calls
    take (``{}``: its own weights; ``{"weights": path}``: weights by path on the student's
    backend) and what to close when the stage ends."""

    scorer: Backend
    kwargs: dict[str, str] = field(default_factory=dict)
    description: str = ""
    resources: ExitStack = field(default_factory=ExitStack)

    def close(self) -> None:
        self.resources.close()


def open_teacher(spec: TeacherSpec, ctx: RunContext, key: str = "teacher") -> Teacher:
    """Build (or find) the teacher and check its vocabulary against the student's."""
    student, path = ctx.backend, f"{ctx.path}.{key}"
    if by_path(spec, student):
        assert spec.model is not None
        return Teacher(student, {"weights": spec.model}, spec.model)
    teacher = Teacher(student, description=str(spec.run or spec.model or spec.backend))
    phase(f"loading the teacher: {teacher.description} ...")  # a real model takes a while: say so
    try:
        # building a backend seeds the global RNGs, loading a checkpoint restores its run's: the
        # student samples from them, and a resumed student has just restored its own
        with kept_rng():
            if spec.run is not None:
                run = RunDir.open(os.path.expanduser(spec.run), key=f"{path}.run")
                teacher.scorer, _ = teacher.resources.enter_context(run_backend(run, spec.step, ctx.registry))
            else:
                own = spec.backend is not None
                built = spec.backend if own else model_backend_spec(spec, ctx, key)
                teacher.scorer = ctx.build("backend", built, f"{key}.backend" if own else key)
                if isinstance(teacher.scorer, Closeable):
                    teacher.resources.callback(teacher.scorer.close)
        problem = vocab_difference(student.tokenizer, teacher.scorer.tokenizer)
        if problem is not None:
            raise ConfigError(
                f"the teacher's tokenizer is not the student's ({problem}); the teacher scores the "
                "student's token ids, so both need one vocabulary: use a teacher of the student's "
                "model family, or a student of the teacher's",
                f"{path}.{spec.source}",
            )
    except BaseException:
        teacher.close()
        raise
    return teacher


def vocab_difference(student: object, teacher: object) -> str | None:
    """``None`` when both tokenizers map every token to the same id, else what differs, in a
    few words (sizes, tokens only one has, tokens with another id)."""
    if student is teacher:
        return None
    s, t = vocabulary(student), vocabulary(teacher)
    if s == t:
        return None
    only_s, only_t = len(s.keys() - t.keys()), len(t.keys() - s.keys())
    moved = sum(1 for tok in s.keys() & t.keys() if s[tok] != t[tok])
    return (
        f"the student's has {len(s)} tokens, the teacher's {len(t)}: {only_s} only the student's, "
        f"{only_t} only the teacher's, {moved} with another id"
    )


def vocabulary(tokenizer: object) -> dict[str, int]:
    """A tokenizer's token -> id map (``get_vocab``); a tokenizer without one cannot be compared."""
    if not isinstance(tokenizer, Vocabulary):
        raise TypeError(f"cannot compare tokenizers: {type(tokenizer).__name__} has no get_vocab()")
    return dict(tokenizer.get_vocab())
