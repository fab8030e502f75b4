"""Runs: what a run leaves on disk and how its failures are counted.

The output folder with its lock, checkpoint naming and ``progress.json`` (:mod:`.runfolder`),
the sampled rollouts written as ``rollouts.jsonl`` (:mod:`.rollout_log`), counted failures of
rewards, tools and environments with their first tracebacks (:mod:`.failures`), and secrets
redacted from what is written (:mod:`.redact`). Below rollouts and training: both report here.
Also the HTTP stack every tempering server runs on (:mod:`.serving`), low so that the viewer
(apps) and the plugins' servers share it.
"""
