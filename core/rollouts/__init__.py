"""Rollouts: how a policy's samples come to be, from an example to token-exact trajectories.

Chat messages and parsed turns (:mod:`.chat`), tools from typed functions (:mod:`.tools`), the
renderer protocol (:mod:`.renderer`), the environment base class (:mod:`.environment`), running
an episode (:mod:`.episode`) into token-exact rows (:mod:`.trajectory`), running rewards
(:mod:`.scoring`) and their feedback in words (:mod:`.feedback`), example streams (:mod:`.data`),
and the one rollout path, synchronous (:mod:`.rollout`) or on a producer thread
(:mod:`.async_rollout`). Nothing here trains or writes a run folder's files except through
:mod:`tempering.runs`.
"""
