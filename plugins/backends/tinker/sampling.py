"""Sampling on Tinker: our ``SamplingParams`` in the SDK's terms, one request per prompt (all in
flight at once, each retried), and the SDK's sequences back as our :class:`Completion`.

Stops are always explicit (the caller's stop strings, else its stop ids plus every EOS id),
never the service's implicit stop, which for a base model can differ from the tokenizer's EOS.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from types import ModuleType
from typing import Any

from tempering.plugins.backends.tinker.errors import TinkerServiceError
from tempering.plugins.backends.tinker.scoring import score_rows
from tempering.plugins.backends.tinker.session import Session
from tempering.types import Completion, SamplingParams

#: ``sample(prompts, num_samples, params)`` of one sampler, as the backend's ``sample`` has it.
SampleFn = Callable[[list[list[int]], int, SamplingParams], "Future[list[list[Completion]]]"]


def sampling_params(types: ModuleType, params: SamplingParams, eos_ids: list[int]) -> Any:
    """Ours -> ``tinker.types.SamplingParams``. Stops are always explicit: stop strings as
    given, else the stop ids given (a renderer's) plus every EOS id, so a completion ends where
    it would on the local backend whatever the service's implicit stop for the model is
    (``None``) -- and never ``[]``, which disables EOS. ``top_k=0`` -> -1."""
    items: list[str | int] = [params.stop] if isinstance(params.stop, (str, int)) else list(params.stop or [])
    strings = [s for s in items if isinstance(s, str)]
    ids = [int(s) for s in items if not isinstance(s, str)]
    if strings and ids:
        raise ValueError("SamplingParams.stop: Tinker takes stop strings or stop token ids, not both")
    if any(s == "" for s in strings):
        raise ValueError("SamplingParams.stop: empty stop string")
    stop: list[Any] = strings if strings else ids + [e for e in eos_ids if e not in ids]
    return types.SamplingParams(
        max_tokens=int(params.max_tokens),
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k) if params.top_k and params.top_k > 0 else -1,
        stop=stop,
        seed=params.seed,
    )


def checked_prompts(prompts: list[list[int]], num_samples: int) -> list[list[int]]:
    """The prompts as lists, or a ``ValueError`` naming what cannot be sampled."""
    prompts = [list(p) for p in prompts]
    if num_samples < 1:
        raise ValueError(f"sample: num_samples must be >= 1, got {num_samples}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"sample: prompt {i} is empty; encode it with a BOS token or some text")
    return prompts


def empty_completions(
    prompts: list[list[int]], num_samples: int, params: SamplingParams, version: int
) -> Future[list[list[Completion]]]:
    """``max_tokens <= 0``: nothing to ask the service; every completion is empty."""
    done: Future[list[list[Completion]]] = Future()
    done.set_result(
        [
            [Completion(p, [], [], "length", "", version, params.temperature) for _ in range(num_samples)]
            for p in prompts
        ]
    )
    return done


def sample_prompts(
    session: Session,
    client: Any,
    prompts: list[list[int]],
    n: int,
    params: SamplingParams,
    tinker_params: Any,
    version: int,
    decode: Callable[[list[int]], str],
) -> list[list[Completion]]:
    """``n`` completions of each prompt from ``client`` (requests all in flight, each retried)."""
    types = session.tinker.types

    def submit(p: list[int]) -> Any:
        return client.sample(prompt=types.ModelInput.from_ints(p), num_samples=n, sampling_params=tinker_params)

    futures = [session.try_submit(submit, p) for p in prompts]
    out = []
    for p, fut in zip(prompts, futures):
        response = session.result_with_retry("sample", fut, partial(submit, p))
        seqs = list(response.sequences)
        if len(seqs) != n:
            raise TinkerServiceError(f"sample: asked for {n} samples of a prompt, Tinker returned {len(seqs)}")
        out.append([completion(session, client, p, s, params, version, decode) for s in seqs])
    return out


def completion(
    session: Session,
    client: object,
    prompt: list[int],
    seq: Any,
    params: SamplingParams,
    version: int,
    decode: Callable[[list[int]], str],
) -> Completion:
    """One SDK sequence as a :class:`Completion`: logprobs scored by the same sampler when the
    service returned none, text cut at the first stop string."""
    tokens = [int(t) for t in seq.tokens]
    lps = seq.logprobs
    if lps is None:  # not returned: score the completion with the same sampler
        lps = (
            score_rows(session, lambda: client, [prompt + tokens], [len(tokens)], "sample logprobs")[0]
            if tokens
            else []
        )
    lps = [float(x) for x in lps]
    if len(lps) != len(tokens):
        raise TinkerServiceError(f"sample: Tinker returned {len(lps)} logprobs for {len(tokens)} tokens")
    text = decode(tokens)
    stops = (
        [s for s in (params.stop or []) if isinstance(s, str)] if not isinstance(params.stop, str) else [params.stop]
    )
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        text = text[: min(hits)]
    reason = "stop" if str(seq.stop_reason) == "stop" else "length"
    return Completion(list(prompt), tokens, lps, reason, text, version, params.temperature)


class TinkerSamplingClient:
    """A sampler of one weight snapshot (see ``TinkerBackend.sampling_client``); ``sample`` has
    the backend's signature and conventions, ``policy_version`` is the snapshot's step (for an
    ``inflight`` client, the step of the weights it was created with: samples use those or
    newer)."""

    def __init__(self, sample: SampleFn, tokenizer: Callable[[], Any], policy_version: int) -> None:
        self._sample = sample
        self._tokenizer = tokenizer
        self.policy_version = int(policy_version)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer()

    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        return self._sample(prompts, num_samples, params)

    def __repr__(self) -> str:
        return f"TinkerSamplingClient(policy_version={self.policy_version})"
