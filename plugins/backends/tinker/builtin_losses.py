"""Moved to :mod:`tempering.plugins.tinker_server.builtin_losses` (the server computes Tinker's
built-in losses; the Tinker backend only names them); re-exported here for the old name."""

from tempering.plugins.tinker_server.builtin_losses import (
    BUILTIN_CONFIG,
    BUILTIN_INPUTS,
    builtin_loss,
    check_builtin,
)

__all__ = ["BUILTIN_INPUTS", "BUILTIN_CONFIG", "builtin_loss", "check_builtin"]
