"""Moved to :mod:`tempering.plugins.tinker_server.server`; this name stays so that
``python -m tempering.plugins.backends.tinker.local_server`` (in scripts and older docs) and
imports of it keep working."""

from tempering.plugins.tinker_server.cli import main, served_models
from tempering.plugins.tinker_server.server import DEFAULT_MODELS, Faults, LocalTinkerServer, Received

__all__ = ["LocalTinkerServer", "Faults", "Received", "DEFAULT_MODELS", "main", "served_models"]

if __name__ == "__main__":
    main()
