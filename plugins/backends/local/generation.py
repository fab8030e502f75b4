"""Sampling with transformers' ``generate`` for the local backend, and the second model copy and
thread behind its sampling clients (the vLLM engine, :mod:`~tempering.plugins.backends.local.vllm_engine`,
is the other way to generate).

What ``generate`` is made to do here, and why:

* logprobs are recorded from the final sampling scores (:class:`_SampledLogprobs`, last in the
  processor list, after our own temperature/top-k/top-p warpers; HF's are switched off), so they
  are those of the distribution actually sampled from;
* the model's generation config is neutral (only special ids), so a checkpoint's sampling
  defaults never leak in;
* stop strings match the completion only, never across the prompt boundary (:class:`_StopStrings`);
* ``params.seed`` samples from a private RNG; without it the global stream (which checkpoints
  save) is used;
* shared prompt work is done once (:func:`_prefill_once`): a prompt repeated in one call (a
  group's ``num_samples`` completions, a group's episodes) is prefilled once and its KV cache
  copied to its rows, and a long beginning all of a call's prompts share (a system turn with tool
  specs) is run once and placed in every row's cache: the same logits, a fraction of the work.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tempering.interfaces import Tokenizer
from tempering.plugins.backends.common import run_on
from tempering.plugins.backends.local.stops import before_first, split_stop
from tempering.types import Completion, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from tempering.plugins.backends.local.backend import LocalBackend

T = TypeVar("T")


def completion(
    prompt: list[int],
    toks: list[int],
    lps: list[float],
    reason: str,
    text: str,
    params: SamplingParams,
    version: int,
) -> Completion:
    """One sampled sequence as the backend returns it (both generation engines build these)."""
    return Completion(
        prompt_tokens=list(prompt),
        tokens=toks,
        logprobs=lps,
        stop_reason=reason,
        text=text,
        policy_version=version,
        temperature=params.temperature,
    )


def check_request(prompts: list[list[int]], num_samples: int) -> None:
    """Refuse a request no engine can serve: no samples, or an empty prompt."""
    if num_samples < 1:
        raise ValueError(f"sample: num_samples must be >= 1, got {num_samples}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"sample: prompt {i} is empty; encode it with a BOS token or some text")


class Generator:
    """``num_samples`` completions per prompt with ``model.generate``, ``batch_size`` sequences
    per call (bounding KV-cache memory); ``prefill_once``: a prompt repeated in a call is
    prefilled once (see :func:`_prefill_once`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        pad_token_id: int,
        eos_token_ids: set[int],
        device: torch.device,
        batch_size: int,
        prefill_once: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.batch_size = batch_size
        self.prefill_once = prefill_once

    def sample(
        self, model: torch.nn.Module, prompts: list[list[int]], num_samples: int, params: SamplingParams, version: int
    ) -> list[list[Completion]]:
        """Completions grouped per prompt, in order, each stamped with ``version``."""
        rows = [p for p in prompts for _ in range(num_samples)]
        completions: list[Completion] = []
        model.eval()
        with _seeded(params.seed, self.device), torch.no_grad():
            for start in range(0, len(rows), self.batch_size):
                completions += self._generate(rows[start : start + self.batch_size], params, model, version)
        return [completions[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]

    def _generate(self, rows: list[list[int]], params: SamplingParams, model: Any, version: int) -> list[Completion]:
        """One left-padded ``generate`` call; logprobs recorded from the final sampling scores."""
        stop_strings, stop_ids = split_stop(params.stop)
        eos = sorted(self.eos_token_ids | set(stop_ids))
        if params.max_tokens <= 0:
            return [completion(r, [], [], "length", "", params, version) for r in rows]
        input_ids, attention_mask = _left_pad(rows, self.pad_token_id, self.device)
        width = input_ids.shape[1]
        recorder = _SampledLogprobs()
        processors = LogitsProcessorList([*_warpers(params), recorder])
        stopper = _StopStrings(self.tokenizer, stop_strings, width, len(rows)) if stop_strings else None
        cache = _prefill_once(model, rows, input_ids, attention_mask) if self.prefill_once else None
        sequences = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            **({_CACHE_KEY: cache} if cache is not None else {}),
            generation_config=self._generation_config(params, eos),
            logits_processor=processors,
            stopping_criteria=StoppingCriteriaList([stopper] if stopper else []),
        )
        new_tokens = sequences[:, width:]
        logprobs = recorder.result(new_tokens)
        out = []
        for i, row in enumerate(rows):
            toks, lps = new_tokens[i].tolist(), logprobs[i].tolist()
            end, by_string = _cut_point(toks, set(eos), stopper.done_at[i] if stopper else None)
            if end is not None:
                toks, lps = toks[:end], lps[:end]
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
            if by_string:
                text = before_first(text, stop_strings)
            out.append(completion(row, toks, lps, "stop" if end is not None else "length", text, params, version))
        return out

    def _generation_config(self, params: SamplingParams, eos: list[int]) -> GenerationConfig:
        """Neutral sampling settings: temperature/top-k/top-p are applied by our own warpers
        (see :func:`_warpers`) so the logprob recorder sees exactly the final distribution."""
        sampling = params.temperature > 0
        extra = {"temperature": 1.0, "top_k": 0, "top_p": 1.0} if sampling else {}
        return GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=sampling,
            pad_token_id=self.pad_token_id,
            eos_token_id=eos,
            use_cache=True,
            **extra,
        )


