"""The output folder of a run: one live run at a time, a real fresh start, and a checkpoint
ledger that is pruned.

A run folder holds ``progress.json`` (where the run is), ``checkpoints/``, ``metrics.jsonl``,
``run.json`` and whatever the loggers write. Everything a resumed run trusts is in
``progress.json``, rewritten atomically after each checkpoint is complete, so a run killed at
any instant leaves either the previous state or the new one, never half of one. What the
killed run wrote after its last checkpoint (metrics rows, a half-saved checkpoint directory)
is removed when the run resumes: see :func:`remove_unlisted_checkpoints` and the loggers'
``rewind``.

See docs/runs.md for the user-facing rules.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tempering.errors import ConfigError, TemperingError

PROGRESS_FILE = "progress.json"
LOCK_FILE = "run.lock"
CHECKPOINTS = "checkpoints"
#: Files that mark a folder as holding a run (``--fresh`` moves such a folder's contents aside).
RUN_MARKERS = (PROGRESS_FILE, "run.json", "metrics.jsonl", CHECKPOINTS)
_CKPT_NAME = re.compile(r"^step\d{6}(-\d+)?$")
#: A backend's atomic save fills ``<checkpoint>.tmp-PID`` and, when it replaces a folder, moves
#: the old one to ``<checkpoint>.old-PID`` for the swap: a kill mid-save leaves them behind.
_CKPT_LEFTOVER = re.compile(r"^(step\d{6}(?:-\d+)?)\.(tmp|old)-\d+$")
#: :func:`write_json` fills ``<file>.tmp-PID`` and renames it: a kill between leaves it behind.
_JSON_LEFTOVER = re.compile(r"^(progress|run)\.json\.tmp-\d+$")


class RunLockedError(TemperingError):
    """Another live run holds the output folder."""


class RunFolderWarning(UserWarning):
    """Something was done to the run folder that the user should know about (files moved
    aside by a fresh start, a stale lock taken over)."""


class RunAlreadyComplete(RunFolderWarning):
    """The recipe's run folder already holds every stage finished: nothing was run."""


class RecipeChanged(RunFolderWarning):
    """The recipe differs from the one the folder's run recorded in ``run.json`` (the keys are
    named): a finished run keeps its record; a resumed one records the change."""


def make_output_dir(output_dir: str) -> None:
    """Create ``output_dir`` (and its parents) if missing; a path that is a file, or that
    cannot be created, is a one-line :class:`ConfigError` rather than an ``OSError``'s
    traceback."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(
            f"'{output_dir}' is a file, not a folder; give a folder for the run's files (it is created if missing)",
            "output_dir",
        )
    try:
        os.makedirs(output_dir, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create '{output_dir}': {exc.strerror or exc}; give a folder you can write to", "output_dir"
        ) from None


# --------------------------------------------------------------------------- progress.json
def read_progress(output_dir: str) -> dict[str, Any] | None:
    path = os.path.join(output_dir, PROGRESS_FILE)
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def write_json(path: str, data: Mapping[str, Any]) -> None:
    """Write ``data`` atomically: a crash never leaves half a file, and two processes writing
    the same file (a shared checkpoint index) never write into each other's temporary file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- the lock
def is_primary_process() -> bool:
    """Under torchrun every rank runs the recipe; rank 0 alone owns the folder (lock, fresh
    start, clean-up) so the ranks do not refuse or undo each other."""
    return os.environ.get("RANK", "0") == "0"


class RunLock:
    """``<output_dir>/run.lock``: refuses a second live run into the same folder.

    The lock is an OS file lock (``flock``) held for the life of the run, so the kernel drops
    it when the process ends however it ends; the file also names the holder (pid, host,
    start time) for the error message. A lock file whose holder is gone -- the file is there
    but nobody holds the OS lock, because its process was killed before it could remove it --
    is stale and is taken over with a :class:`RunFolderWarning`. Where the filesystem has no
    file locks, staleness falls back to the pid: stale if no process with that pid is alive on
    this host. A holder on another host is never presumed dead (a network filesystem may not
    share file locks between hosts): the error says to delete the file once that run is over.
    """

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir
        self.path = os.path.join(output_dir, LOCK_FILE)
        self._fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                locked = _try_flock(fd)
                holder = _read_holder(fd)
                if locked is False or (holder and not _on_this_host(holder)):
                    raise RunLockedError(self._refusal(holder, same_host=locked is False or _on_this_host(holder)))
                if locked is None and holder and _pid_alive(holder.get("pid")):
                    raise RunLockedError(self._refusal(holder, same_host=True))
                if _still_at(fd, self.path):
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # the holder released (removed) the file meanwhile: lock the new one
        self._fd = fd
        if holder:  # the file was there but nobody held it: its process died without cleaning up
            warnings.warn(
                f"tempering: {self.path}: taking over a stale lock of pid {holder.get('pid')} on "
                f"{holder.get('host')} (started {holder.get('started')}); that process is no longer running",
                RunFolderWarning,
                stacklevel=3,
            )
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        os.fsync(fd)

    def release(self) -> None:
        """Remove the file, then drop the OS lock (in this order: a waiting run re-checks that
        the file it locked is still the one at the path)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:  # pragma: no cover - the folder was removed under us
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _refusal(self, holder: Mapping[str, Any], same_host: bool) -> str:
        who = f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, started {holder.get('started', '?')}"
        if same_host:
            return (
                f"{self.output_dir}: another run is writing to this folder ({who}); wait for it to end, "
                f"or give this run another output_dir (--output-dir)"
            )
        return (
            f"{self.output_dir}: a run on another host holds this folder ({who}); tempering cannot check "
            f"a process there: once that run is over, delete {self.path}"
        )


def _try_flock(fd: int) -> bool | None:
    """True: locked; False: another open file holds it; None: no file locks here."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise
    return True


