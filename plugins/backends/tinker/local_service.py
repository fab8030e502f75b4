"""Moved to :mod:`tempering.plugins.tinker_server.service`; re-exported here so that imports of
the old name (``ServedModel`` above all) keep working."""

from tempering.plugins.tinker_server.service import (
    MIN_TTL_SECONDS,
    LocalService,
    Rejected,
    ServedModel,
    UserError,
)

__all__ = ["ServedModel", "LocalService", "Rejected", "UserError", "MIN_TTL_SECONDS"]