# ---------------------------------------------------------------------- sampling clients
class LocalSamplingClient:
    """A sampler of one frozen weight snapshot (see :meth:`LocalBackend.sampling_client`).

    ``sample`` has the backend's signature and conventions; completions carry
    ``policy_version``, the optimizer step the snapshot was taken at. Holding a client keeps
    its snapshot (a copy of the trainable weights) alive; drop old clients to free them.
    """

    def __init__(self, backend: LocalBackend, weights: dict[str, torch.Tensor], policy_version: int) -> None:
        self._backend = backend
        self.weights = weights
        self.policy_version = int(policy_version)
        self.tokenizer = backend.tokenizer

    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        return self._backend._submit_sampler(
            self._backend._sample_snapshot, self, [list(p) for p in prompts], num_samples, params
        )

    def __repr__(self) -> str:
        return f"LocalSamplingClient(policy_version={self.policy_version})"


class SamplerCopy:
    """The sampling clients' engine: a second copy of the policy (made on first use; with LoRA
    only the adapter differs between snapshots) and a second thread, so sampling never waits
    for, or touches, the training weights. Unthreaded, calls run inline."""

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self.model: Any = None
        self.loaded: LocalSamplingClient | None = None
        self.executor: ThreadPoolExecutor | None = None

    def prepare(self, policy: object, copy_model: bool) -> None:
        """On the training thread: copy ``policy`` (unless ``copy_model`` is false: a vLLM engine
        holds its own copy) and start the sampling thread, each once."""
        if self.model is None and copy_model:
            self.model = copy.deepcopy(policy)
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.model.eval()
        if self.threaded and self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="tempering-sampler")

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn`` on the sampling thread (FIFO), or inline when unthreaded."""
        return run_on(self.executor, fn, *args)

    def holding(self, client: LocalSamplingClient) -> Any:
        """On the sampling thread: the model copy with ``client``'s weights (loaded unless they
        are loaded already)."""
        if self.loaded is not client:
            params_by_name = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in client.weights.items():
                    params_by_name[name].copy_(tensor)
            self.loaded = client
        return self.model

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None


# ---------------------------------------------------------------------- generate plumbing
class _SampledLogprobs(LogitsProcessor):
    """Records the log-probability of each sampled token under the final scores.

    Runs last in the processor list (after our temperature/top-k/top-p warpers, which HF's
    own are switched off for), so what it sees is the distribution the token is drawn from.
    The token drawn at step t is only known at step t+1 (it is then ``input_ids[:, -1]``), so
    one step's log-softmax is kept: memory stays O(batch x vocab), unlike ``output_scores``.
    """

    def __init__(self) -> None:
        self.columns: list[torch.Tensor] = []
        self._pending: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self._pending is not None:
            self.columns.append(self._pending.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def result(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """``(B, n)`` logprobs of ``new_tokens`` (``generate`` may have undone extra steps)."""
        n = new_tokens.shape[1]
        cols = self.columns[:n]
        if len(cols) < n and self._pending is not None:
            cols.append(self._pending.gather(-1, new_tokens[:, len(cols) : len(cols) + 1]).squeeze(-1))
        if not cols:
            return torch.zeros(new_tokens.shape, dtype=torch.float32)
        return torch.stack(cols, dim=1).cpu()


class _StopStrings(StoppingCriteria):
    """Stops a row when its *completion* (never the prompt) contains a stop string.

    HF's ``stop_strings`` also match across the prompt boundary; this one decodes only a
    trailing window of generated tokens each step and records when each row stopped, which is
    where the completion is cut afterwards.
    """

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], prompt_width: int, batch_size: int) -> None:
        self.tokenizer = tokenizer
        self.stops = list(stops)
        self.prompt_width = prompt_width
        self.window = 4 * max(len(s) for s in self.stops) + 4  # a character may take up to 4 byte-tokens
        self.done_at: list[int | None] = [None] * batch_size

    def __call__(self, input_ids: torch.LongTensor, scores: object, **kwargs: object) -> torch.BoolTensor:
        generated = input_ids[:, self.prompt_width :]
        n = generated.shape[1]
        open_rows = [i for i, d in enumerate(self.done_at) if d is None]
        if open_rows and n:
            tails = generated[open_rows, -self.window :].tolist()
            texts = self.tokenizer.batch_decode(tails, skip_special_tokens=True)
            for i, text in zip(open_rows, texts):
                if any(s in text for s in self.stops):
                    self.done_at[i] = n
        done = [d is not None for d in self.done_at]
        # transformers annotates stopping criteria with torch.BoolTensor, a legacy tensor type
        # that no torch function returns; its own criteria return a bool-dtype Tensor, as here
        return cast(torch.BoolTensor, torch.tensor(done, dtype=torch.bool, device=input_ids.device))


def _cache_name() -> str:
    """The KV cache's keyword in this transformers (``cache`` from 5.2x, ``past_key_values`` before)."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


