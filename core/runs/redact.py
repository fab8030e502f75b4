"""Secrets kept out of what a run writes.

A recipe may hold a literal secret, e.g. ``llm_judge``'s ``api_key`` or the Tinker backend's
``api_key`` (the documented way is a variable *name*, ``api_key_env``, or the environment). The
resolved recipe is written to ``run.json``, from which the tracker loggers (wandb, trackio,
mlflow) and ``tempering view`` read it, and ``tempering show`` prints it; so every copy goes
through :func:`redact`, which replaces the value of each key that names a secret with
:data:`REDACTED`. The running components still get the real value: only the copies are redacted.

Which keys: ``api_key``/``apikey``, ``password``, ``secret``, ``access_token``/``auth_token``/
``bearer_token``/``hf_token``, alone or as the end of a longer key (``judge_api_key``), in any
case. ``*_env`` keys (``api_key_env``: the *name* of a variable) and keys that only mention a
token (``max_tokens``, ``eos_token``) are kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "is_secret_key", "redact", "redact_yaml_text"]

#: What a secret's value is written as.
REDACTED = "<redacted>"

_SECRET = re.compile(
    r"(?:^|[_-])(?:api[_-]?key|password|passwd|secret|access[_-]token|auth[_-]token|bearer[_-]token|"
    r"hf[_-]token)$",
    re.IGNORECASE,
)


def is_secret_key(key: object) -> bool:
    """Whether a config key names a secret (its value is redacted)."""
    return isinstance(key, str) and bool(_SECRET.search(key))


def redact(node: object) -> Any:
    """A copy of ``node`` (mappings, lists, tuples, scalars) with every secret key's value, when
    it is set (not None, not empty), replaced by :data:`REDACTED`."""
    if isinstance(node, Mapping):
        return {k: (REDACTED if is_secret_key(k) and v not in (None, "") else redact(v)) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(redact(v) for v in node)
    return node


_YAML_LINE = re.compile(
    r"^(?P<head>\s*(?:-\s+)?(?P<key>[\"']?[A-Za-z0-9_-]+[\"']?)\s*:[ \t]+)(?P<value>[^#\s{\[|>][^#]*?)"
    r"(?P<tail>\s+#.*)?$"
)
_FLOW_PAIR = re.compile(r"(?P<key>[A-Za-z0-9_-]+)\s*:\s*(?P<value>\"[^\"]*\"|'[^']*'|[^,}\s]+)")


def redact_yaml_text(text: str) -> str:
    """A recipe file's text with secret values redacted, comments and layout kept (for
    ``tempering show``, which prints the file as written): ``key: value`` lines and
    ``{key: value}`` flow pairs whose key names a secret."""
    out = []
    for line in text.splitlines(keepends=True):
        body, end = (line[:-1], "\n") if line.endswith("\n") else (line, "")
        m = _YAML_LINE.match(body)
        if m and is_secret_key(m.group("key").strip("\"'")):
            body = m.group("head") + REDACTED + (m.group("tail") or "")
        elif "{" in body:
            body = _FLOW_PAIR.sub(
                lambda p: f"{p.group('key')}: {REDACTED}" if is_secret_key(p.group("key")) else p.group(0), body
            )
        out.append(body + end)
    return "".join(out)
