"""``python -m tempering.plugins.tinker_server``: serve until interrupted (see
:func:`~tempering.plugins.tinker_server.cli.main` for the options)."""

from tempering.plugins.tinker_server.cli import main

if __name__ == "__main__":
    main()