_CACHE_KEY = _cache_name()


#: Below this many shared tokens a separate forward for the common prefix costs more than it saves.
MIN_SHARED_PREFIX = 16


def _prefill_once(model: torch.nn.Module, rows: list[list[int]], input_ids: torch.Tensor, mask: torch.Tensor) -> Any:
    """The KV cache of every row's prompt but its last token, with shared work done once; None
    when nothing is shared (or the model cannot take it).

    Two kinds of sharing, both common in RL: a group's G completions share one prompt (each
    distinct prompt is prefilled once and its cache copied to its rows), and the prompts of a
    call share a long beginning -- a system turn with tool specs, an episode's earlier turns --
    (that prefix is run once, on one row, and placed in every row's cache, see
    :func:`_shared_prefix_cache`). ``generate`` then runs only the last prompt token (its cache
    positions continue this cache), so the first sampled token sees the same logits as before
    (up to the float rounding of other batch shapes) and the RNG is drawn exactly as before.
    Not under FSDP, whose lockstep ``generate`` expects every rank to make the same forwards."""
    firsts: dict[tuple[int, ...], int] = {}
    owner = [firsts.setdefault(tuple(r), len(firsts)) for r in rows]
    width = input_ids.shape[1]
    if width < 2 or getattr(model, "_is_fsdp_managed_module", False):
        return None
    unique = [owner.index(i) for i in range(len(firsts))]
    shared = _common_prefix([rows[i] for i in unique])
    if len(unique) == len(rows) and shared < MIN_SHARED_PREFIX:
        return None
    chosen = torch.tensor(unique, device=input_ids.device)
    ids, attention = input_ids[chosen], mask[chosen]
    positions = (attention.cumsum(-1) - 1).clamp(min=0)  # what generate gives left-padded rows
    cache, start = None, 0
    if shared >= MIN_SHARED_PREFIX:
        cache, start = _shared_prefix_cache(model, rows[unique[0]][:shared], attention)
    if start < width - 1:
        kwargs = {_CACHE_KEY: cache} if cache is not None else {}
        out = model(
            input_ids=ids[:, start : width - 1],
            attention_mask=attention[:, : width - 1],
            position_ids=positions[:, start : width - 1],
            use_cache=True,
            **kwargs,
        )
        cache = getattr(out, _CACHE_KEY, None)
    if cache is None or not hasattr(cache, "batch_select_indices"):
        return None
    cache.batch_select_indices(torch.tensor(owner, device=input_ids.device))
    return cache