def _read_holder(fd: int) -> dict[str, Any]:
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except ValueError:  # half-written by a process killed while writing it
        return {"pid": "?", "host": "?", "started": "?"}
    return data if isinstance(data, dict) else {}


def _on_this_host(holder: Mapping[str, Any]) -> bool:
    return holder.get("host") == socket.gethostname()


def _pid_alive(pid: object) -> bool:
    """Whether a process with this pid exists on this host (used where there are no file locks)."""
    if not isinstance(pid, int):
        return True  # unreadable: assume the worst
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True


def _still_at(fd: int, path: str) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


# --------------------------------------------------------------------------- a fresh start
def start_fresh(output_dir: str) -> str | None:
    """Move an earlier run's files out of ``output_dir`` into the sibling folder
    ``<output_dir>.prev-<YYYYmmdd-HHMMSS>`` and return its path (None: there was no run).

    Moved, not deleted: ``--fresh`` typed by mistake must not cost a long run. Everything
    in the folder moves except the lock, ``progress.json`` first, so that a kill midway
    leaves a folder with nothing to resume from rather than a half-old run.
    """
    names = [n for n in os.listdir(output_dir) if n != LOCK_FILE]
    if not any(n in RUN_MARKERS for n in names):
        return None
    dest = _unused(f"{os.path.abspath(output_dir)}.prev-{time.strftime('%Y%m%d-%H%M%S')}", os.path.exists)
    os.makedirs(dest)
    for name in sorted(names, key=lambda n: n != PROGRESS_FILE):
        os.rename(os.path.join(output_dir, name), os.path.join(dest, name))
    warnings.warn(
        f"tempering: starting fresh in {output_dir}: the earlier run's files were moved to {dest}",
        RunFolderWarning,
        stacklevel=3,
    )
    return dest


def _unused(base: str, taken: Callable[[str], bool]) -> str:
    """``base``, else ``base-2``, ``base-3``, ... whichever ``taken`` says is free."""
    n, path = 1, base
    while taken(path):
        n += 1
        path = f"{base}-{n}"
    return path


# --------------------------------------------------------------------------- checkpoints
def new_checkpoint_path(output_dir: str, global_step: int, ledger: Sequence[Mapping[str, Any]]) -> str:
    """``checkpoints/stepNNNNNN``, suffixed when the ledger already has one at this step (a
    stage ending on a step that had a periodic checkpoint): a checkpoint is never rewritten
    in place, so the one ``progress.json`` points to stays whole until the next is complete.
    Decided from the ledger, not the disk, so every data-parallel rank picks the same name."""
    used = {os.path.basename(str(e["path"])) for e in ledger}
    name = _unused(f"step{global_step:06d}", lambda n: n in used)
    return os.path.join(output_dir, CHECKPOINTS, name)


def prune(ledger: Sequence[Mapping[str, Any]], keep: int | None) -> tuple[list[Any], list[Any]]:
    """Split the ledger (oldest first) into (kept, dropped): every stage-end checkpoint is
    kept (each is a stage's result, a starting point for a variant of the next stage), and
    the ``keep`` newest of the others. The newest entry -- the one ``progress.json`` points
    to -- is always kept. ``keep=None`` keeps everything."""
    if keep is None:
        return list(ledger), []
    periodic = [e for e in ledger if not e.get("stage_end")]
    dropped = periodic[: max(len(periodic) - keep, 0)]
    kept = [e for e in ledger if not any(e is d for d in dropped)]
    return kept, dropped


def remove_checkpoints(entries: Sequence[Mapping[str, Any]]) -> None:
    for entry in entries:
        shutil.rmtree(str(entry["path"]), ignore_errors=True)  # ranks may race to remove it


def remove_partial_writes(output_dir: str) -> list[str]:
    """Delete ``progress.json.tmp-PID`` / ``run.json.tmp-PID`` in the run folder: what a kill in
    the middle of :func:`write_json` leaves (the file it was replacing is whole). Called with the
    run lock held, so no live run is writing them. Returns the names removed."""
    gone = sorted(n for n in os.listdir(output_dir) if _JSON_LEFTOVER.match(n))
    for name in gone:
        try:
            os.remove(os.path.join(output_dir, name))
        except FileNotFoundError:  # pragma: no cover - removed meanwhile
            pass
    return gone


def remove_unlisted_checkpoints(output_dir: str, ledger: Sequence[Mapping[str, Any]]) -> list[str]:
    """Delete ``checkpoints/step*`` directories the ledger does not list: written by a run
    killed before it recorded them (possibly half-saved) or after it pruned them; and the
    leftovers of a save a kill interrupted (``stepNNNNNN.tmp-PID``, half-written; and
    ``stepNNNNNN.old-PID``, unless the checkpoint it was moved aside from is listed and gone:
    then it is that checkpoint's only copy). Called with the run lock held, so no live save
    owns them. Returns the names removed."""
    root = os.path.join(output_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    listed = {os.path.basename(str(e["path"])) for e in ledger}

    def garbage(name: str) -> bool:
        if _CKPT_NAME.match(name):
            return name not in listed
        leftover = _CKPT_LEFTOVER.match(name)
        if leftover is None:
            return False
        base, kind = leftover.groups()
        return kind == "tmp" or base not in listed or os.path.isdir(os.path.join(root, base))

    gone = sorted(n for n in os.listdir(root) if garbage(n))
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone
