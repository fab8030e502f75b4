"""The ``generate`` engine prefills a group's shared prompt once (issue 33 item 3).

A group's G completions share one prompt; the engine computes its KV cache once and copies it to
the G rows. The tokens drawn (greedy and sampled from one seed) must equal the G-prefill path's,
their logprobs to float rounding, and the prompt must really be run once per distinct prompt.
"""

from __future__ import annotations

import pytest
import torch

from tempering.plugins.backends.local.backend import LocalBackend
from tempering.types import SamplingParams

PROMPTS = ["12+3=", "7+40=123+4", "1"]


def both_ways(backend: LocalBackend, params: SamplingParams, n: int = 4):
    prompts = [backend.tokenizer.encode(p) for p in PROMPTS]
    out = []
    for once in (False, True):
        backend._generator.prefill_once = once
        torch.manual_seed(0)
        out.append([c for g in backend.sample(prompts, n, params).result() for c in g])
    return out


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tokens_equal_and_logprobs_to_rounding(model: str, temperature: float) -> None:
    backend = LocalBackend(model=model, num_threads=1, threaded=False, seed=3)
    before, after = both_ways(backend, SamplingParams(max_tokens=12, temperature=temperature, top_p=0.9))
    assert [c.tokens for c in before] == [c.tokens for c in after]
    gap = max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x.logprobs, y.logprobs))
    assert gap < 1e-5
    assert len({tuple(c.tokens) for c in after}) > len(PROMPTS) or temperature == 0.0  # really sampled


def test_each_distinct_prompt_is_run_once() -> None:
    """Count the prompt positions the model is run on: G x prompt before, 1 x prompt now."""
    backend = LocalBackend(model="tiny_llama", num_threads=1, threaded=False)
    widths: list[tuple[int, int]] = []
    hook = backend.model.register_forward_pre_hook(
        lambda _m, args, kwargs: widths.append(tuple((kwargs.get("input_ids") if kwargs else args[0]).shape)),
        with_kwargs=True,
    )
    try:
        both_ways(backend, SamplingParams(max_tokens=3, temperature=1.0), n=5)
    finally:
        hook.remove()
    width = max(len(backend.tokenizer.encode(p)) for p in PROMPTS)
    g_prefill = [w for w in widths if w[1] >= width - 1]
    # the old path: one call of 15 rows x the padded prompt; the new one: 3 rows x all but its last token
    assert g_prefill == [(15, width), (3, width - 1)]


def test_no_repeated_prompt_no_prefill_call() -> None:
    backend = LocalBackend(model="tiny_llama", num_threads=1, threaded=False)
    calls: list[int] = []
    hook = backend.model.register_forward_pre_hook(lambda *_a, **_k: calls.append(1))
    try:
        backend.sample([backend.tokenizer.encode(p) for p in PROMPTS], 1, SamplingParams(max_tokens=2)).result()
    finally:
        hook.remove()
    assert len(calls) == 2  # generate's own steps only: the prompt and one more token


SHARED = "1234567890+1234567890 987654321="  # 32 characters every prompt starts with


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen"])
def test_a_shared_beginning_is_run_once_with_the_same_tokens(model: str) -> None:
    """Distinct prompts of different lengths (so different left padding) that share 32 tokens:
    the prefix is run once, on one row; tokens equal, logprobs to rounding."""
    backend = LocalBackend(model=model, num_threads=1, threaded=False, seed=5)
    prompts = [backend.tokenizer.encode(SHARED + tail) for tail in ("1", "22+7=", "333 4=", "4")]
    widths: list[tuple[int, int]] = []
    hook = backend.model.register_forward_pre_hook(
        lambda _m, args, kwargs: widths.append(tuple((kwargs.get("input_ids") if kwargs else args[0]).shape)),
        with_kwargs=True,
    )
    out = []
    try:
        for once in (False, True):
            backend._generator.prefill_once = once
            torch.manual_seed(0)
            out.append([g[0] for g in backend.sample(prompts, 1, SamplingParams(max_tokens=10)).result()])
    finally:
        hook.remove()
    before, after = out
    assert [c.tokens for c in before] == [c.tokens for c in after]
    gap = max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x.logprobs, y.logprobs))
    assert gap < 1e-5
    prefix_len = len(backend.tokenizer.encode(SHARED))
    assert (1, prefix_len) in widths  # the shared beginning, once, on one row