def _common_prefix(rows: list[list[int]]) -> int:
    """Tokens every row starts with, leaving each row at least its last token (which
    ``generate`` runs itself); 0 for a single row."""
    if len(rows) < 2:
        return 0
    n = min(len(r) for r in rows) - 1
    first = rows[0]
    for i in range(n):
        if any(r[i] != first[i] for r in rows[1:]):
            return i
    return n


def _shared_prefix_cache(model: torch.nn.Module, prefix: list[int], attention: torch.Tensor) -> tuple[Any, int]:
    """A cache of the rows' first ``C`` columns from one forward of the shared ``prefix``, and C.

    Rows are left-padded, so row i's prefix sits at columns ``pad_i ..`` -- but at the same
    positions ``0 ..`` (positions count real tokens), and a prefix token attends only to the
    prefix, so its keys and values are the same in every row. The cache covers the columns
    ``[0, C)``, ``C = min(pad) + len(prefix)``: in every row each of them is padding (zeros,
    masked) or a prefix token (copied). The model computes the rest. Falls back to no prefix
    (C = 0) for cache layers other than plain dynamic ones (sliding windows, hybrids)."""
    device = attention.device
    out = model(
        input_ids=torch.tensor([prefix], device=device),
        position_ids=torch.arange(len(prefix), device=device)[None],
        use_cache=True,
    )
    cache = getattr(out, _CACHE_KEY, None)
    layers = getattr(cache, "layers", None)
    if not layers or any(type(layer).__name__ != "DynamicLayer" for layer in layers):
        return None, 0
    pads = [int(p) for p in (attention == 0).sum(-1).tolist()]
    columns = min(pads) + len(prefix)
    for layer in layers:
        for name in ("keys", "values"):
            one = getattr(layer, name)  # (1, heads, len(prefix), head_dim)
            full = one.new_zeros((len(pads), one.shape[1], columns, one.shape[3]))
            for i, pad in enumerate(pads):
                if columns > pad:
                    full[i, :, pad:columns] = one[0, :, : columns - pad]
            setattr(layer, name, full)
    return cache, columns


def _warpers(params: SamplingParams) -> list[LogitsProcessor]:
    """Temperature, then top-k, then top-p (HF's and vLLM's order); none for greedy."""
    if params.temperature <= 0:
        return []
    out: list[LogitsProcessor] = []
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(float(params.temperature)))
    if params.top_k and params.top_k > 0:
        out.append(TopKLogitsWarper(top_k=int(params.top_k)))
    if params.top_p is not None and params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=float(params.top_p)))
    return out


def _cut_point(tokens: list[int], eos: set[int], string_end: int | None) -> tuple[int | None, bool]:
    """Length to keep (eos / stop token included) and whether a stop *string* ended it."""
    eos_end = next((j + 1 for j, t in enumerate(tokens) if t in eos), None)
    if string_end is not None and (eos_end is None or string_end < eos_end):
        return string_end, True
    return eos_end, False


def _left_pad(rows: list[list[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding so every row's next token is in the last column, as ``generate`` needs."""
    width = max(len(r) for r in rows)
    ids = [[pad_id] * (width - len(r)) + r for r in rows]
    mask = [[0] * (width - len(r)) + [1] * len(r) for r in rows]
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.long, device=device)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device) -> Iterator[None]:
    """Sample from a private RNG seeded with ``seed`` (leaving the global stream alone), or
    from the global stream (which checkpoints save) when ``seed`` is None."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        yield
