"""A small real run, made once per test session and shared by the viewer, export and eval tests.

The ``tool_use`` demo in miniature: a tiny chat Llama is warmed up on tool-use transcripts by
SFT (60 steps: enough to call ``mul`` and answer, not to get it right), then trained by GRPO
through the ``calculator`` environment, with held-out episode evaluations. So its folder has
every file a run writes -- curves of two stages, multi-turn rollouts with tool calls and tool
results, checkpoints at both stage ends -- in about 7 seconds.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from functools import lru_cache
from typing import Any

TINY_CHAT = {
    "chat": True,
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 2,
    "intermediate_size": 128,
    "max_position_embeddings": 128,
}
EPISODES = {"name": "environment", "environment": "calculator", "max_turns": 3, "max_total_tokens": 96}
SFT_STEPS, RL_STEPS, PROMPTS, GROUP = 60, 3, 6, 4


def recipe(output_dir: str) -> dict[str, Any]:
    ev = {"dataset": {"name": "tool_use", "split": "test", "size": 8}, "sampler": EPISODES, "max_tokens": 20}
    return {
        "name": "small_tool_use",
        "output_dir": output_dir,
        "loggers": ["jsonl"],
        "checkpoint_minutes": 0,
        "backend": {"name": "local", "model": "tiny_llama", "model_kwargs": TINY_CHAT, "num_threads": 1},
        "stages": [
            {
                "id": "warmup",
                "name": "sft",
                "renderer": "tiny_chat",
                "steps": SFT_STEPS,
                "batch_size": 32,
                "dataset": {"name": "tool_use", "transcripts": True, "size": 200},
                "optimizer": {"learning_rate": 1e-2},
                "eval": {**ev, "at_start": False},
            },
            {
                "id": "rl",
                "name": "grpo",
                "renderer": "tiny_chat",
                "dataset": {"name": "tool_use"},
                "sampler": EPISODES,
                "steps": RL_STEPS,
                "prompts_per_step": PROMPTS,
                "group_size": GROUP,
                "max_tokens": 20,
                "optimizer": {"learning_rate": 5e-4},
                "eval": {**ev, "every": 2},
            },
        ],
    }


@lru_cache(maxsize=1)
def small_run() -> str:
    """The run folder (read-only for tests: copy it to change it)."""
    from tempering.training.recipe import Recipe

    root = tempfile.mkdtemp(prefix="tempering-small-run-")
    atexit.register(shutil.rmtree, root, True)
    out = f"{root}/run"
    Recipe.from_dict(recipe(out)).run()
    return out
