"""Training: running a recipe's stages.

The recipe's schema and overrides (:mod:`.config`), the recipe runner with checkpoints and resume
(:mod:`.recipe`), the one loop skeleton every stage runs (:mod:`.stage`), the RL engine
(:mod:`.rl`), the self-distillation teacher SDFT and SDPO share (:mod:`.teacher`), held-out
evaluation during a stage (:mod:`.evaluate`), dataset checks, LR schedules, progress bars and the
resolved (defaults filled in) view of a recipe.
"""
