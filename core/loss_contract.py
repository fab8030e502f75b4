"""The loss contract: what a loss reads from a batch, what its stage tells it, and which built-in
loss of a backend computes it.

A loss (:class:`tempering.interfaces.Loss`) is a pure function of the policy's per-token
logprobs and the padded batch (:meth:`tempering.types.Batch.to_tensors`). Three parties meet
there -- the stage that prepares the batch, the loss, the backend that runs it -- and what they
agree on is declared here, in types, instead of by convention:

1. **Batch input names.** Every key a loss may read is a constant of this module: a row's own
   fields (:data:`WEIGHTS`, :data:`SAMPLER_LOGPROBS`, :data:`ADVANTAGES`, ...), the values a
   stage's preparation puts in ``Datum.extra`` (:data:`REF_LOGPROBS`, :data:`DPO_SLOT`, the
   teacher's :data:`TEACHER_TOKEN_LOGPROBS` ...) and those the backend adds (:data:`LOGITS`,
   ...). The stage writes ``datum.extra[REF_LOGPROBS]``, the loss reads
   ``batch[REF_LOGPROBS]``: one name, in one place.

2. **What a loss reads**: ``reads`` (a ``frozenset`` of those names, a property when it depends
   on the loss's config) lists the inputs the loss *requires*; inputs it uses only when present
   (GRPO's ``sampler_logprobs``) are not listed. A stage says what its batches hold for a loss
   (:meth:`tempering.training.stage.Stage.batch_inputs`), and :func:`check_reads` compares the two when
   the recipe is validated, before anything trains: ``stages[1].loss: the DPOLoss loss reads
   ref_logprobs, which a 'offpolicy' stage's batches do not hold (...)``. A stage also asks the declaration
   what to prepare: GRPO scores the reference policy at every step exactly when the loss
   reads :data:`REF_LOGPROBS` (:func:`reads_input`), instead of probing ``loss.beta``. A loss
   that declares nothing is not checked.

3. **What the stage tells its loss**: facts a batch does not hold, passed once when the stage
   is set up as a typed :class:`LossSetup` (the sampler's ``max_tokens``: Dr. GRPO's constant
   normaliser). A loss that needs them has ``for_stage(setup) -> loss`` and returns itself or a
   configured copy (:func:`for_stage`); the stage never writes into a loss.

4. **Which built-in computes it**, backend-neutrally. The built-ins are the standard
   sum-over-tokens losses (:data:`BUILTIN_LOSSES`, named as Tinker names them; their formulas
   are :mod:`tempering.rlmath.policy_loss`'s). A loss names the one that computes *exactly*
   it, value and gradient, in one of two ways:

   * statically: ``tinker_builtin = "ppo"`` (``None``: none), with the built-in's config from
     ``tinker_loss_fn_config`` or, for the clipped ones, ``epsilon_low``/``epsilon_high``
     (``1 - low``, ``1 + high``) or ``clip_low_threshold``/``clip_high_threshold`` attributes;
   * per batch, when the answer depends on it: ``builtin(batch) -> BuiltinLoss | NoBuiltin``
     (:class:`DeclaresBuiltin`). GRPO's loss is Tinker's ``ppo`` with its normaliser folded
     into the advantages (:attr:`BuiltinLoss.coefficients`) -- unless its KL term, its
     two-sided clip or the batch's weights make it something no built-in computes, which
     :class:`NoBuiltin` says in words.

   :func:`builtin_of` reads either. A backend with built-in losses (Tinker) sends the batch to
   that built-in instead of running the loss as a custom one; it never imports an algorithm
   or knows a loss's class. A local backend ignores all of this and calls the loss.

A third-party loss, complete::

    @dataclass
    class ClippedPG:
        epsilon: float = 0.2
        reads: ClassVar[frozenset[str]] = frozenset({WEIGHTS, SAMPLER_LOGPROBS, ADVANTAGES})
        tinker_builtin: ClassVar[str | None] = "ppo"  # a sum over tokens, as Tinker's ppo

        @property
        def tinker_loss_fn_config(self) -> dict[str, float]:
            return {"clip_low_threshold": 1 - self.epsilon, "clip_high_threshold": 1 + self.epsilon}

        def __call__(self, logprobs, batch):
            ratio = torch.exp(logprobs - batch[SAMPLER_LOGPROBS])
            return LossOutput(ppo_loss(ratio, batch[ADVANTAGES], batch[WEIGHTS], 1 - self.epsilon, 1 + self.epsilon))

This module imports neither torch nor any plugin or algorithm.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol, runtime_checkable

from tempering.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from tempering.interfaces import Loss
    from tempering.types import Batch

__all__ = [
    "ADVANTAGES",
    "ATTENTION_MASK",
    "BACKEND_INPUTS",
    "BUILTIN_LOSSES",
    "AllPositionsLoss",
    "BuiltinLoss",
    "CLIPPED_BUILTINS",
    "DISTILL_WEIGHTS",
    "DPO_SLOT",
    "DeclaresBuiltin",
    "INPUT_IDS",
    "LOGITS",
    "LOGIT_POSITIONS",
    "LogitsLoss",
    "LossSetup",
    "NUM_ITEMS_IN_BATCH",
    "NamedBuiltinLoss",
    "NoBuiltin",
    "POLICY_BUILTINS",
    "REF_LOGPROBS",
    "ROW_INPUTS",
    "SAMPLER_LOGPROBS",
    "SOFT_TARGET_IDS",
    "SOFT_TARGET_WEIGHTS",
    "StageAwareLoss",
    "SumOverTokensLoss",
    "TARGET_IDS",
    "TEACHER_LOGITS",
    "TEACHER_TOKEN_LOGPROBS",
    "TEACHER_TOPK_IDS",
    "TEACHER_TOPK_LOGPROBS",
    "WEIGHTS",
    "builtin_config",
    "builtin_fn_config",
    "builtin_name",
    "builtin_of",
    "check_reads",
    "for_stage",
    "loss_reads",
    "names_builtin",
    "needs_all_positions",
    "needs_logits",
    "reads_input",
    "sums_over_tokens",
]

# --------------------------------------------------------------------------- batch inputs
# A row's own fields (``Datum``), as Batch.to_tensors names them.
INPUT_IDS: Final = "input_ids"
ATTENTION_MASK: Final = "attention_mask"
TARGET_IDS: Final = "target_ids"
#: The loss mask and per-token weight: 0 on prompt and padding positions.
WEIGHTS: Final = "weights"
#: The behaviour policy's logprob of each target token (the importance ratio's "old").
SAMPLER_LOGPROBS: Final = "sampler_logprobs"
#: Per-token advantages (normalisers folded in, for the sum-over-tokens losses).
ADVANTAGES: Final = "advantages"

# What a stage's preparation puts in ``Datum.extra`` (a per-position list or a (T, ...) tensor).
#: The reference policy's logprob of each target token (GRPO's KL term, DPO).
REF_LOGPROBS: Final = "ref_logprobs"
#: DPO's slot of a row whose side spans several rows: ``2i`` pair i's chosen, ``2i + 1`` its rejected.
DPO_SLOT: Final = "dpo_slot"
#: SDPO's distillation mask: the row's weights where its sample has a teacher, 0 elsewhere.
DISTILL_WEIGHTS: Final = "distill_weights"
#: The teacher's logprob of each target token (self-distillation: SDFT, SDPO).
TEACHER_TOKEN_LOGPROBS: Final = "teacher_token_logprobs"
#: The teacher's full next-token log-distribution at each target position, ``(T, V)``.
TEACHER_LOGITS: Final = "teacher_logits"
#: The teacher's top-k log-probabilities and their token ids at each target position, ``(T, K)``.
TEACHER_TOPK_LOGPROBS: Final = "teacher_topk_logprobs"
TEACHER_TOPK_IDS: Final = "teacher_topk_ids"
#: Soft targets for the built-in cross_entropy: ``(T, K)`` token ids and their weights.
SOFT_TARGET_IDS: Final = "soft_target_ids"
SOFT_TARGET_WEIGHTS: Final = "soft_target_weights"

# What the backend adds to the batch it hands a loss.
#: The logits at the target positions (only for a loss with ``needs_logits``), ``(B, T|K, V)``.
LOGITS: Final = "logits"
#: The ``K`` positions ``LOGITS`` covers, when not all of them.
LOGIT_POSITIONS: Final = "logit_positions"
#: The completion tokens of the whole optimizer step, when a backend splits it over calls.
NUM_ITEMS_IN_BATCH: Final = "num_items_in_batch"

#: What every batch holds, whatever the stage: a row's tokens and weights.
ROW_INPUTS: Final = frozenset({INPUT_IDS, ATTENTION_MASK, TARGET_IDS, WEIGHTS})
#: What the backend provides (never a stage's concern; ``LOGITS`` goes with ``needs_logits``).
BACKEND_INPUTS: Final = frozenset({LOGITS, LOGIT_POSITIONS, NUM_ITEMS_IN_BATCH})


def loss_reads(loss: object) -> frozenset[str] | None:
    """The batch inputs ``loss`` declares it requires (its ``reads``), or ``None`` when it
    declares nothing (then nothing is checked)."""
    reads = getattr(loss, "reads", None)
    return None if reads is None else frozenset(reads)


def reads_input(loss: object, name: str) -> bool:
    """Whether ``loss`` declares that it requires input ``name`` (what a stage asks to decide
    what to prepare, e.g. reference logprobs)."""
    return name in (loss_reads(loss) or ())


def check_reads(loss: object, provided: Iterable[str], path: str, stage: str) -> None:
    """Raise a one-line :class:`ConfigError` at ``path`` (the ``loss`` key of a ``stage``) when the
    loss requires an input that ``provided`` (what the stage's batches hold) and the backend's
    own :data:`BACKEND_INPUTS` lack. A loss that declares no ``reads`` passes."""
    reads = loss_reads(loss)
    if reads is None:
        return
    have = frozenset(provided) | BACKEND_INPUTS
    missing = sorted(reads - have)
    if missing:
        name = type(loss).__name__
        raise ConfigError(
            f"the {name} loss reads {', '.join(missing)}, which a '{stage}' stage's batches do not hold "
            f"(they hold {', '.join(sorted(have - BACKEND_INPUTS))}); use a loss written for this stage",
            path,
        )


# --------------------------------------------------------------------------- what the stage tells the loss
@dataclass(frozen=True)
class LossSetup:
    """What a stage tells its loss once, at setup: facts its batches do not carry.

    ``max_tokens``: the sampler's cap on generated tokens per model turn (``None``: the stage
    does not sample). Dr. GRPO normalises by this constant.
    """

    max_tokens: int | None = None


@runtime_checkable
class StageAwareLoss(Protocol):
    """A loss that takes the stage's :class:`LossSetup`: ``for_stage`` returns the loss to
    train with (itself, or a configured copy; never a mutation the caller must know of)."""

    def for_stage(self, setup: LossSetup) -> Any: ...


def for_stage(loss: Loss, setup: LossSetup) -> Loss:
    """``loss`` configured with what its stage knows (:class:`StageAwareLoss`), else ``loss``."""
    return loss.for_stage(setup) if isinstance(loss, StageAwareLoss) else loss


# --------------------------------------------------------------------------- optional capabilities
# A loss is any callable ``(logprobs, batch) -> LossOutput`` (tempering.interfaces.Loss). What
# it may add is optional, each a protocol of its own, read through the functions below (never
# probed with getattr elsewhere): a minimal loss has none of them and is still a Loss.


@runtime_checkable
class LogitsLoss(Protocol):
    """``needs_logits = True``: the backend adds :data:`LOGITS` (and maybe :data:`LOGIT_POSITIONS`)."""

    needs_logits: bool


@runtime_checkable
class AllPositionsLoss(Protocol):
    """``needs_all_positions = True``: logprobs at every position, not only the trained ones."""

    needs_all_positions: bool


@runtime_checkable
class NamedBuiltinLoss(Protocol):
    """``tinker_builtin``: the built-in loss (:data:`BUILTIN_LOSSES`) that computes this one, or None."""

    tinker_builtin: str | None


@runtime_checkable
class SumOverTokensLoss(Protocol):
    """``sums_over_tokens = True``: the loss is a plain sum over its tokens (as Tinker's built-ins
    are), so a stage that normalises folds the normaliser into the advantages before the call."""

    sums_over_tokens: bool


def needs_logits(loss: object) -> bool:
    """Whether ``loss`` reads :data:`LOGITS` (:class:`LogitsLoss`); False when it does not say."""
    return isinstance(loss, LogitsLoss) and bool(loss.needs_logits)


def needs_all_positions(loss: object) -> bool:
    """Whether ``loss`` needs logprobs at every position (:class:`AllPositionsLoss`)."""
    return isinstance(loss, AllPositionsLoss) and bool(loss.needs_all_positions)


def builtin_name(loss: object) -> str | None:
    """The built-in ``loss`` names statically (:class:`NamedBuiltinLoss`), or None."""
    return loss.tinker_builtin if isinstance(loss, NamedBuiltinLoss) else None


def builtin_fn_config(loss: object) -> Any:
    """A loss's explicit ``tinker_loss_fn_config`` (a mapping, or a method returning one), or None."""
    return getattr(loss, "tinker_loss_fn_config", None)


