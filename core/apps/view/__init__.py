"""``tempering view RUN_DIR``: a local web page over a run folder -- each stage's metric
curves, a rollouts browser, the resolved recipe and where each component came from.

:mod:`.server` serves the page and a small JSON API on 127.0.0.1; :mod:`.query` filters
rollout records for it; ``static/`` holds the page (plain HTML, CSS and JavaScript, no
downloads: the page must work on a machine with no network).
"""
