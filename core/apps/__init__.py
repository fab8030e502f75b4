"""Apps: what a user runs around training.

The command line (:mod:`.cli`), the rollout viewer (:mod:`.view`), reading a run folder back and
rebuilding its policy at a checkpoint (:mod:`.rundata`), export (:mod:`.export`), checkpoint
evaluation with pass@k and calibration (:mod:`.checkpoint_eval`, :mod:`.calibration`), the
inspect_ai model provider (:mod:`.inspect_bridge`) and the generator of ``docs/reference.md``
(:mod:`.reference_docs`). The top of the layering: nothing else in tempering imports these.
"""
