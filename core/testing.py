"""Test helpers for plugin authors: an opt-in pytest plugin.

Enable it in your plugin's ``tests/conftest.py``::

    pytest_plugins = ["tempering.testing"]

(or run ``pytest -p tempering.testing``). It is not loaded automatically, so it never changes
other projects' test runs. It needs pytest, which tempering itself does not depend on.

Fixtures
    ``tempering_registry``: a fresh :class:`~tempering.registry.Registry` loaded from the
    installed entry points, installed as the process-wide registry for the test (so
    ``get_registry()``, :func:`tempering.training.recipe.run_recipe` and the CLI use it) and dropped
    afterwards.
    ``empty_registry``: a strict registry with no plugins at all; add yours with
    ``add_plugin``.

Helpers (plain functions, usable without pytest fixtures)
    :func:`make_registry` builds a strict registry from plugin modules, :func:`check_plugin`
    asserts that a plugin module registers components whose lazy targets all import, and
    :class:`FakeBackend` runs a real training stage (GRPO, SFT) without a model, so a reward,
    advantage estimator or loss can be tested inside a recipe in well under a second.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any

import pytest

import tempering.loss_contract as loss_contract
import tempering.registry as _registry
from tempering.errors import PluginError
from tempering.interfaces import Loss
from tempering.registry import Component, PluginInfo, Registry
from tempering.types import AdamParams, Batch, Completion, SamplingParams

__all__ = ["CharTokenizer", "FakeBackend", "check_plugin", "empty_registry", "make_registry", "tempering_registry"]


# --------------------------------------------------------------------------- registries
def make_registry(*plugins: object, builtins: bool = True, strict: bool = True, dist: str = "test-plugin") -> Registry:
    """A fresh registry holding ``plugins`` (modules or objects with ``@hookimpl`` functions)
    and, with ``builtins``, tempering's own components -- but no other installed plugin, so
    the result does not depend on what else is installed (or on your plugin being installed).

    Strict by default, so a misspelt hook or a hook that raises fails the test at once.
    ``dist`` is the package name the components are attributed to (``dist:name`` pins it).
    """
    reg = Registry(entry_points=False, strict=strict)
    if builtins:
        reg.load_entry_points(external=False)
    for plugin in plugins:
        name = getattr(plugin, "__name__", type(plugin).__name__)
        reg.add_plugin(plugin, PluginInfo(name, dist, "0", name))
    return reg


def check_plugin(plugin: object, dist: str = "test-plugin") -> list[Component]:
    """Register ``plugin`` alone and import every lazy ``"module:attr"`` target it names.

    Returns its components. Raises :class:`~tempering.errors.PluginError` if a hook is
    misspelt or raises, if it registers nothing, or if a target cannot be imported.
    """
    reg = make_registry(plugin, builtins=False, dist=dist)
    comps = reg.components()
    if not comps:
        raise PluginError(f"{getattr(plugin, '__name__', plugin)!r} registers no components: is a hook misspelt?")
    for comp in comps:
        comp.load()
    return comps


@pytest.fixture
def tempering_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """A fresh registry from the installed entry points, used process-wide for this test."""
    reg = Registry()
    monkeypatch.setattr(_registry, "_default", reg)
    yield reg


@pytest.fixture
def empty_registry() -> Registry:
    """A strict registry with no plugins loaded."""
    return Registry(entry_points=False, strict=True)


# --------------------------------------------------------------------------- a fake backend
class CharTokenizer:
    """One token per character (``ord(c) + 3``); 0 = pad, 1 = bos, 2 = eos."""

    pad_token_id, bos_token_id, eos_token_id = 0, 1, 2
    chat_template = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = [ord(c) + 3 for c in text]
        return {"input_ids": [self.bos_token_id, *ids] if add_special_tokens else ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i - 3) for i in ids if i > 2 or not skip_special_tokens)


def _done(value: object) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


class FakeBackend:
    """A :class:`~tempering.interfaces.Backend` without a model, for testing components; it
    also has :class:`~tempering.interfaces.WeightSnapshots` (named snapshots score like the policy).

    ``complete(prompt_text, i)`` gives the text of the ``i``-th sample for a prompt (default:
    ``str(i)``); every token gets sampler logprob ``logprob``. ``forward_backward`` calls the
    loss for real, on the batch's sampler logprobs standing in for the model's (so a loss plugin
    runs and must give a finite loss with finite gradients), and keeps each batch in
    :attr:`batches` so a test can check the advantages that reached it. ``save``/``load``
    write a small JSON file, so checkpointing and resuming work.
    """

    #: No model, so no logits for a loss (:class:`~tempering.interfaces.LossLogits`).
    capabilities = {"logits": False}

    def __init__(self, complete: Callable[[str, int], str] | None = None, logprob: float = -1.0) -> None:
        self.tokenizer = CharTokenizer()
        self.complete = complete or (lambda prompt, i: str(i))
        self.logprob = logprob
        self.step = 0
        self.batches: list[Batch] = []
        self.adam: list[AdamParams] = []
        self.snapshots: list[str] = []

    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            row = []
            for i in range(num_samples):
                completion = self.complete(text, i)[: params.max_tokens]
                tokens = self.tokenizer(completion, add_special_tokens=False)["input_ids"]
                row.append(
                    Completion(
                        list(prompt),
                        tokens,
                        [self.logprob] * len(tokens),
                        "stop",
                        completion,
                        policy_version=self.step,
                        temperature=params.temperature,
                    )
                )
            out.append(row)
        return _done(out)

    def logprobs(self, batch: Batch, reference: bool = False, weights: str | None = None) -> Future[list[list[float]]]:
        if weights is not None and weights not in self.snapshots:
            raise KeyError(f"FakeBackend: no weight snapshot named '{weights}' (have: {sorted(self.snapshots)})")
        return _done([[self.logprob if w else 0.0 for w in d.weights] for d in batch.data])

    def snapshot(self, name: str) -> Future[None]:
        """Remember that a named snapshot exists (its logprobs are the same constant)."""
        self.snapshots.append(name)
        return _done(None)

    def drop_snapshot(self, name: str) -> Future[None]:
        """Forget a named snapshot (no error if there is none)."""
        self.snapshots = [s for s in self.snapshots if s != name]
        return _done(None)

    def snapshot_names(self) -> list[str]:
        return sorted(set(self.snapshots))

    def forward_backward(self, batch: Batch, loss: Loss) -> Future[dict[str, float]]:
        import torch

        if loss_contract.needs_logits(loss):
            raise NotImplementedError("FakeBackend has no model, so no logits: test this loss on a real backend")
        tensors = batch.to_tensors(self.tokenizer.pad_token_id)
        base = tensors.get("sampler_logprobs", torch.full_like(tensors["weights"], self.logprob))
        logprobs = base.clone().requires_grad_(True)
        out = loss(logprobs, tensors)
        out.loss.backward()
        if not torch.isfinite(out.loss) or logprobs.grad is None or not torch.isfinite(logprobs.grad).all():
            raise FloatingPointError(f"loss {type(loss).__name__} gave a non-finite loss or gradient")
        self.batches.append(batch)
        return _done({"loss": float(out.loss.detach()), **{k: float(v) for k, v in out.metrics.items()}})

    def optim_step(self, params: AdamParams) -> Future[dict[str, float]]:
        self.adam.append(params)
        self.step += 1
        return _done({"learning_rate": params.learning_rate})

    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "fake_backend.json"), "w", encoding="utf-8") as fh:
            # snapshots are part of a checkpoint (WeightSnapshots' contract): a resumed stage finds them
            json.dump({"step": self.step, "snapshots": self.snapshot_names(), "extra": dict(extra or {})}, fh)
        return path

    def load(self, path: str) -> dict[str, Any]:
        with open(os.path.join(path, "fake_backend.json"), encoding="utf-8") as fh:
            data = json.load(fh)
        self.step = int(data["step"])
        self.snapshots = list(data.get("snapshots", []))
        return dict(data["extra"])
