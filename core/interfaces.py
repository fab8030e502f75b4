"""The component interfaces. A plugin implements one of these and registers a factory for it.

They are :class:`typing.Protocol` classes, so a component needs no base class: any object with
the right methods fits. Factories are called with the component's config keys as keyword
arguments (see :mod:`tempering.registry`), which is why none of these define ``__init__``.

Besides the kinds: the backend *capabilities* (what only some backends can do, checked with
:func:`supports`; a stage declares those it needs, see :class:`tempering.training.stage.Stage`) and the
typed ``ctx`` stages receive (:class:`BuildContext`, :class:`RunContext`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tempering.types import AdamParams, Batch, Completion, Sample, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tempering.registry import Registry


# --------------------------------------------------------------------------- tokenizer
@runtime_checkable
class Tokenizer(Protocol):
    """The calls tempering makes on a tokenizer: what a Hugging Face ``transformers`` tokenizer
    offers (the tiny models' character tokenizer is one), and what
    :class:`tempering.plugins.models.qwen3.TmlTokenizer` implements for tml-renderers' bundled
    tokenizers. Typed by what is called, loosely where Hugging Face's own signatures are (a
    text or a batch of them in, ids or a ``BatchEncoding`` out; positional-only where its
    parameter names differ), so that every component that takes a tokenizer says so instead
    of taking ``Any``."""

    @property
    def eos_token_id(self) -> Any: ...  # int, or None before a model sets one

    @property
    def pad_token_id(self) -> Any: ...

    @property
    def bos_token_id(self) -> Any: ...

    def __call__(
        self, text: str | list[str], /, *, add_special_tokens: bool = True, split_special_tokens: bool = False
    ) -> Any:
        """``{"input_ids": ..., "attention_mask": ...}`` of a text (or a list of texts)."""
        ...

    def decode(self, ids: list[int], /, *, skip_special_tokens: bool = False) -> Any: ...

    def encode(self, text: str, /, *, add_special_tokens: bool = True) -> list[int]: ...

    def batch_decode(self, sequences: list[list[int]], /, *, skip_special_tokens: bool = False) -> list[str]: ...

    def convert_tokens_to_ids(self, tokens: str | list[str], /) -> Any: ...

    def save_pretrained(self, path: str, /) -> Any: ...

    def __len__(self) -> int: ...


@runtime_checkable
class ChatTemplateTokenizer(Tokenizer, Protocol):
    """A tokenizer with a Hugging Face chat template (``apply_chat_template``): what chat-format
    datasets and the ChatML check need; narrowed to with ``isinstance``."""

    @property
    def chat_template(self) -> Any: ...

    def apply_chat_template(self, conversation: list[dict[str, Any]], /, **kwargs: Any) -> Any: ...


@runtime_checkable
class VocabTokenizer(Tokenizer, Protocol):
    """A tokenizer that lists its vocabulary (``get_vocab``): the character-level tiny models'."""

    def get_vocab(self) -> dict[str, int]: ...


# --------------------------------------------------------------------------- backend
@runtime_checkable
class Backend(Protocol):
    """Tinker-like training primitives, the part every backend has. Every call returns a future
    so that a loop can submit ``forward_backward`` and ``optim_step`` back to back, and sample
    while it trains.

    ``step`` is the number of optimizer steps taken: samplers stamp it on completions as
    ``policy_version`` so staleness can be measured.

    What only some backends can do is a *capability*, a protocol of its own below
    (:class:`WeightSnapshots`, :class:`EmaWeights`, :class:`SamplingClients`,
    :class:`Distributions`, :class:`FullDistributions`, :class:`LossOnTrainingForward`, :class:`LossLogits`,
    :class:`Exportable`, :class:`DownloadableWeights`, :class:`Closeable`). A stage declares the
    ones it needs (:attr:`tempering.training.stage.Stage.requires`) and they are checked, with
    :func:`supports`, once at validation, before anything trains.
    """

    tokenizer: Tokenizer
    step: int

    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]:
        """``num_samples`` completions for each prompt, with per-token sampler logprobs."""
        ...

    def logprobs(self, batch: Batch, reference: bool = False) -> Future[list[list[float]]]:
        """Per-target-token logprobs of each row (forward only). ``reference=True`` scores
        with the reference policy (LoRA adapter disabled, or a frozen copy)."""
        ...

    def forward_backward(self, batch: Batch, loss: Loss) -> Future[dict[str, float]]:
        """Accumulate gradients of ``loss`` over ``batch``; returns the loss's metrics."""
        ...

    def optim_step(self, params: AdamParams) -> Future[dict[str, float]]:
        """Apply (and clear) the accumulated gradients."""
        ...

    def save(self, path: str, extra: Mapping[str, Any] | None = None) -> str:
        """Save weights, optimizer state and ``extra`` (loop position, RNG) under ``path``."""
        ...

    def load(self, path: str) -> dict[str, Any]:
        """Restore what :meth:`save` wrote; returns its ``extra``."""
        ...


