"""Scoring on Tinker: per-token logprobs and top-k next-token distributions of given rows.

Two ways, as the backend's ``policy_logprobs`` and ``weights=`` choose: a forward pass of the
training client (``forward`` with ``cross_entropy``: the numerics of training, so an on-policy
ratio is exactly 1) or a sampling client's ``compute_logprobs`` / prompt logprobs (the base
model, a snapshot, or the newest weights), which are idempotent and retried.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from types import ModuleType
from typing import Any

import torch

from tempering.plugins.backends.tinker.errors import TinkerServiceError
from tempering.plugins.backends.tinker.session import Session
from tempering.types import Batch


def forward_data(types: ModuleType, batch: Batch) -> list[Any]:
    """The batch as ``tinker.types.Datum`` rows for the trainer's ``forward`` (cross-entropy
    inputs: the targets and their weights)."""
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(list(d.input_tokens)),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np_array(d.target_tokens, "int64")),
                "weights": types.TensorData.from_numpy(np_array(d.weights, "float32")),
            },
        )
        for d in batch.data
    ]


def forward_logprobs(out: Any, batch: Batch) -> list[list[float]]:
    """The per-target logprobs of a ``forward`` result, one row per datum, checked for length."""
    rows = [tensor_list(o["logprobs"]) for o in out.loss_fn_outputs]
    for d, row in zip(batch.data, rows):
        if len(row) != len(d.target_tokens):
            raise TinkerServiceError(
                f"logprobs: Tinker returned {len(row)} logprobs for {len(d.target_tokens)} targets"
            )
    return rows


def score_batch(session: Session, get_client: Callable[[], Any], batch: Batch, what: str) -> list[list[float]]:
    """Per-target logprobs of shifted rows (``input_tokens[1:] == target_tokens[:-1]``) from a
    sampling client: each row scored as one full sequence."""
    fulls, lengths = [], []
    for i, d in enumerate(batch.data):
        if list(d.input_tokens[1:]) != list(d.target_tokens[:-1]):
            raise ValueError(f"{what}: row {i} is not a shifted sequence (input_tokens[1:] != target_tokens[:-1])")
        fulls.append(list(d.input_tokens) + [int(d.target_tokens[-1])] if d.target_tokens else list(d.input_tokens))
        lengths.append(len(d.target_tokens))
    return score_rows(session, get_client, fulls, lengths, what)


def score_rows(
    session: Session, get_client: Callable[[], Any], fulls: list[list[int]], lengths: list[int], what: str
) -> list[list[float]]:
    """``compute_logprobs`` of each full sequence (all in flight at once, each retried); the
    last ``lengths[i]`` values of row i."""
    client = get_client()
    types = session.tinker.types

    def submit(tokens: list[int]) -> Any:
        return client.compute_logprobs(types.ModelInput.from_ints(tokens))

    futures = [session.try_submit(submit, f) for f in fulls]
    out = []
    for full, n, fut in zip(fulls, lengths, futures):
        values = list(session.result_with_retry(what, fut, partial(submit, full)))
        if len(values) != len(full):
            raise TinkerServiceError(f"{what}: Tinker returned {len(values)} logprobs for a {len(full)}-token sequence")
        tail = values[len(values) - n :] if n else []
        if any(v is None for v in tail):
            raise TinkerServiceError(f"{what}: Tinker returned no logprob at some target positions")
        out.append([float(v) for v in tail])
    return out


def topk_batch(session: Session, get_client: Callable[[], Any], batch: Batch, k: int) -> list[Any]:
    """Top-``k`` next-token logprobs at every target position of each row (Tinker's top-k prompt
    logprobs of a one-token sample): ``(values, ids)`` of shape ``(T_i, k)``, descending, padded
    with ``-inf`` / id 0 where the service gave fewer."""
    client = get_client()
    types = session.tinker.types
    params = types.SamplingParams(max_tokens=1)

    def submit(tokens: list[int]) -> Any:
        return client.sample(
            prompt=types.ModelInput.from_ints(tokens),
            num_samples=1,
            sampling_params=params,
            include_prompt_logprobs=True,
            topk_prompt_logprobs=k,
        )

    fulls = [list(d.input_tokens) + [int(d.target_tokens[-1])] for d in batch.data]
    futures = [session.try_submit(submit, f) for f in fulls]
    out = []
    for d, full, fut in zip(batch.data, fulls, futures):
        response = session.result_with_retry("distributions", fut, partial(submit, full))
        rows = list(response.topk_prompt_logprobs or [])
        if len(rows) != len(full):
            raise TinkerServiceError(
                f"distributions: Tinker returned top-k logprobs for {len(rows)} of {len(full)} positions"
            )
        values = torch.full((len(d.target_tokens), k), float("-inf"))
        ids = torch.zeros((len(d.target_tokens), k), dtype=torch.long)
        for t, entries in enumerate(rows[1:]):  # position t + 1 predicts target t
            ranked = sorted(entries or [], key=lambda e: -e[1])[:k]
            for j, (tok, lp) in enumerate(ranked):
                values[t, j], ids[t, j] = float(lp), int(tok)
        out.append((values, ids))
    return out


def tensor_list(value: Any) -> list[float]:
    """A ``TensorData`` / tensor / list the SDK returns, as floats."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return [float(x) for x in value]


def np_array(values: Sequence[Any], dtype: str) -> Any:
    import numpy as np

    return np.asarray(list(values), dtype=dtype)