# --------------------------------------------------------------------------- built-in losses
#: The standard built-in losses, sums over tokens (Tinker's names and formulas; see
#: :mod:`tempering.rlmath.policy_loss`).
BUILTIN_LOSSES: Final = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
#: The built-ins that read the sampler's logprobs and advantages (policy-gradient losses).
POLICY_BUILTINS: Final = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
#: The built-ins whose clip thresholds are always given explicitly (never a service default).
CLIPPED_BUILTINS: Final = ("ppo", "cispo", "gspo")


@dataclass(frozen=True, eq=False)
class BuiltinLoss:
    """The built-in loss that computes a loss exactly, on one batch.

    ``name``: one of :data:`BUILTIN_LOSSES`; ``config``: its parameters (``clip_low_threshold``
    / ``clip_high_threshold`` as ratios, ``dro``'s ``beta``; ``None``: none). For the policy
    built-ins, ``coefficients`` (a ``(B, T)`` tensor, or ``None``) are non-negative per-token
    factors the backend multiplies into the advantages -- the loss's normaliser folded in
    (``c * min(r A, clip(r) A) = min(r (cA), clip(r) (cA))`` for ``c >= 0``) -- and it sends
    logprobs 0 where a factor is 0; ``None`` means 1 where ``weights`` is non-zero, 0 elsewhere.
    ``note`` says what the equivalence rests on (logged by the backend)."""

    name: str
    config: Mapping[str, float] | None = None
    coefficients: Any = None
    note: str = ""


