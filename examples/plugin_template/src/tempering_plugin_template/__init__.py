"""A template tempering plugin: one reward (``length_penalty``) and one advantage estimator
(``rank``).

Nothing is imported here: tempering imports :mod:`tempering_plugin_template.plugin` to list
the components, and the components themselves only when a recipe uses them.
"""

__version__ = "0.1.0"
