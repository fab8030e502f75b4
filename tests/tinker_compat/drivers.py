"""tinker-cookbook's own loops and helpers, called as a user's script calls them (each test runs
one function here in a fresh process, see conftest.run_driver). Only public cookbook API; the
small settings (2 groups of 2, a few steps) keep each run within a minute on two CPU cores."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = "role_colon"  # the cookbook's generic renderer (it has no SmolLM2-specific one)


def _arithmetic(batch_size: int = 2, group_size: int = 2):
    from tinker_cookbook.recipes.math_rl import arithmetic_env

    return arithmetic_env.ArithmeticDatasetBuilder(
        batch_size=batch_size,
        model_name_for_tokenizer=MODEL,
        renderer_name=RENDERER,
        n_batches=4,
        include_fewshot=True,
        group_size=group_size,
    )


def _rl_config(log_path: str, **kwargs):
    from tinker_cookbook.rl import train

    settings = {
        "learning_rate": 1e-5,
        "dataset_builder": _arithmetic(),
        "model_name": MODEL,
        "recipe_name": "compat",
        "max_tokens": 5,
        "log_path": log_path,
        "lora_rank": 8,
        "max_steps": 2,
        "eval_every": 0,
        "save_every": 1,
        "renderer_name": RENDERER,
        "base_url": os.environ["TINKER_BASE_URL"],
        **kwargs,
    }
    return train.Config(**settings)


def rl_sync(log_path: str) -> None:
    """The synchronous RL loop with a KL penalty against the base model and ``ppo``."""
    from tinker_cookbook.rl import train

    reference = train.KLReferenceConfig(base_model=MODEL)
    asyncio.run(train.main(_rl_config(log_path, kl_penalty_coef=0.01, kl_reference_config=reference, loss_fn="ppo")))


def rl_async(log_path: str) -> None:
    """The asynchronous RL loop with its defaults (its loss: ``stable_reinforce``)."""
    from tinker_cookbook.rl import train

    asyncio.run(
        train.main(_rl_config(log_path, async_config=train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2)))
    )


def sft(log_path: str, data: str) -> None:
    """The supervised loop on a conversation JSONL, with a held-out NLL and a save every step."""
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=MODEL, renderer_name=RENDERER, max_length=128, batch_size=2
    )
    config = train.Config(
        log_path=log_path,
        model_name=MODEL,
        recipe_name="compat",
        renderer_name=RENDERER,
        lora_rank=8,
        dataset_builder=FromConversationFileBuilder(file_path=data, test_size=2, common_config=common),
        learning_rate=1e-4,
        max_steps=2,
        save_every=1,
        eval_every=1,
        base_url=os.environ["TINKER_BASE_URL"],
    )
    asyncio.run(train.main(config))


def rl_from(log_path: str, checkpoint: str) -> None:
    """RL from a checkpoint of another run (``load_checkpoint_path``: SFT, then RL)."""
    from tinker_cookbook.rl import train

    asyncio.run(
        train.main(_rl_config(log_path, load_checkpoint_path=checkpoint, max_steps=1, loss_fn="importance_sampling"))
    )


def download(tinker_path: str, out: str) -> None:
    """``weights.download``: files written to ``out``, their names printed as JSON."""
    from tinker_cookbook import weights

    weights.download(tinker_path=tinker_path, output_dir=out)
    print("RESULT", json.dumps(sorted(p.name for p in Path(out).rglob("*") if p.is_file())))


def rest(tinker_path: str) -> None:
    """The REST calls the cookbook makes: the run behind a checkpoint (its renderer name), the
    run's checkpoints, the checkpoint's weights info; printed as JSON."""
    import tinker
    from tinker_cookbook import checkpoint_utils

    rc = tinker.RestClient()
    run = rc.get_training_run_by_tinker_path(tinker_path).result(timeout=30)
    listed = rc.list_checkpoints(run.training_run_id).result(timeout=30).checkpoints
    info = rc.get_weights_info_by_tinker_path(tinker_path).result(timeout=30)
    renderer = checkpoint_utils.get_renderer_name_from_checkpoint(tinker.ServiceClient(), tinker_path)
    print(
        "RESULT",
        json.dumps(
            {
                "renderer": renderer,
                "checkpoints": [[c.checkpoint_type, c.tinker_path] for c in listed],
                "base_model": info.base_model,
                "lora_rank": info.lora_rank,
            }
        ),
    )
