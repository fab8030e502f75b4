"""The Tinker SDK's own log lines, kept to one line each.

When the service dies mid-run the SDK's telemetry sender logs ``Dropping telemetry batch that
failed to send`` with the whole chained traceback (httpcore -> httpx -> tinker: about 75
lines) on every flush. The run's own error already names the dead service in one line, so
:func:`one_line_sdk_logs` puts a filter on the SDK's telemetry logger that keeps each record
but replaces its traceback by the exception's one line (``APIConnectionError: Connection
error.``). Nothing is dropped: the record is still logged, at its level.
"""

from __future__ import annotations

import logging

#: The SDK loggers whose records carry tracebacks a run does not need.
SDK_LOGGERS = ("tinker.lib.telemetry",)


class OneLine(logging.Filter):
    """Moves a record's exception into its message, as ``message (Type: text)``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            text = " ".join(str(err).split())
            record.msg = f"{record.getMessage()} ({type(err).__name__}{': ' + text if text else ''})"
            record.args = None
            record.exc_info = None
            record.exc_text = None
        return True


def one_line_sdk_logs() -> None:
    """Install :class:`OneLine` on the SDK's loggers (once: calling again adds nothing)."""
    for name in SDK_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, OneLine) for f in logger.filters):
            logger.addFilter(OneLine())
