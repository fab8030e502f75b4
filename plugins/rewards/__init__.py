"""Built-in reward plugins.

Registered names (see :mod:`.plugin`): ``exact_match``, ``math_answer``, ``llm_judge``,
``brier``, ``brier_skill``, ``retrieval_recall``, ``weighted``, ``process_pool``, ``remote``.
The classes are importable from here too; they load on first access so that importing this
package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ExactMatch": "basic",
    "MathAnswer": "math_answer",
    "LLMJudge": "judge",
    "JudgeParseError": "judge",
    "Brier": "forecast",
    "BrierSkill": "forecast",
    "ForecastParseError": "forecast",
    "RetrievalRecall": "retrieval",
    "WeightedReward": "combine",
    "AsyncWeightedReward": "combine",
    "weighted": "combine",
    "ProcessPoolReward": "pool",
    "RemoteReward": "remote",
    "RemoteRewardError": "remote",
    "RewardError": "common",
    "RewardTimeout": "common",
    "start_server": "server",
    "serve": "server",
}

__all__ = sorted(_EXPORTS)  # noqa: PLE0605 - the lazy exports' names, computed


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
