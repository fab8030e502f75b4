"""The Tinker backend's settings: what each key may be, checked before anything is sent.

One :class:`~tempering.errors.ConfigError` (or :class:`TinkerAuthError`) at the first setting out
of range, naming the key, so a typo never costs a session on the service. Also the SDK import,
with a one-line error naming the extra when it is missing.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from tempering.errors import ConfigError
from tempering.plugins.backends.tinker.errors import INSTALL_HINT, KEY_HINT, TinkerAuthError, TinkerNotInstalledError

POLICY_LOGPROBS = ("trainer", "sampler")
SAMPLING_CLIENT_KINDS = ("snapshot", "inflight")
#: The SDK documents checkpoint TTLs "between 1 hour (3600) and 10 years".
MIN_TTL_SECONDS, MAX_TTL_SECONDS = 3600, 10 * 365 * 24 * 3600
#: End-of-text tokens a base model stops on that the tokenizer ``get_tokenizer`` returns may not
#: name as EOS: for ``meta-llama/Llama-3*`` the SDK loads the *instruct* tokenizer (EOS
#: ``<|eot_id|>``), while the base model ends text with ``<|end_of_text|>``.
END_TOKENS = {"meta-llama/Llama-3": ("<|end_of_text|>", "<|eot_id|>")}
#: Keys of the local backend that mean nothing on Tinker. Accepted (with one warning) so that a
#: recipe switches backends by ``backend.name`` alone; ``model`` and ``lora.rank`` do carry over.
LOCAL_ONLY_KEYS = (
    "model_kwargs",
    "device",
    "dtype",
    "sample_batch_size",
    "num_threads",
    "threaded",
    "gradient_checkpointing",
)


def sdk() -> Any:
    """The ``tinker`` module, or a one-line error naming the extra to install."""
    try:
        import tinker
    except ImportError as err:
        raise TinkerNotInstalledError(
            f"the Tinker backend needs the Tinker SDK, which is not installed ({err}): {INSTALL_HINT}"
        ) from err
    return tinker


def model_and_rank(
    base_model: str | None,
    model: str | None,
    rank: int | None,
    lora: Mapping[str, Any] | None,
    local_keys: Mapping[str, Any],
) -> tuple[str, int]:
    """The Tinker model name and LoRA rank from the Tinker keys or the local backend's (``model``,
    ``lora.rank``), so that a recipe switches backends by name alone; the local-only keys that
    were set are named in one warning."""
    ignored = [k for k, v in local_keys.items() if v is not None]
    lora = dict(lora or {})
    ignored += [f"lora.{k}" for k in sorted(lora) if k != "rank"]
    if ignored:
        warnings.warn(f"backend 'tinker' ignores local-backend keys: {', '.join(ignored)}", UserWarning, stacklevel=3)
    if base_model is None and model is None:
        raise ConfigError(
            "set the Tinker model, e.g. base_model=Qwen/Qwen3-4B-Instruct-2507 "
            "(`tinker model list` lists the models you can use)",
            path="backend.base_model",
        )
    if base_model is not None and model is not None and model != base_model:
        warnings.warn(
            f"backend 'tinker' uses base_model={base_model!r}, not model={model!r}", UserWarning, stacklevel=3
        )
    lora_rank = int(rank if rank is not None else lora.get("rank", 32))
    if lora_rank < 1:
        raise ConfigError(f"must be >= 1, got {lora_rank}", path="backend.rank")
    return str(base_model if base_model is not None else model), lora_rank


def check_settings(
    *,
    sampler_refresh_every: int,
    policy_logprobs: str,
    sampling_client_kind: str,
    max_retries: int,
    retry_backoff: float,
    concurrency: int,
    max_recoveries: int,
    setup_timeout_seconds: float,
    request_timeout_seconds: float,
    wait_warning_seconds: float,
    checkpoint_ttl_seconds: int | None,
    snapshot_ttl_seconds: int | None,
) -> None:
    """One :class:`~tempering.errors.ConfigError` at the first setting out of range, before
    anything is sent to the service."""
    if sampler_refresh_every < 1:
        raise ConfigError(f"must be >= 1, got {sampler_refresh_every}", path="backend.sampler_refresh_every")
    if policy_logprobs not in POLICY_LOGPROBS:
        raise ConfigError(f"use one of {POLICY_LOGPROBS}, got {policy_logprobs!r}", path="backend.policy_logprobs")
    if sampling_client_kind not in SAMPLING_CLIENT_KINDS:
        raise ConfigError(
            f"use one of {SAMPLING_CLIENT_KINDS}, got {sampling_client_kind!r}", path="backend.sampling_client_kind"
        )
    if max_retries < 0 or retry_backoff < 0 or concurrency < 1 or max_recoveries < 0:
        raise ConfigError(
            "max_retries, max_recoveries and retry_backoff must be >= 0, concurrency >= 1", path="backend"
        )
    for key, value in (
        ("setup_timeout_seconds", setup_timeout_seconds),
        ("request_timeout_seconds", request_timeout_seconds),
        ("wait_warning_seconds", wait_warning_seconds),
    ):
        if not value > 0:
            raise ConfigError(f"must be > 0 seconds, got {value}", path=f"backend.{key}")
    for key, ttl in (
        ("checkpoint_ttl_seconds", checkpoint_ttl_seconds),
        ("snapshot_ttl_seconds", snapshot_ttl_seconds),
    ):
        if ttl is not None and not MIN_TTL_SECONDS <= int(ttl) <= MAX_TTL_SECONDS:
            raise ConfigError(
                f"must be null (never expire) or {MIN_TTL_SECONDS}..{MAX_TTL_SECONDS} seconds "
                f"(Tinker's range), got {ttl}",
                path=f"backend.{key}",
            )


def check_api_key(api_key: str | None) -> None:
    """Fail fast (before any request) on a key that cannot work."""
    key = api_key or os.environ.get("TINKER_API_KEY")
    source = "backend.api_key" if api_key else "TINKER_API_KEY"
    if key and not key.startswith(("tml-", "eyJ")) and not os.environ.get("TINKER_CREDENTIAL_CMD"):
        raise TinkerAuthError(f"{source} must start with 'tml-' (the value set does not): {KEY_HINT}")
