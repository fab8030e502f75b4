"""The viewer's HTTP server: the page, and the run folder as JSON.

Bound to 127.0.0.1 only: a run's transcripts and config are the user's data, and the page has
no login. For the same reason it answers only requests addressed to a loopback host name
(``Host: 127.0.0.1``, ``localhost``, ``[::1]``, ``*.localhost``, with any port) or one given
with ``tempering view --allow-host NAME``; anything else is a 403. Binding loopback is not
enough: with DNS rebinding a web page the user opens points its own name at 127.0.0.1 and
could then read the run from the user's browser, but its requests carry its own name as Host.
Files are re-read when they change (size and modification time), so reloading the
page while a run trains shows its latest steps. Endpoints:

======================  =======================================================================
``/``                   the page (``static/index.html``, ``view.js``, ``view.css``)
``/api/run``            the run's name, folder, stages, progress, resolved recipe and component
                        provenance (``run.json``)
``/api/metrics``        the rows of ``metrics.jsonl``
``/api/rollouts?...``   one page of ``rollouts.jsonl`` records matching a filter
                        (:class:`~tempering.apps.view.query.RolloutQuery`'s fields as parameters)
======================  =======================================================================
"""

from __future__ import annotations

import ipaddress
import json
import os
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import parse_qs, urlsplit

from tempering.apps.rundata import METRICS_FILE, RUN_FILE, RunDir, read_jsonl
from tempering.apps.view.query import RolloutQuery, run_query
from tempering.errors import ConfigError
from tempering.runs import rollout_log
from tempering.runs.runfolder import PROGRESS_FILE

HOST = "127.0.0.1"
STATIC = {
    "/": ("index.html", "text/html"),
    "/view.js": ("view.js", "text/javascript"),
    "/view.css": ("view.css", "text/css"),
}


def host_allowed(host: str | None, allowed: Iterable[str] = ()) -> bool:
    """Whether a request's ``Host`` header names this machine's loopback (an IP literal that is
    loopback, ``localhost`` or a ``*.localhost`` name, which resolve to loopback by RFC 6761) or
    one of ``allowed`` (compared without port and case). A missing header is refused: every
    browser sends one."""
    if not host:
        return False
    name = host.strip().lower()
    if name.startswith("["):  # [v6]:port
        name = name[1 : name.find("]")] if "]" in name else name
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.rstrip(".")
    if name in {a.strip().lower().rstrip(".") for a in allowed}:
        return True
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


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

    def route(self, path: str, query: str) -> tuple[int, Any]:
        """(status, JSON body) of an API path."""
        if path == "/api/run":
            return 200, self.run_info()
        if path == "/api/metrics":
            return 200, self.metrics.rows()
        if path == "/api/rollouts":
            try:
                q = RolloutQuery.from_params(parse_qs(query))
            except ConfigError as exc:
                return 400, {"error": str(exc)}
            return 200, run_query(self.rollouts.rows(), q)
        return 404, {"error": f"no such endpoint {path}"}


def make_handler(
    viewer: RunViewer, log: Callable[[str], None] | None = None, allowed_hosts: Iterable[str] = ()
) -> type[BaseHTTPRequestHandler]:
    allowed = tuple(allowed_hosts)

    class Handler(BaseHTTPRequestHandler):
        server_version = "tempering-view"

        def do_GET(self) -> None:  # http.server's name
            if not host_allowed(self.headers.get("Host"), allowed):
                error = {
                    "error": f"host {self.headers.get('Host')!r} refused: this viewer answers loopback names "
                    "(127.0.0.1, localhost, [::1]) only, against DNS rebinding; to use another name "
                    "for this machine, start it with `tempering view --allow-host NAME`"
                }
                return self._send(403, json.dumps(error).encode(), "application/json")
            parts = urlsplit(self.path)
            if parts.path == "/favicon.ico":
                return self._send(204, b"", "image/x-icon")
            if parts.path in STATIC:
                name, ctype = STATIC[parts.path]
                body = resources.files("tempering.apps.view").joinpath("static").joinpath(name).read_bytes()
                return self._send(200, body, f"{ctype}; charset=utf-8")
            status, data = viewer.route(parts.path, parts.query)
            self._send(status, json.dumps(data, ensure_ascii=False).encode(), "application/json")

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")  # a live run: always the latest
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # http.server's name
            if log is not None:
                log(format % args)

    return Handler


class ViewServer:
    """A viewer of ``run_dir`` listening on 127.0.0.1 (``port`` 0: any free port), serving on
    a background thread once :meth:`start` is called (or in the foreground: :meth:`serve`).
    Requests must name a loopback host or one of ``allowed_hosts`` (see :func:`host_allowed`)."""

    def __init__(
        self, run_dir: str, port: int = 0, log: Callable[[str], None] | None = None, allowed_hosts: Iterable[str] = ()
    ) -> None:
        self.viewer = RunViewer(RunDir.open(run_dir))
        try:
            self.httpd = ThreadingHTTPServer((HOST, port), make_handler(self.viewer, log, allowed_hosts))
        except OSError as exc:
            raise ConfigError(
                f"cannot listen on {HOST}:{port}: {exc.strerror}; pick another --port (0 = any free one)", "--port"
            ) from None
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.httpd.server_address[1]}/"

    def start(self) -> ViewServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="tempering-view", daemon=True)
        self._thread.start()
        return self

    def serve(self) -> None:
        self.httpd.serve_forever()

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()

    def __enter__(self) -> ViewServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