# Capabilities: each holds methods only (Python 3.11 checks such a protocol against the class,
# without touching the instance), and is checked with :func:`supports`.
@runtime_checkable
class WeightSnapshots(Protocol):
    """Named frozen copies of the weights: ``snapshot(name)`` keeps the current weights,
    ``logprobs(batch, weights=name)`` scores with them (GRPO's and DPO's stage-start
    reference, SDFT's teacher). Snapshots are saved in checkpoints, so a resumed stage finds
    its own (``snapshot_names``); ``drop_snapshot`` forgets one (no error if absent)."""

    def snapshot(self, name: str) -> Future[None]: ...
    def drop_snapshot(self, name: str) -> Future[None]: ...
    def snapshot_names(self) -> list[str]: ...
    def logprobs(
        self, batch: Batch, reference: bool = False, weights: str | None = None
    ) -> Future[list[list[float]]]: ...


@runtime_checkable
class EmaWeights(WeightSnapshots, Protocol):
    """A snapshot that moves towards the policy: ``snapshot[name] = (1 - rate) snapshot[name] +
    rate policy`` (SDFT's EMA teacher)."""

    def ema_update(self, name: str, rate: float) -> Future[None]: ...


@runtime_checkable
class SamplingClients(Protocol):
    """``sampling_client()``: a future of a sampler of the current weights, frozen, that samples
    while the trainer trains (asynchronous RL). Without it a stage samples the live weights."""

    def sampling_client(self) -> Future[SamplingClient]: ...


@runtime_checkable
class Distributions(Protocol):
    """Next-token distributions at every target position (logit distillation): with ``topk=K``
    one ``(values, ids)`` pair of ``(T_i, K)`` tensors per row."""

    def distributions(
        self, batch: Batch, reference: bool = False, weights: str | None = None, topk: int | None = None
    ) -> Future[list[Any]]: ...


@runtime_checkable
class FullDistributions(Distributions, Protocol):
    """:class:`Distributions` also without ``topk``: one ``(T_i, V)`` tensor of log-probabilities
    over the whole vocabulary per row."""


@runtime_checkable
class LossOnTrainingForward(Protocol):
    """``forward_backward`` calls the loss on the backend's own training forward, so an
    on-policy stage can take the ratio's "old" logprobs from it, detached, instead of paying a
    second forward pass (GRPO's ``recompute_logprobs: auto``). A backend declares it with the
    class attribute ``LOSS_SEES_TRAINING_FORWARD = True``."""

    LOSS_SEES_TRAINING_FORWARD: bool


@runtime_checkable
class LossLogits(Protocol):
    """``forward_backward`` hands a ``needs_logits`` loss the model's logits (``batch["logits"]``),
    as the local backend does. A backend whose service returns per-token logprobs only (Tinker)
    declares ``capabilities = {"logits": False}``, so a stage whose loss needs logits (SDPO's
    logit modes) is refused at validation instead of failing at its first step."""

    def forward_backward(self, batch: Batch, loss: Loss) -> Future[dict[str, float]]: ...


@runtime_checkable
class Exportable(Protocol):
    """``export_pretrained(path, adapter)``: the policy in Hugging Face format, in this process."""

    def export_pretrained(self, path: str, adapter: bool = False) -> str: ...


