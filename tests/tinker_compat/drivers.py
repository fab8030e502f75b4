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


CHATML = "qwen3_instruct"  # SmolLM2's chat template is ChatML: this renderer gives its very tokens


def rl_loop(log_path: str, loss_fn: str, max_steps: int = 2) -> None:
    """The cookbook's own minimal loop, ``recipes.rl_loop``, as shipped -- its default loss
    ``stable_reinforce`` puts 0s at the prompt positions (advantage 0), ``gspo`` sends no
    ``loss_fn_config``. What a user's script changes to run it here: four arithmetic questions
    in GSM8K's shape instead of the download, the renderer for SmolLM2 (the cookbook's model
    table has no HuggingFaceTB entry), and a reward that alternates 1/0, so that every group
    has an advantage and every step trains (SmolLM2 writes no ``\\boxed{}`` in 8 tokens)."""
    import itertools

    import datasets
    from tinker_cookbook.recipes import rl_loop as loop

    pairs = [(1, 2), (3, 4), (5, 6), (7, 1)]
    rows = {"question": [f"What is {a} + {b}?" for a, b in pairs], "answer": [f"#### {a + b}" for a, b in pairs]}
    loop.datasets.load_dataset = lambda *a, **k: datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)})
    loop.model_info.get_recommended_renderer_name = lambda name: CHATML
    rewards = itertools.cycle([1.0, 0.0])
    loop.get_reward = lambda response, answer: next(rewards)
    loop.main(
        loop.Config(
            base_url=os.environ["TINKER_BASE_URL"],
            log_path=log_path,
            model_name=MODEL,
            batch_size=2,
            group_size=2,
            lora_rank=8,
            max_tokens=8,
            save_every=0,
            loss_fn=loss_fn,
            max_steps=max_steps,
            ttl_seconds=None,
        )
    )


def sdft_reverse(log_path: str) -> None:
    """``recipes.sdft.train`` with ``reverse=true``: the analytical reverse KL over the teacher's
    top-K, a client-side custom loss whose forward sends ``(N, K)`` ``target_tokens``. Its data
    (SciKnowEval, a download) replaced by four multiple-choice questions."""
    from tinker_cookbook.recipes.sdft import datasets as sdft_data
    from tinker_cookbook.recipes.sdft import train

    questions = [
        f"What is {a} + {b}?\n\nA) {a + b}\nB) {a + b + 1}\nPlease give your answer as <answer>X</answer>."
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]
    ]
    sdft_data.load_sciknoweval = lambda **kwargs: (questions, ["A"] * 4, [], [])
    config = train.CLIConfig(
        model_name=MODEL,
        lora_rank=8,
        renderer_name=CHATML,
        groups_per_batch=2,
        group_size=1,
        max_tokens=12,
        topk=5,
        reverse=True,
        eval_every=0,
        save_every=0,
        max_steps=1,
        log_path=log_path,
        base_url=os.environ["TINKER_BASE_URL"],
        behavior_if_log_dir_exists="delete",
    )
    asyncio.run(train.cli_main(config))