@dataclass(frozen=True)
class NoBuiltin:
    """No built-in computes the loss (on this batch): ``reason`` says why, in words a user can
    act on; the backend then runs the loss itself (Tinker: ``forward_backward_custom``)."""

    reason: str


@runtime_checkable
class DeclaresBuiltin(Protocol):
    """A loss whose built-in depends on the batch (or on more than a fixed name)."""

    def builtin(self, batch: Batch) -> BuiltinLoss | NoBuiltin: ...


def builtin_of(loss: Loss, batch: Batch) -> BuiltinLoss | NoBuiltin:
    """The built-in loss that computes ``loss`` exactly on ``batch``, as the loss declares it
    (``builtin(batch)``, else ``tinker_builtin`` and its config), or why there is none.
    A declaration that names no built-in, or a clipped one without thresholds, is a
    :class:`ValueError`."""
    who = type(loss).__name__
    if isinstance(loss, DeclaresBuiltin):
        found = loss.builtin(batch)
    else:
        name = builtin_name(loss)
        if not name:
            return NoBuiltin(f"{who} names no built-in loss (tinker_builtin is None)")
        found = BuiltinLoss(
            str(name), builtin_config(loss, str(name)), note=f"{who} as the built-in {name} (its tinker_builtin)"
        )
    if isinstance(found, BuiltinLoss) and found.name not in BUILTIN_LOSSES:
        raise ValueError(
            f"{who} names the built-in {found.name!r}, which is not a built-in loss ({', '.join(BUILTIN_LOSSES)})"
        )
    return found


