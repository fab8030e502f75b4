"""The viewer's HTTP server: the page, and the run folder as JSON.

Bound to 127.0.0.1 only: a run's transcripts and config are the user's data, and the page has
no login. For the same reason it answers only requests addressed to a loopback host name
(``Host: 127.0.0.1``, ``localhost``, ``[::1]``, ``*.localhost``, with any port) or one given
with ``tempering view --allow-host NAME``; anything else is a 403. Binding loopback is not
enough: with DNS rebinding a web page the user opens points its own name at 127.0.0.1 and
could then read the run from the user's browser, but its requests carry its own name as Host.
Files are re-read when they change (size and modification time), so reloading the
page while a run trains shows its latest steps. The transport, Host check and limits are the
shared stack of every tempering server (:mod:`tempering.runs.serving`). Endpoints:

======================  =======================================================================
``/``                   the page (``static/index.html``, ``view.js``, ``view.css``)
``/api/run``            the run's name, folder, stages, progress, resolved recipe and component
                        provenance (``run.json``)
``/api/metrics``        the rows of ``metrics.jsonl``
``/api/rollouts?...``   one page of ``rollouts.jsonl`` records matching a filter
                        (:class:`~tempering.apps.view.query.RolloutQuery`'s fields as parameters)
``/api/plots``          the PNGs the run drew, as paths in its folder: the ``plot`` logger's
                        curves at the top, a forecasting stage's reliability diagrams (one per
                        evaluation, :mod:`tempering.runs.calibration`) in ``reliability/``
``/plots/PATH``         one of those PNGs (only a listed one: no other file of the disk is served)
======================  =======================================================================
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

from tempering.apps.view.query import RolloutQuery, run_query
from tempering.errors import ConfigError
from tempering.runs import rollout_log
from tempering.runs.calibration import RELIABILITY_DIR
from tempering.runs.runfolder import PROGRESS_FILE
from tempering.runs.serving import BackgroundServer, Call, Policy, Reply, guarded_app, host_allowed
from tempering.training.rundata import METRICS_FILE, RUN_FILE, RunDir, read_jsonl

__all__ = ["RunViewer", "ViewServer", "host_allowed", "make_handler", "policy"]

HOST = "127.0.0.1"
STATIC = {
    "/": ("index.html", "text/html"),
    "/view.js": ("view.js", "text/javascript"),
    "/view.css": ("view.css", "text/css"),
}
NO_STORE = {"cache-control": "no-store"}  # a live run: always the latest
#: The run folder's subfolders (besides its top) whose PNGs the Plots tab shows.
PLOT_DIRS = ("", RELIABILITY_DIR)


class CachedJsonl:
    """A JSON-lines file re-read only when its size or modification time changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._rows: list[dict[str, Any]] = []
        self._lock = threading.Lock()

    def rows(self) -> list[dict[str, Any]]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = (0, 0)
        with self._lock:
            if stamp != self._stamp:
                self._rows, self._stamp = read_jsonl(self.path), stamp
            return self._rows


