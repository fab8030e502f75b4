"""Bundled recipes, shipped as YAML inside the package so `tempering run NAME` works after
`pip install`. Each function returns the recipe as a dict."""

from __future__ import annotations

from importlib import resources
from typing import Any

import yaml


def _load(name: str) -> dict[str, Any]:
    text = resources.files(__name__).joinpath(f"{name}.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def arithmetic() -> dict[str, Any]:
    """The main CPU demo: SFT warmup then GRPO on 2-digit addition with a tiny Llama."""
    return _load("arithmetic")


def tool_use() -> dict[str, Any]:
    """The tool-use CPU demo: SFT warmup on tool-use transcripts, then GRPO through the
    ``calculator`` environment (a tiny Llama learns to multiply by calling ``mul``)."""
    return _load("tool_use")


def agentic_search_dpo() -> dict[str, Any]:
    """Agentic search, DPO warmup on preferred vs rejected tool calls, then GRPO on recall and
    efficiency (a tiny chat Llama on the tiny generated corpus)."""
    return _load("agentic_search_dpo")


def agentic_search_sft() -> dict[str, Any]:
    """Agentic search, SFT on search trajectories that prune their context, then GRPO on recall
    and token efficiency (a tiny chat Llama on the tiny generated corpus)."""
    return _load("agentic_search_sft")


def smollm2_math() -> dict[str, Any]:
    """The real-model CPU demo: GRPO with LoRA teaches SmolLM2-135M-Instruct to answer
    arithmetic questions asked in natural language."""
    return _load("smollm2_math")


def smollm2_forecast() -> dict[str, Any]:
    """Calibrated forecasts on a real model: GRPO on the ``brier`` reward teaches
    SmolLM2-135M-Instruct to state the probability a history implies (``forecast_questions``)."""
    return _load("smollm2_forecast")


def sdpo_feedback() -> dict[str, Any]:
    """SDPO where most rollouts fail but feedback is informative: a tiny Llama warmed up to
    15% on addition (and to read "expected X, got Y" feedback), then SDPO on exact_match."""
    return _load("sdpo_feedback")


def smollm2_specialists() -> dict[str, Any]:
    """Ramp's system on a real model: three SmolLM2-135M-Instruct specialists trained in
    parallel processes vs one generalist with 3x the steps, with a trained router."""
    return _load("smollm2_specialists")


def smollm2_sdft() -> dict[str, Any]:
    """SDFT vs SFT on SmolLM2-135M-Instruct, the SDFT arm: a new skill (a request answered by
    one tool call) learnt on-policy from demonstrations, the teacher shown the demonstration as
    its own earlier answer."""
    return _load("smollm2_sdft")


def smollm2_sft_skill() -> dict[str, Any]:
    """SDFT vs SFT on SmolLM2-135M-Instruct, the SFT arm: the same new skill by plain SFT."""
    return _load("smollm2_sft_skill")


def smollm2_monitor() -> dict[str, Any]:
    """The ``monitor`` reward on SmolLM2-135M-Instruct: multiple-choice sums behind a planted
    spurious cue; GRPO on the task plus a monitor's accuracy at predicting the cue's sway."""
    return _load("smollm2_monitor")


def smollm2_code() -> dict[str, Any]:
    """The sandbox reward's demo: GRPO with LoRA teaches SmolLM2-135M-Instruct to write small
    Python functions, rewarded by the share of unit tests its program passes in a sandbox."""
    return _load("smollm2_code")


def smollm2_search() -> dict[str, Any]:
    """Glean's search agent on SmolLM2-135M-Instruct: an SFT warmup on tool-call traces
    (DPO: docs/systems.md), then GRPO through the ``search`` environment on recall, answer and tool cost."""
    return _load("smollm2_search")


def smollm2_stale_sdpo() -> dict[str, Any]:
    """Stale SDPO on a slow multi-turn task (the Trajectory system): SmolLM2 through the
    ``calculator`` environment with a slow tool, on-policy vs 3 steps stale (clipped IS, capped
    advantages) vs naive IS, by override."""
    return _load("smollm2_stale_sdpo")
