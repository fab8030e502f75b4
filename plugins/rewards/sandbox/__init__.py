"""The ``sandbox`` reward: model-written programs run against unit tests in an isolated process
(:mod:`.reward`); how they are isolated (:mod:`.isolation`), what runs inside (:mod:`.harness`),
the call's files (:mod:`.job`) and the host's side of a test (:mod:`.program`)."""
