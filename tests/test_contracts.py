"""The typed contracts of tempering.interfaces: the backends and the test doubles fit the
required Backend protocol and the capability protocols they claim (and not the others), a
stage's needed capabilities are checked once the backend is built, before anything trains,
with one line naming the key, and the run context fits the RunContext protocol."""

from __future__ import annotations

import sys
from concurrent.futures import Future
from pathlib import Path

import pytest

from tempering import interfaces
from tempering.errors import ConfigError
from tempering.interfaces import (
    Backend,
    BuildContext,
    Closeable,
    Distributions,
    DownloadableWeights,
    EmaWeights,
    Exportable,
    FullDistributions,
    LossLogits,
    LossOnTrainingForward,
    RunContext,
    SamplingClients,
    WeightSnapshots,
    supports,
)
from tempering.registry import get_registry
from tempering.testing import FakeBackend
from tempering.training.recipe import Recipe

ALL = (
    WeightSnapshots,
    EmaWeights,
    SamplingClients,
    Distributions,
    FullDistributions,
    LossOnTrainingForward,
    LossLogits,
    Exportable,
    DownloadableWeights,
    Closeable,
)


def capabilities(backend: object) -> set[type]:
    return {cap for cap in ALL if supports(backend, cap)}


class SamplingFake(FakeBackend):
    """A test double with sampling clients (as tests/test_offpolicy.py's VersionedFake)."""

    def sampling_client(self) -> Future[FakeBackend]:
        fut: Future[FakeBackend] = Future()
        fut.set_result(self)
        return fut


def test_every_capability_is_listed_and_the_unused_protocols_are_gone():
    assert set(interfaces.CAPABILITIES.values()) == set(ALL)
    for name in ("Algorithm", "Dataset", "ModelBuilder", "Examples"):
        assert not hasattr(interfaces, name)
    import tempering.rollouts.environment

    assert not hasattr(tempering.rollouts.environment, "EnvironmentProtocol")


def test_test_doubles_fit_the_protocols():
    fake = FakeBackend()
    assert isinstance(fake, Backend)
    assert capabilities(fake) == {WeightSnapshots}
    assert capabilities(SamplingFake()) == {WeightSnapshots, SamplingClients}


def test_local_backend_fits_the_protocols():
    from tempering.plugins.backends.local.backend import LocalBackend

    kwargs = {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "intermediate_size": 32}
    backend = LocalBackend(model="tiny_llama", model_kwargs=kwargs, num_threads=1, threaded=False)
    try:
        assert isinstance(backend, Backend)
        assert capabilities(backend) == set(ALL) - {DownloadableWeights}
    finally:
        backend.close()


def test_tinker_backend_fits_the_protocols(monkeypatch, tmp_path):
    import tinker  # noqa: F401 - a dev dependency: missing is a failure, not a skip

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fake_tinker import close_backends, make_backend, serve

    servers = serve(monkeypatch, tmp_path)
    server = next(servers)
    try:
        backend = make_backend(server)
        assert isinstance(backend, Backend)
        # ema_update and full distributions are methods that raise a clear error: its
        # ``capabilities`` mapping turns them off
        assert capabilities(backend) == {
            WeightSnapshots,
            SamplingClients,
            Distributions,
            DownloadableWeights,
            Closeable,
        }
        assert isinstance(backend, EmaWeights) and not supports(backend, EmaWeights)
    finally:
        close_backends()
        next(servers, None)


def test_recipe_run_context_fits_the_protocol():
    from tempering.training.recipe import RunContext as Implementation

    ctx = Implementation(get_registry(), FakeBackend(), {}, "out", [], 0)
    assert isinstance(ctx, RunContext) and isinstance(ctx, BuildContext)
    from tempering.apps.checkpoint_eval import EvalContext

    assert isinstance(EvalContext(get_registry(), FakeBackend()), BuildContext)


def stage_error(tmp_path, stage: dict, backend: object) -> str:
    recipe = Recipe(name="c", output_dir=str(tmp_path), loggers=[], stages=[stage])
    with pytest.raises(ConfigError) as err:
        recipe.run(backend=backend)
    return str(err.value)


ROWS = [{"prompt": f"{i}+{i}=", "demonstration": str(2 * i), "chosen": "1", "rejected": "2"} for i in range(4)]


def test_a_missing_capability_is_one_line_at_the_stage_key_before_training(tmp_path):
    backend = FakeBackend()
    message = stage_error(
        tmp_path / "a",
        {"name": "sdft", "dataset": ROWS, "teacher": "ema", "loss": {"name": "sdft", "mode": "sampled_token"}},
        backend,
    )
    assert message == (
        "stages[0].teacher: 'ema' needs a backend that averages weights (ema_update, e.g. local); "
        "use teacher: stage_start, base or live"
    )
    assert backend.step == 0 and backend.batches == [] and backend.snapshots == []

    class NoSnapshots(FakeBackend):
        snapshot = None  # type: ignore[assignment]  # a method set to None: not there

    message = stage_error(tmp_path / "b", {"name": "dpo", "dataset": ROWS}, NoSnapshots())
    assert (
        message.startswith(
            "stages[0].reference_model: 'stage_start' with reference 'live' needs a backend with weight snapshots"
        )
        and "\n" not in message
    )


def test_grpo_falls_back_to_the_base_reference_without_snapshots(tmp_path):
    class NoSnapshots(FakeBackend):
        snapshot = None  # type: ignore[assignment]

    stage = {
        "name": "grpo",
        "dataset": [{"prompt": "1+1=", "answer": "2"}] * 4,
        "steps": 1,
        "prompts_per_step": 2,
        "group_size": 2,
        "eval": {"at_start": False},
    }
    recipe = Recipe(name="g", output_dir=str(tmp_path), loggers=[], stages=[stage])
    with pytest.warns(RuntimeWarning, match="reference: this backend cannot snapshot weights"):
        recipe.run(backend=NoSnapshots())
