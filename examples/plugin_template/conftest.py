# tempering's opt-in pytest plugin: the tempering_registry / empty_registry fixtures.
pytest_plugins = ["tempering.testing"]