@runtime_checkable
class DownloadableWeights(Protocol):
    """``download_weights(dest, state)``: the trained weights fetched from a service into ``dest``."""

    def download_weights(self, dest: str, state: str | None = None) -> str: ...


@runtime_checkable
class Closeable(Protocol):
    """``close()``: finish queued calls and release threads or remote sessions."""

    def close(self) -> None: ...


@runtime_checkable
class DeclaresRenderer(Protocol):
    """``model_renderer``: the chat format the model declares (its builder's
    :attr:`LoadedModel.renderer`: ``chatml`` for SmolLM2, ``tiny_chat`` for a tiny chat model),
    what a stage's ``renderer: auto`` picks; None when the model declares none. Data on the
    backend, so no component has to read it off a tokenizer."""

    model_renderer: str | None


def model_renderer(backend: object) -> str | None:
    """The renderer ``backend``'s model declares (:class:`DeclaresRenderer`), or None."""
    return backend.model_renderer if isinstance(backend, DeclaresRenderer) else None


#: Every capability protocol, by the name a backend's ``capabilities`` mapping uses.
CAPABILITIES: dict[str, type] = {
    "weight_snapshots": WeightSnapshots,
    "ema_update": EmaWeights,
    "sampling_clients": SamplingClients,
    "distributions": Distributions,
    "full_distributions": FullDistributions,
    "loss_on_training_forward": LossOnTrainingForward,
    "logits": LossLogits,
    "export": Exportable,
    "download_weights": DownloadableWeights,
    "close": Closeable,
}


def capability_name(capability: type) -> str:
    """The name of a capability protocol in :data:`CAPABILITIES` (its class name otherwise)."""
    return next((name for name, cls in CAPABILITIES.items() if cls is capability), capability.__name__)


def supports(backend: object, capability: type) -> bool:
    """Whether ``backend`` has ``capability`` (a protocol of this module).

    It has it when it fits the protocol -- and, since methods alone cannot tell a top-k from a
    full distribution, nor a method that is there only to raise a clear error from a working
    one, when its optional ``capabilities`` mapping does not set the capability's name to
    False (Tinker's ``{"ema_update": False, "full_distributions": False}``), and, for
    :class:`LossOnTrainingForward`, when its flag is true."""
    if not isinstance(backend, capability):
        return False
    if capability is LossOnTrainingForward and not getattr(backend, "LOSS_SEES_TRAINING_FORWARD", False):
        return False
    declared = getattr(backend, "capabilities", None)
    return not (isinstance(declared, Mapping) and declared.get(capability_name(capability), True) is False)


# --------------------------------------------------------------------------- models
@dataclass(frozen=True)
class LoadedModel:
    """What a model builder (the ``model`` kind) returns: the model, its tokenizer, and the
    renderer (chat format) the model declares, if any, for ``renderer: auto``.

    It unpacks and indexes as ``(model, tokenizer)`` (the older builder result, which a builder
    may still return: then it declares no renderer), so ``model, tok = tiny_llama()`` and
    ``tiny_llama()[0]`` read as before."""

    model: Any
    tokenizer: Tokenizer
    renderer: str | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer))

    def __getitem__(self, index: int) -> Any:
        """``[0]`` the model, ``[1]`` the tokenizer, as the pair it stands for."""
        return (self.model, self.tokenizer)[index]

    @classmethod
    def of(cls, built: LoadedModel | tuple[Any, Any]) -> LoadedModel:
        """A builder's result as a :class:`LoadedModel` (a ``(model, tokenizer)`` pair declares no renderer)."""
        if isinstance(built, LoadedModel):
            return built
        model, tokenizer = built
        return cls(model, tokenizer)


# --------------------------------------------------------------------------- rewards
@dataclass
class RewardResult:
    """What a reward returns when a bare float is not enough: ``info`` (diagnostics, logged
    with the sample) and ``feedback`` (words about the attempt, see ``Sample.feedback``)."""

    reward: float
    info: dict[str, Any] = field(default_factory=dict)
    feedback: str | None = None


@runtime_checkable
class Reward(Protocol):
    """Scores one completion of one example. May be sync or ``async def``; may return a float
    or a :class:`RewardResult`. A reward that raises, times out or returns NaN is recorded as a
    failure by the runner, never crashes the run."""

    def __call__(
        self, completion: str, example: Mapping[str, Any]
    ) -> float | RewardResult | Awaitable[float | RewardResult]: ...


