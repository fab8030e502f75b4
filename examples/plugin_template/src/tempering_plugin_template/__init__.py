"""A template tempering plugin: a reward (``length_penalty``), an advantage estimator
(``rank``) and a tool-use environment (``unit_converter``).

Nothing is imported here: tempering imports :mod:`tempering_plugin_template.plugin` to list
the components, and the components themselves only when a recipe uses them.
"""

__version__ = "0.1.0"
