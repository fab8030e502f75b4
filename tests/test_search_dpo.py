"""Multi-turn DPO: pairs of trajectories sharing a history and differing from one assistant turn
on, rendered by the stage's renderer, with loss weight on the continuations' assistant tokens
only -- checked on ``tiny_chat`` (the tiny model's format) and ``qwen3_instruct`` (the real Qwen3
tokenizer and format), for the pairs the ``agentic_search`` dataset generates and for
hand-written ones (a continuation of several turns; a side the format splits into rows).
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from tempering.algorithms.dpo.algorithm import DPO
from tempering.algorithms.dpo.loss import DPOLoss, pair_sequence_logprobs
from tempering.plugins.datasets.search_traces import agentic_search
from tempering.registry import get_registry
from tempering.training.recipe import Recipe

LN2 = math.log(2.0)
TINY = {
    "chat": True,
    "hidden_size": 16,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 512,
}


@pytest.fixture(scope="module")
def renderers() -> dict[str, Any]:
    from tempering.plugins.models.qwen3 import qwen3_tokenizer
    from tempering.plugins.models.tiny import tiny_llama

    reg = get_registry()
    tiny_tok, qwen_tok = tiny_llama(**TINY)[1], qwen3_tokenizer()
    return {
        "tiny_chat": reg.build("renderer", "tiny_chat", "renderer", tokenizer=tiny_tok),
        "qwen3_instruct": reg.build("renderer", "qwen3_instruct", "renderer", tokenizer=qwen_tok),
    }


def full_row(d: Any) -> tuple[list[int], list[float]]:
    """A datum's tokens and its weights aligned to them (the first token is never a target)."""
    return [*d.input_tokens, d.target_tokens[-1]], [0.0, *d.weights]


def assistant_tokens(renderer: Any, history: list[dict[str, Any]], turn: dict[str, Any], tools: Any) -> list[int]:
    """The tokens the model emits for ``turn`` after ``history``: what an episode samples."""
    prompt = renderer.render_prompt(history, tools).tokens
    [row] = [
        r for r in renderer.render_training([*[{**m, "weight": 0} for m in history], turn], tools) if any(r.weights)
    ]
    assert row.tokens[: len(prompt)] == prompt
    return row.tokens[len(prompt) :]


@pytest.mark.parametrize("name", ["tiny_chat", "qwen3_instruct"])
def test_generated_pairs_weigh_exactly_the_differing_turn(renderers: dict[str, Any], name: str) -> None:
    renderer = renderers[name]
    pairs = agentic_search("train", "pairs", size=6, hops=[2])
    batch = DPO().build_batch(renderer.tokenizer, pairs, renderer=renderer)
    assert len(batch.data) == 2 * len(pairs) and "dpo_slot" not in batch.data[0].extra  # one row a side: interleaved
    for i, pair in enumerate(pairs):
        prompt = renderer.render_prompt(pair["messages"], pair["tools"]).tokens
        for d, side in zip(batch.data[2 * i : 2 * i + 2], (pair["chosen"], pair["rejected"])):
            tokens, weights = full_row(d)
            turn = assistant_tokens(renderer, pair["messages"], side[0], pair["tools"])
            assert tokens == [*prompt, *turn]  # the shared history, exactly as the model sees it, then the turn
            assert weights == [0.0] * len(prompt) + [1.0] * len(turn)
    # two of each task's three pairs have earlier assistant turns in their history: context, weight 0 above
    assert sum(any(m["role"] == "assistant" for m in p["messages"]) for p in pairs) == 2 * len(pairs) // 3


@pytest.mark.parametrize("name", ["tiny_chat", "qwen3_instruct"])
def test_a_continuation_of_several_turns_trains_its_assistant_turns_not_the_tool_results(
    renderers: dict[str, Any], name: str
) -> None:
    renderer = renderers[name]
    [pair] = agentic_search("train", "pairs", size=1, hops=[1])[:1]
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call_0_0", "type": "function", "function": {"name": "search", "arguments": {"query": "kam olo"}}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_0_0", "name": "search", "content": "kam olo: lives in tes."}
    answer = {"role": "assistant", "content": "tes [kam olo]"}
    row = {"messages": pair["messages"], "tools": pair["tools"], "chosen": [call, result, answer], "rejected": answer}
    chosen, rejected = DPO().sides(renderer.tokenizer, row, renderer)
    [c], [r] = chosen, rejected
    tokens, weights = full_row(c)
    before = renderer.render_prompt([*pair["messages"], call, result], pair["tools"]).tokens  # the second turn's prompt
    prompt = renderer.render_prompt(pair["messages"], pair["tools"]).tokens
    turn1 = assistant_tokens(renderer, pair["messages"], call, pair["tools"])
    turn2 = assistant_tokens(renderer, [*pair["messages"], call, result], answer, pair["tools"])
    observation = before[len(prompt) + len(turn1) :]  # the tool result and the next turn's header
    assert tokens == [*prompt, *turn1, *observation, *turn2]
    assert weights == [0.0] * len(prompt) + [1.0] * len(turn1) + [0.0] * len(observation) + [1.0] * len(turn2)
    assert full_row(r)[0] == [*prompt, *assistant_tokens(renderer, pair["messages"], answer, pair["tools"])]