@runtime_checkable
class SamplingClient(Protocol):
    """What samples token prompts: a backend, or a sampling client of a weight snapshot
    (:class:`SamplingClients`). Completions carry ``policy_version``."""

    def sample(
        self, prompts: list[list[int]], num_samples: int, params: SamplingParams
    ) -> Future[list[list[Completion]]]: ...


@runtime_checkable
class Policy(Protocol):
    """The weights that sampled a batch, as a reward may sample them again: examples in (rows
    with ``prompt`` text or ``messages``), completions out, encoded, stopped and parsed exactly
    as the batch's own samples were (``Completion.text`` is what a reward sees). ``params``
    ``None`` samples as the batch was sampled (its temperature, ``max_tokens``, stops).

    The rollout sampler makes one per batch and hands it to the reward runner with the samples
    (:meth:`tempering.rollouts.scoring.RewardRunner.ascore`): a reward never fetches the policy
    from anywhere else, so what it samples is always the weights that sampled what it scores
    (the live weights on-policy, the snapshot off-policy)."""

    async def complete(
        self, examples: Sequence[Mapping[str, Any]], num_samples: int, params: SamplingParams | None = None
    ) -> list[list[Completion]]: ...


@dataclass
class BatchScores:
    """What a :class:`PolicyReward` returns for a batch: one result per sample, in order (a
    number, a :class:`RewardResult`, or the exception that failed that sample alone), and the
    batch's own metrics, logged with the step (``monitor/accuracy``)."""

    results: list[float | RewardResult | BaseException]
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class PolicyReward(Protocol):
    """An optional reward capability: a reward that samples the policy being trained while it
    scores (the ``monitor`` reward samples it on counterfactual prompts). It scores a whole
    batch at once, given the batch's :class:`Policy`, so it can sample every sample's extra
    prompts in one call. The reward runner calls it instead of ``__call__`` (a ``__call__``
    it still has is for callers without a policy, and should raise saying so); a caller that
    has no policy to give (a sampler that does not pass one, ``serve-reward``) gets each
    sample failed with the cause ``no_policy``, counted, never a silent 0. The stage's
    ``reward_timeout`` bounds the whole batch's call."""

    async def score_batch(self, samples: Sequence[Sample], policy: Policy) -> BatchScores: ...