def names_builtin(loss: object) -> bool:
    """Whether ``loss`` names a built-in statically (a ``tinker_builtin`` that is not None): it
    is then a plain sum over tokens, as every built-in is, and a stage that folds a normaliser
    into the advantages must fold it for this loss too."""
    return builtin_name(loss) is not None


def sums_over_tokens(loss: object) -> bool:
    """Whether ``loss`` is a plain sum over tokens: it says so (:class:`SumOverTokensLoss`) or
    names a built-in (every built-in is one). False for a loss that normalises itself (``grpo``)."""
    return (isinstance(loss, SumOverTokensLoss) and bool(loss.sums_over_tokens)) or names_builtin(loss)


def builtin_config(loss: Loss, name: str) -> dict[str, float] | None:
    """The config of built-in ``name`` a loss declares statically: its ``tinker_loss_fn_config``
    if it has one, else (the clipped built-ins) thresholds from ``clip_low_threshold`` /
    ``clip_high_threshold`` or ``epsilon_low`` / ``epsilon_high`` attributes. Clip thresholds
    are always sent explicitly, so a recipe never silently runs with a service's defaults."""
    explicit = builtin_fn_config(loss)
    if callable(explicit):
        explicit = explicit()
    if explicit is not None:
        return {str(k): float(v) for k, v in dict(explicit).items()} or None
    if name not in CLIPPED_BUILTINS:
        return None
    for low, high, as_ratio in (
        ("clip_low_threshold", "clip_high_threshold", True),
        ("epsilon_low", "epsilon_high", False),
    ):
        lo, hi = getattr(loss, low, None), getattr(loss, high, None)
        if lo is not None and hi is not None:
            lo, hi = (float(lo), float(hi)) if as_ratio else (1.0 - float(lo), 1.0 + float(hi))
            return {"clip_low_threshold": lo, "clip_high_threshold": hi}
    raise ValueError(
        f"{type(loss).__name__} names the built-in {name!r} but gives no clip thresholds: give it "
        "epsilon_low/epsilon_high (or clip_low_threshold/clip_high_threshold) attributes, or "
        "tinker_loss_fn_config = {'clip_low_threshold': ..., 'clip_high_threshold': ...}"
    )
