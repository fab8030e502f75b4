"""The policy's trainable weights and the other weights the local backend scores with: named
snapshots (``snapshot``, ``ema_update``: DPO's and SDFT's "policy at stage start" and EMA
teachers), and the reference policy (the LoRA adapter switched off, or for full fine-tuning the
initial model, rebuilt from its source on first use).

One object owns these so that swapping a snapshot in and out, averaging into it, saving it and
laying it out again after a load (sharded or not, like its parameter) are written once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

import tempering.plugins.backends.local.sharding as sharding
from tempering.plugins.backends.local.building import fingerprint


class PolicyWeights:
    """The trainable tensors of ``model`` (listed after any sharding: under FSDP they are
    DTensors), the snapshots by name, and the reference model.

    Args:
        model: the policy (a peft model with LoRA).
        lora: whether only an adapter trains.
        sharded: whether ``model`` is sharded with FSDP (the reference model is sharded too).
        dtype: the reference model's dtype when it is sharded.
        build_reference: builds the initial model afresh (full fine-tuning only).
        initial_fingerprint: :func:`~tempering.plugins.backends.local.building.fingerprint` of the
            policy at start-up, which a rebuilt reference must match (``None`` with LoRA).
        source_name: the model's name in the error when it does not.
    """

    def __init__(
        self,
        model: Any,
        lora: bool,
        sharded: bool,
        dtype: torch.dtype,
        build_reference: Callable[[], Any],
        initial_fingerprint: list[float] | None,
        source_name: str,
    ) -> None:
        self.model = model
        self.lora = lora
        self.sharded = sharded
        self.dtype = dtype
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.tensors = [p for _, p in self.named]
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self._build_reference = build_reference
        self._fingerprint = initial_fingerprint
        self._source_name = source_name
        self._reference: Any = None

    # ------------------------------------------------------------------ snapshots
    def copy(self) -> dict[str, torch.Tensor]:
        """A detached copy of every trainable tensor, by name."""
        with torch.no_grad():
            return {n: p.detach().clone() for n, p in self.named}

    def snapshot(self, name: str) -> None:
        self.snapshots[name] = self.copy()

    def ema_update(self, name: str, rate: float) -> None:
        if name not in self.snapshots:  # kept in float32 so small rates do not round away
            with torch.no_grad():
                self.snapshots[name] = {n: p.detach().float().clone() for n, p in self.named}
            return
        snap = self.snapshots[name]
        with torch.no_grad():
            for n, p in self.named:
                if snap[n].is_floating_point() and snap[n].dtype != torch.float32:
                    snap[n] = snap[n].float()  # a snapshot() turned EMA: average in float32
                snap[n].lerp_(p.detach().to(snap[n].dtype), rate)

    @contextlib.contextmanager
    def swapped(self, name: str) -> Iterator[None]:
        """The named snapshot's values in the trainable tensors, the policy's restored after."""
        if name not in self.snapshots:
            raise KeyError(f"LocalBackend: no weight snapshot named '{name}' (have: {sorted(self.snapshots)})")
        snap = self.snapshots[name]
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.tensors]
            for n, p in self.named:
                p.copy_(snap[n])
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(self.tensors, saved):
                    p.copy_(value)

    def snapshots_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Every snapshot as whole CPU tensors (a sharded one gathered), for a checkpoint."""
        return {k: {n: sharding.full_tensor(t.detach()).cpu() for n, t in v.items()} for k, v in self.snapshots.items()}

    def restore_snapshots(self, saved: dict[str, dict[str, torch.Tensor]]) -> None:
        """Replace the snapshots by checkpointed ones, each laid out (sharded or not) like its parameter."""
        params = dict(self.named)
        self.snapshots = {k: {n: sharding.shard_like(t, params[n]) for n, t in v.items()} for k, v in saved.items()}

    # ------------------------------------------------------------------ the policy's own weights
    def state(self) -> dict[str, torch.Tensor]:
        """What training changes, on the CPU (not sharded): the adapter with LoRA, the whole
        state dict otherwise."""
        if self.lora:
            return {n: p.detach().cpu() for n, p in self.model.named_parameters() if p.requires_grad}
        return {n: t.detach().cpu() for n, t in self.model.state_dict().items()}

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        """Load what :meth:`state` (or a sharded gather) returned into the policy."""
        missing = [n for n, _ in self.named if n not in weights] if self.lora else []
        if missing:
            raise ValueError(
                f"LocalBackend.load: the checkpoint lacks adapter tensors {missing[:3]}... (lora config differs?)"
            )
        if self.sharded:
            sharding.load_weights(self.model, weights, self.lora)
            return
        if not self.lora:
            self.model.load_state_dict(weights)
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)

    # ------------------------------------------------------------------ scoring
    @contextlib.contextmanager
    def scoring_model(self, reference: bool, weights: str | None = None) -> Iterator[Any]:
        """The module to score with: the policy, the policy with its adapter off, the copy, or
        the policy with a named snapshot's weights swapped in (and back out afterwards)."""
        if weights is not None:
            if reference:
                raise ValueError("logprobs: pass reference=True or weights=NAME, not both")
            with self.swapped(weights):
                yield self.model
        elif not reference:
            yield self.model
        elif self.lora:
            with self.model.disable_adapter():
                yield self.model
        else:
            yield self.reference_model()

    def reference_model(self) -> Any:
        """The frozen initial model for full fine-tuning, built on first use.

        Rebuilt from the source rather than deep-copied at start-up: it costs no memory until
        a recipe asks for it, and it is still the *initial* model when that happens after
        training (or after resuming from a checkpoint).
        """
        if self._reference is None:
            ref = self._build_reference()
            for p in ref.parameters():
                p.requires_grad_(False)
            if fingerprint(ref) != self._fingerprint:
                raise RuntimeError(
                    f"LocalBackend: rebuilding '{self._source_name}' for the reference model gave different "
                    "weights than at start-up; the model builder must be deterministic given its seed"
                )
            if self.sharded:
                sharding.shard_model(ref, self.dtype)
            self._reference = ref
        return self._reference