# --------------------------------------------------------------------------- advantages
@runtime_checkable
class AdvantageEstimator(Protocol):
    """Maps rewards to advantages. Pure: ``rewards[i]`` belongs to group ``group_ids[i]``."""

    def __call__(self, rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor: ...


# --------------------------------------------------------------------------- losses
@dataclass
class LossOutput:
    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Loss(Protocol):
    """A pure function of the model's per-token logprobs (``(B, T)``) and the padded batch
    (:meth:`tempering.types.Batch.to_tensors`). That call is the whole requirement: a plain
    class with ``__call__`` is a Loss.

    Positions: a backend may compute logprobs only at the target positions where some row has
    a non-zero ``batch["weights"]`` (the local one does: the LM head never runs on prompts);
    elsewhere ``logprobs`` holds 0 and has no gradient, so a loss reads only what its mask
    keeps (every built-in masks with ``weights != 0``).

    What a loss may add is optional, a protocol each in :mod:`tempering.loss_contract`, read
    through its functions (as :func:`supports` reads a backend's capabilities): ``reads`` (the
    batch inputs it requires), ``needs_logits`` (:class:`~tempering.loss_contract.LogitsLoss`:
    it reads ``batch["logits"]``, the logits at every target position, ``(B, T, V)``, or --
    when ``batch["logit_positions"]`` is present -- at those ``K`` positions only,
    ``(B, K, V)``; :func:`at_positions` and :func:`from_positions` convert), ``needs_all_positions``,
    ``for_stage`` (what its stage knows), and ``tinker_builtin`` / ``builtin(batch)`` (the
    Tinker built-in loss that computes exactly this, which the Tinker backend then runs
    instead of a custom-loss forward).
    """

    def __call__(self, logprobs: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> LossOutput: ...


def at_positions(tensor: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
    """The columns ``positions`` of a ``(B, T, ...)`` batch tensor (``batch.get("logit_positions")``
    for the columns ``batch["logits"]`` covers); ``tensor`` itself for ``None``."""
    return tensor if positions is None else tensor[:, positions]


def from_positions(values: torch.Tensor, positions: torch.Tensor | None, width: int, fill: Any = 0) -> torch.Tensor:
    """The inverse of :func:`at_positions`: ``(B, K, ...)`` values placed at ``positions`` of a
    ``(B, width, ...)`` tensor holding ``fill`` elsewhere (differentiable in ``values``)."""
    if positions is None:
        return values
    out = values.new_full((values.shape[0], width, *values.shape[2:]), fill)
    return out.index_copy(1, positions, values)


# --------------------------------------------------------------------------- samplers
@runtime_checkable
class Sampler(Protocol):
    """Turns a batch of examples into groups of scored samples (see :mod:`tempering.rollouts.rollout`).

    ``client`` is what to sample with: the backend, or a sampling client of a weight snapshot
    (``sample(prompts, n, params) -> Future``; completions carry ``policy_version``). The
    groups come back in the order of ``examples`` with ``group_id = first_id + i``. Built with
    its config keys and ``context`` (a :class:`tempering.rollouts.rollout.SamplerContext`).
    """

    async def sample(
        self,
        client: SamplingClient,
        examples: list[dict[str, Any]],
        group_size: int,
        params: SamplingParams,
        first_id: int = 0,
    ) -> Any: ...


# --------------------------------------------------------------------------- the rest
@runtime_checkable
class Logger(Protocol):
    """Receives metrics per step; ``close`` writes what needs the whole run (a plot)."""

    def log(self, metrics: Mapping[str, Any], step: int) -> None: ...
    def close(self) -> None: ...


# --------------------------------------------------------------------------- the run context
@runtime_checkable
class BuildContext(Protocol):
    """What building a stage's components needs (datasets, samplers, renderers, rewards): the
    registry, the backend (its tokenizer), and the registry's builders with the stage's key
    path (``path``, e.g. ``stages[1]``) put in front of ``key`` for error messages. A
    :class:`RunContext` is one; so is the ``tempering eval`` command's context."""

    registry: Registry
    backend: Backend

    @property
    def path(self) -> str:
        """The config path keys are under (``stages[1]``), for error messages."""
        ...

    def build(self, kind: str, spec: object, key: str, **context: object) -> Any:
        """Build a component of ``kind`` from ``spec``, the stage's ``key``."""
        ...

    def factory(self, kind: str, spec: object, key: str, **context: object) -> Any:
        """A callable building a new component per call."""
        ...

    def check(self, kind: str, spec: object, key: str, context: Iterable[str] = ()) -> None:
        """Check a component spec (name, keys) without building it."""
        ...


@runtime_checkable
class RunContext(BuildContext, Protocol):
    """What a stage's ``validate``, ``setup``, ``train_step`` and ``teardown`` receive as ``ctx``
    (:class:`tempering.training.recipe.RunContext` implements it): a :class:`BuildContext` plus the
    recipe's config, seed and output folder, where the run is (``stage_index``, ``stage_id``,
    ``global_step``), what a resumed stage restores (``resume_state``, empty on a fresh start)
    and the loop's calls (``log``, ``budget_left``, ``end_step``), which :meth:`Stage.run
    <tempering.training.stage.Stage.run>` makes. ``backend`` is ``None`` only while a recipe's config is
    checked before its backend is built."""

    config: dict[str, Any]
    output_dir: str
    seed: int
    stage_index: int
    stage_id: str
    global_step: int
    resume_state: dict[str, Any] | None

    def log(self, metrics: Mapping[str, Any]) -> None:
        """Log one row of the current stage."""
        ...

    def budget_left(self) -> bool:
        """False once the run's step budget is spent."""
        ...

    def end_step(self, state: Mapping[str, Any]) -> None:
        """Count an optimizer step; ``state`` is what a checkpoint of it must hold."""
        ...