def test_a_side_the_format_splits_into_rows_is_summed_over_its_rows(renderers: dict[str, Any]) -> None:
    renderer = renderers["qwen3_instruct"]  # text before a call re-renders differently in history: a new row
    [pair] = agentic_search("train", "pairs", size=1, hops=[1])[:1]
    call = {
        "role": "assistant",
        "content": "Let me search.",
        "tool_calls": [
            {"id": "c0", "type": "function", "function": {"name": "search", "arguments": {"query": "kam olo"}}}
        ],
    }
    chosen = [
        call,
        {"role": "tool", "tool_call_id": "c0", "name": "search", "content": "kam olo: lives in tes."},
        {"role": "assistant", "content": "tes [kam olo]"},
    ]
    rows = [{**pair, "chosen": chosen}, pair]
    batch = DPO().build_batch(renderer.tokenizer, rows, renderer=renderer)
    assert batch.meta["slots"] == [0, 0, 1, 2, 3]  # pair 0's chosen side is two rows
    assert [d.extra["dpo_slot"][0] for d in batch.data] == [0.0, 0.0, 1.0, 2.0, 3.0]
    # the loss sums a side over its rows: equal to the hand-made interleaved sums
    torch.manual_seed(0)
    for d in batch.data:
        d.extra["ref_logprobs"] = [-0.5] * len(d.target_tokens)
    tensors = batch.to_tensors()
    logprobs = -torch.rand(tensors["weights"].shape)
    s_c, s_r, n_c, n_r = pair_sequence_logprobs(logprobs, tensors["weights"], tensors["dpo_slot"])
    per_row = (logprobs * (tensors["weights"] != 0)).sum(-1)
    counts = (tensors["weights"] != 0).sum(-1).float()
    assert torch.allclose(s_c, torch.stack([per_row[0] + per_row[1], per_row[3]]))
    assert torch.allclose(s_r, torch.stack([per_row[2], per_row[4]]))
    assert n_c.tolist() == [counts[0] + counts[1], counts[3]] and n_r.tolist() == [counts[2], counts[4]]
    out = DPOLoss(beta=0.1)(logprobs, tensors)
    ref = torch.tensor([-0.5]) * torch.stack([n_c, n_r])
    delta = (s_c - ref[0]) - (s_r - ref[1])
    assert out.loss.item() == pytest.approx(float(-torch.nn.functional.logsigmoid(0.1 * delta).mean()), abs=1e-6)
    with pytest.raises(ValueError, match="a chosen and a rejected side"):
        pair_sequence_logprobs(logprobs[:4], tensors["weights"][:4], tensors["dpo_slot"][:4])


def test_bad_pairs_name_the_problem(renderers: dict[str, Any]) -> None:
    renderer = renderers["tiny_chat"]
    [pair] = agentic_search("train", "pairs", size=1, hops=[1])[:1]
    with pytest.raises(ValueError, match="starts with an assistant message"):
        DPO().sides(renderer.tokenizer, {**pair, "rejected": [{"role": "user", "content": "hi"}]}, renderer)
    with pytest.raises(ValueError, match="needs 'messages'"):
        DPO().sides(renderer.tokenizer, {"chosen": pair["chosen"], "rejected": pair["rejected"]}, renderer)
    with pytest.raises(ValueError, match="needs the stage's renderer"):
        DPO().build_batch(renderer.tokenizer, [pair])


def test_a_dpo_stage_on_multi_turn_pairs_starts_at_ln2_and_precomputed_equals_live(tmp_path: Any) -> None:
    def run(reference: str) -> list[dict[str, Any]]:
        return (
            Recipe(
                name=reference,
                output_dir=str(tmp_path / reference),
                loggers=[],
                backend={"name": "local", "model": "tiny_llama", "model_kwargs": TINY, "num_threads": 1},
                stages=[
                    {
                        "id": "pref",
                        "name": "dpo",
                        "steps": 3,
                        "batch_size": 4,
                        "reference": reference,
                        "renderer": "tiny_chat",
                        "optimizer": {"learning_rate": 1e-2},
                        "dataset": {"name": "agentic_search", "format": "pairs", "size": 4, "hops": [1, 2]},
                    }
                ],
            )
            .run()
            .history
        )

    live, pre = run("live"), run("precomputed")
    losses = [r["loss"] for r in live if "loss" in r]
    assert losses[0] == pytest.approx(LN2, abs=1e-6) and losses[-1] < losses[0]
    assert [r["loss"] for r in pre if "loss" in r] == pytest.approx(losses, abs=1e-6)
