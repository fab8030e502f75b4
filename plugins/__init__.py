"""Built-in plugins: backends, models, rewards, datasets and loggers.

They register through the same entry points as third-party plugins, and their modules are
imported lazily by name, so importing this package costs nothing.
"""