class RunViewer:
    """The JSON the page asks for, from one run folder."""

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self.metrics = CachedJsonl(os.path.join(run.path, METRICS_FILE))
        self.rollouts = CachedJsonl(os.path.join(run.path, rollout_log.FILENAME))

    def run_info(self) -> dict[str, Any]:
        info = self.run.info()
        recipe = info.get("recipe") or {}
        return {
            "name": recipe.get("name") or os.path.basename(os.path.abspath(self.run.path)),
            "folder": os.path.abspath(self.run.path),
            "tempering": info.get("tempering"),
            "stages": self.run.stages(),
            "progress": self.run.progress(),
            "recipe": recipe,
            "components": info.get("components") or {},
            "files": {
                f: os.path.exists(os.path.join(self.run.path, f))
                for f in (RUN_FILE, METRICS_FILE, rollout_log.FILENAME, PROGRESS_FILE)
            },
        }

    def plots(self) -> list[str]:
        """The PNGs in the run folder's top and :data:`PLOT_DIRS`, as paths relative to it
        (``/`` separated), sorted: step numbers are zero-padded, so in step order."""
        found = []
        for sub in PLOT_DIRS:
            try:
                names = os.listdir(os.path.join(self.run.path, sub))
            except OSError:  # not written (yet)
                continue
            found += [f"{sub}/{n}" if sub else n for n in names if n.endswith(".png")]
        return sorted(found)

    def plot(self, rel: str) -> bytes | None:
        """A listed PNG's bytes; None for anything not listed (or gone since)."""
        if rel not in self.plots():
            return None
        try:
            with open(os.path.join(self.run.path, *rel.split("/")), "rb") as fh:
                return fh.read()
        except OSError:
            return None

    def route(self, path: str, query: str) -> tuple[int, Any]:
        """(status, JSON body) of an API path."""
        if path == "/api/run":
            return 200, self.run_info()
        if path == "/api/plots":
            return 200, self.plots()
        if path == "/api/metrics":
            return 200, self.metrics.rows()
        if path == "/api/rollouts":
            try:
                q = RolloutQuery.from_params(parse_qs(query))
            except ConfigError as exc:
                return 400, {"error": str(exc)}
            return 200, run_query(self.rollouts.rows(), q)
        return 404, {"error": f"no such endpoint {path}"}


def make_handler(viewer: RunViewer) -> Callable[[Call], Reply]:
    """The viewer's answers: the page's static files and the run's JSON (GET only)."""

    def answer(call: Call) -> Reply:
        if call.method not in ("GET", "HEAD"):
            return Reply(
                405, {"error": f"the viewer only reads: {call.method} is not answered"}, headers={"allow": "GET"}
            )
        if call.path == "/favicon.ico":
            return Reply(204, b"", "image/x-icon", NO_STORE)
        if call.path in STATIC:
            name, ctype = STATIC[call.path]
            body = resources.files("tempering.apps.view").joinpath("static").joinpath(name).read_bytes()
            return Reply(200, body, f"{ctype}; charset=utf-8", NO_STORE)
        if call.path.startswith("/plots/"):
            png = viewer.plot(call.path[len("/plots/") :])  # Starlette decodes the path
            if png is None:
                return Reply(404, {"error": f"no such plot {call.path}"}, headers=NO_STORE)
            return Reply(200, png, "image/png", NO_STORE)
        status, data = viewer.route(call.path, call.query)
        return Reply(status, data, headers=NO_STORE)

    return answer


def policy(log: Callable[[str], None] | None = None, allowed_hosts: Iterable[str] = ()) -> Policy:
    """Loopback names (and ``--allow-host`` ones) only; no login (the page has none); JSON errors."""
    return Policy(
        error_body=lambda status, message: {"error": message},
        error_headers=lambda status: NO_STORE,
        allowed_hosts=frozenset(allowed_hosts),
        host_hint="`tempering view --allow-host NAME`",
        log=log,
    )


class ViewServer:
    """A viewer of ``run_dir`` listening on 127.0.0.1 (``port`` 0: any free port), serving on
    a background thread once :meth:`start` is called (or in the foreground: :meth:`serve`).
    Requests must name a loopback host or one of ``allowed_hosts`` (see :func:`host_allowed`)."""

    def __init__(
        self, run_dir: str, port: int = 0, log: Callable[[str], None] | None = None, allowed_hosts: Iterable[str] = ()
    ) -> None:
        self.viewer = RunViewer(RunDir.open(run_dir))
        rules = policy(log, allowed_hosts)
        try:
            self.httpd = BackgroundServer(
                guarded_app(rules, make_handler(self.viewer)), rules, HOST, port, "tempering-view"
            )
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {HOST}:{port}: {exc.strerror}; pick another --port (0 = any free one)", "--port"
            ) from None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.httpd.server_address[1]}/"

    def start(self) -> ViewServer:
        self.httpd.start()
        return self

    def serve(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        self.httpd.close()

    def __enter__(self) -> ViewServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
