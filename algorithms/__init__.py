"""Built-in training algorithms (``tempering.algorithms``): GRPO, SFT and friends.

Each algorithm lives in its own subpackage and registers its components through the same
``tempering`` entry-point hooks as third-party plugins.
"""
