"""The local backend's contract: what recipes (and the Tinker parity tests) rely on.

All tests use a ~20k-parameter tiny Llama built in code, so nothing is downloaded and the file
runs in well under a minute on two CPU cores.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import process_group
import pytest
import torch

from tempering.errors import ConfigError
from tempering.interfaces import Backend, LossOutput
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.plugins.models.tiny import build_char_tokenizer, tiny_llama, tiny_qwen
from tempering.types import AdamParams, Batch, Completion, Datum, SamplingParams

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
LORA = {"rank": 4, "alpha": 8}
TESTS = Path(__file__).parent


class CrossEntropy:
    """Weighted token-mean negative log-likelihood: the simplest loss that can learn."""

    needs_logits = False
    tinker_builtin = None

    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        w = batch["weights"]
        return LossOutput(-(logprobs * w).sum() / w.sum(), {"tokens": float(w.sum())})


def make_backend(**kwargs) -> LocalBackend:
    kwargs.setdefault("model_kwargs", SMALL)
    kwargs.setdefault("num_threads", 1)
    return LocalBackend(**kwargs)


@pytest.fixture(scope="module")
def backend() -> LocalBackend:
    """Shared by the read-only tests (sampling and scoring never change the weights)."""
    b = make_backend()
    yield b
    b.close()


def encode(backend: LocalBackend, *texts: str) -> list[list[int]]:
    return [backend.tokenizer.encode(t) for t in texts]


def sft_rows(backend: LocalBackend, texts: list[str]) -> list[Datum]:
    """Rows that train on every token after ``<bos>`` (eos included)."""
    rows = []
    for text in texts:
        ids = backend.tokenizer.encode(text) + [backend.tokenizer.eos_token_id]
        rows.append(Datum(ids[:-1], ids[1:], [1.0] * (len(ids) - 1)))
    return rows


def completion_logprobs(
    backend: LocalBackend, completions: list[Completion], reference: bool = False
) -> list[list[float]]:
    """A separate forward pass's logprobs of each completion's own tokens."""
    rows = [Datum.from_completion(c) for c in completions]
    scored = backend.logprobs(Batch(rows), reference=reference).result()
    return [lp[len(lp) - len(c.tokens) :] for lp, c in zip(scored, completions)]


def cat(rows: list[list[float]]) -> torch.Tensor:
    """Ragged per-row logprobs as one flat tensor, for comparisons."""
    return torch.tensor([x for r in rows for x in r])


def flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for g in groups for c in g]


def full_logits(backend: LocalBackend, c: Completion) -> torch.Tensor:
    """Logits predicting each completion token, shape ``(len(tokens), V)``."""
    ids = torch.tensor([c.prompt_tokens + c.tokens[:-1]])
    with torch.no_grad():
        logits = backend.model(input_ids=ids).logits[0]
    return logits[len(c.prompt_tokens) - 1 :].float()


# --------------------------------------------------------------------------- tiny model
def test_char_tokenizer_round_trips_and_has_fixed_special_ids() -> None:
    tok = build_char_tokenizer("0123456789+= ")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 16
    ids = tok.encode("12+3= 4")
    assert ids[0] == tok.bos_token_id and len(ids) == 8
    assert tok.decode(ids, skip_special_tokens=True) == "12+3= 4"


def test_tiny_models_are_deterministic_per_seed() -> None:
    (a, tok), (b, _) = tiny_llama(**SMALL, seed=3), tiny_llama(**SMALL, seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert a.config.vocab_size == len(tok) and a.generation_config.eos_token_id == tok.eos_token_id
    qwen, _ = tiny_qwen(**SMALL)
    assert type(qwen).__name__ == "Qwen2ForCausalLM" and qwen.config.pad_token_id == tok.pad_token_id


def test_backend_satisfies_the_protocol(backend: LocalBackend) -> None:
    assert isinstance(backend, Backend)
    assert backend.step == 0


# --------------------------------------------------------------------------- sampling
def test_sampler_logprobs_match_a_forward_pass_with_left_padding(backend: LocalBackend) -> None:
    prompts = encode(backend, "1", "12+34=", "7+7=", "99+1= ")
    groups = backend.sample(prompts, 3, SamplingParams(max_tokens=12, seed=1)).result()
    assert [len(g) for g in groups] == [3, 3, 3, 3]
    assert [g[0].prompt_tokens for g in groups] == prompts
    comps = flat(groups)
    assert len({len(c.tokens) for c in comps}) > 1 or any(c.stop_reason == "length" for c in comps)
    for c, ref in zip(comps, completion_logprobs(backend, comps)):
        assert len(c.logprobs) == len(c.tokens) == len(ref)
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)
        assert c.policy_version == 0 and c.temperature == 1.0


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.5, 0, 1.0), (1.7, 5, 1.0), (0.8, 0, 0.6)])
def test_logprobs_are_those_of_the_tempered_and_filtered_distribution(
    backend: LocalBackend, temperature: float, top_k: int, top_p: float
) -> None:
    params = SamplingParams(max_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, seed=2)
    comps = flat(backend.sample(encode(backend, "3+4=", "50+50="), 2, params).result())
    for c in comps:
        scaled = full_logits(backend, c) / temperature
        if top_k:
            kth = scaled.topk(top_k, dim=-1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        if top_p < 1.0:  # the nucleus: drop the least likely tokens holding 1 - top_p of the mass
            ordered, order = scaled.sort(dim=-1)
            drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
            drop[:, -1] = False
            scaled = scaled.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        expected = torch.log_softmax(scaled, -1).gather(-1, torch.tensor(c.tokens)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
        assert c.temperature == temperature


def test_greedy_is_deterministic_and_takes_the_argmax(backend: LocalBackend) -> None:
    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = encode(backend, "12+", "8+80=")
    first = flat(backend.sample(prompts, 2, params).result())
    second = flat(backend.sample(prompts, 2, params).result())
    assert [c.tokens for c in first] == [c.tokens for c in second]
    assert first[0].tokens == first[1].tokens  # both samples of one prompt
    for c in first:
        assert c.tokens == full_logits(backend, c).argmax(-1).tolist()


def test_seeded_sampling_repeats_and_leaves_the_global_rng_alone(backend: LocalBackend) -> None:
    prompts, params = encode(backend, "1+1="), SamplingParams(max_tokens=10, seed=123)
    state = torch.get_rng_state()
    a = backend.sample(prompts, 4, params).result()[0]
    assert torch.equal(state, torch.get_rng_state())
    b = backend.sample(prompts, 4, params).result()[0]
    assert [c.tokens for c in a] == [c.tokens for c in b]
    assert len({tuple(c.tokens) for c in a}) > 1  # rows of one call still differ


def test_max_tokens_and_eos_cut_completions(backend: LocalBackend) -> None:
    eos = backend.tokenizer.eos_token_id
    comps = flat(backend.sample(encode(backend, "1", "2+2="), 16, SamplingParams(max_tokens=5, seed=4)).result())
    assert any(c.stop_reason == "stop" for c in comps) and any(c.stop_reason == "length" for c in comps)
    for c in comps:
        assert 1 <= len(c.tokens) <= 5
        assert eos not in c.tokens[:-1]  # nothing after an eos
        if c.stop_reason == "stop":
            assert c.tokens[-1] == eos
        else:
            assert len(c.tokens) == 5 and eos not in c.tokens
        assert c.text == backend.tokenizer.decode(c.tokens, skip_special_tokens=True)
    empty = backend.sample(encode(backend, "1"), 1, SamplingParams(max_tokens=0)).result()[0][0]
    assert empty.tokens == [] and empty.stop_reason == "length"


def test_stop_strings_and_stop_token_ids(backend: LocalBackend) -> None:
    tok = backend.tokenizer
    eos = tok.eos_token_id
    params = SamplingParams(max_tokens=10, stop=["+", "77"], seed=5)
    comps = flat(backend.sample(encode(backend, "12+34="), 24, params).result())
    by_string = 0
    for c in comps:
        decoded = tok.decode(c.tokens, skip_special_tokens=True)
        assert eos not in c.tokens[:-1]
        assert "+" not in c.text and "77" not in c.text
        if c.stop_reason == "stop" and c.tokens[-1] != eos:
            by_string += 1  # the last token completes a stop string, the text stops before it
            shorter = tok.decode(c.tokens[:-1], skip_special_tokens=True)
            assert ("+" in decoded or "77" in decoded) and "+" not in shorter and "77" not in shorter
            assert decoded.startswith(c.text)
        else:
            assert "+" not in decoded and "77" not in decoded and c.text == decoded
    assert by_string > 0
    plus = tok.convert_tokens_to_ids("+")
    comps = flat(backend.sample(encode(backend, "1"), 16, SamplingParams(max_tokens=8, stop=[plus], seed=6)).result())
    assert any(c.tokens[-1] == plus and c.stop_reason == "stop" for c in comps)
    assert all(plus not in c.tokens[:-1] for c in comps)


def test_empty_prompt_is_rejected(backend: LocalBackend) -> None:
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        backend.sample([[]], 1, SamplingParams()).result()


# --------------------------------------------------------------------------- training
def test_training_reduces_the_loss_and_reports_clipping() -> None:
    b = make_backend(threaded=False)
    batch = Batch(sft_rows(b, ["12+34=46", "5+5=10", "70+9=79", "3+33=36"]))
    losses = []
    for _ in range(8):
        fb = b.forward_backward(batch, CrossEntropy())
        step = b.optim_step(AdamParams(learning_rate=1e-2, grad_clip_norm=1.0))
        losses.append(fb.result()["loss"])
        assert fb.result()["tokens"] == sum(d.num_loss_tokens for d in batch.data)
        assert step.result()["lr"] == 1e-2 and step.result()["grad_norm"] > 0
    assert losses[-1] < losses[0] - 0.3
    assert b.step == 8
    assert b.sample(encode(b, "1"), 1, SamplingParams(max_tokens=2)).result()[0][0].policy_version == 8

    b.forward_backward(batch, CrossEntropy()).result()
    clipped = b.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=1e-4)).result()
    assert clipped["grad_clipped"] == 1.0 and clipped["grad_norm"] > 1e-4
    b.forward_backward(batch, CrossEntropy()).result()
    unclipped = b.optim_step(AdamParams(learning_rate=1e-3, grad_clip_norm=0.0)).result()
    assert unclipped["grad_clipped"] == 0.0 and unclipped["grad_norm"] > 0


def test_gradients_accumulate_until_the_optimizer_step() -> None:
    """Two forward_backward calls add up: equal to one call on both batches (sum losses)."""

    class Sum(CrossEntropy):
        def __call__(self, logprobs, batch):
            return LossOutput(-(logprobs * batch["weights"]).sum())

    b = make_backend(threaded=False)
    a_rows, b_rows = sft_rows(b, ["1+2=3"]), sft_rows(b, ["40+40=80", "9+9=18"])
    b.forward_backward(Batch(a_rows), Sum()).result()
    b.forward_backward(Batch(b_rows), Sum()).result()
    twice = [p.grad.clone() for p in b.model.parameters()]
    b.model.zero_grad(set_to_none=True)
    b.forward_backward(Batch(a_rows + b_rows), Sum()).result()
    for g, p in zip(twice, b.model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-5, rtol=1e-4)


def test_losses_that_need_logits_receive_them(backend: LocalBackend) -> None:
    seen = {}

    class NeedsLogits(CrossEntropy):
        needs_logits = True

        def __call__(self, logprobs, batch):
            seen["shape"] = tuple(batch["logits"].shape)
            return LossOutput(batch["logits"].float().mean() * 0.0 + logprobs.sum() * 0.0)

    rows = sft_rows(backend, ["1+1=2", "10+10=20"])
    backend.forward_backward(Batch(rows), NeedsLogits()).result()
    backend.model.zero_grad(set_to_none=True)  # keep the shared backend clean
    assert seen["shape"] == (2, len(rows[1].input_tokens), len(backend.tokenizer))


# --------------------------------------------------------------------------- reference
@pytest.mark.parametrize("lora", [LORA, None], ids=["lora", "full"])
def test_reference_logprobs_stay_at_the_initial_model(lora) -> None:
    b = make_backend(lora=lora, threaded=False)
    batch = Batch(sft_rows(b, ["12+34=46", "8+8=16"]))
    policy0 = b.logprobs(batch).result()
    ref0 = b.reference_logprobs(batch).result()
    torch.testing.assert_close(cat(ref0), cat(policy0), atol=1e-6, rtol=0)
    for _ in range(2):
        b.forward_backward(batch, CrossEntropy()).result()
        b.optim_step(AdamParams(learning_rate=5e-2)).result()
    policy1 = b.logprobs(batch).result()
    ref1 = b.logprobs(batch, reference=True).result()
    assert (cat(policy1) - cat(policy0)).abs().max() > 1e-2
    torch.testing.assert_close(cat(ref1), cat(ref0), atol=1e-6, rtol=0)
    if lora:  # only the adapter trains
        assert all("lora_" in n for n, p in b.model.named_parameters() if p.requires_grad)


# --------------------------------------------------------------------------- checkpoints
def _continue(b: LocalBackend, batch: Batch) -> tuple[list[list[int]], float, dict[str, torch.Tensor]]:
    """One more loop iteration: unseeded sampling (global RNG), a step, then the weights."""
    comps = flat(b.sample(encode(b, "4+5=", "60+7="), 2, SamplingParams(max_tokens=6)).result())
    loss = b.forward_backward(batch, CrossEntropy()).result()["loss"]
    b.optim_step(AdamParams(learning_rate=2e-2)).result()
    params = {n: p.detach().clone() for n, p in b.model.named_parameters() if p.requires_grad}
    return [c.tokens for c in comps], loss, params


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_resume_takes_exactly_the_uninterrupted_next_step(tmp_path: Path, lora) -> None:
    run = make_backend(lora=lora)
    batch = Batch(sft_rows(run, ["12+34=46", "5+50=55", "9+9=18"]))
    for _ in range(2):  # sampling moves the global RNG, so resuming must restore it
        run.sample(encode(run, "1+"), 3, SamplingParams(max_tokens=4))
        run.forward_backward(batch, CrossEntropy())
        run.optim_step(AdamParams(learning_rate=2e-2))
    ckpt = run.save(str(tmp_path / "ckpt"), extra={"epoch": 0, "batch_index": 2})
    expected = _continue(run, batch)

    resumed = make_backend(lora=lora)
    assert resumed.load(ckpt) == {"epoch": 0, "batch_index": 2}
    assert resumed.step == 2
    tokens, loss, params = _continue(resumed, batch)
    assert tokens == expected[0]
    assert abs(loss - expected[1]) < 1e-6
    for name, value in params.items():
        torch.testing.assert_close(value, expected[2][name], atol=1e-6, rtol=0)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no temporary directories left behind


def test_load_rejects_a_mismatched_checkpoint(tmp_path: Path) -> None:
    full = make_backend(threaded=False)
    path = full.save(str(tmp_path / "full"))
    assert full.save(str(tmp_path / "full"), extra={"again": True}) == path  # overwriting is fine
    assert full.load(path) == {"again": True}
    with pytest.raises(ValueError, match="full weights"):
        make_backend(lora=LORA, threaded=False).load(path)
    with pytest.raises(FileNotFoundError):
        full.load(str(tmp_path / "nowhere"))
    with pytest.raises(TypeError, match="JSON"):
        full.save(str(tmp_path / "bad"), extra={"x": object()})


def test_export_loads_back_through_from_pretrained(tmp_path: Path) -> None:
    """The Hugging Face loading path, exercised offline on an exported tiny model."""
    b = make_backend(threaded=False)
    batch = Batch(sft_rows(b, ["12+34=46"]))
    b.forward_backward(batch, CrossEntropy()).result()
    b.optim_step(AdamParams(learning_rate=5e-2)).result()
    path = b.export_pretrained(str(tmp_path / "hf"))
    loaded = LocalBackend(model=path, threaded=False)
    assert loaded.tokenizer.encode("12+34=46") == b.tokenizer.encode("12+34=46")
    torch.testing.assert_close(cat(loaded.logprobs(batch).result()), cat(b.logprobs(batch).result()), atol=1e-6, rtol=0)


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"lora.*rnk"):
        make_backend(lora={"rnk": 4})
    with pytest.raises(ConfigError, match="dtype"):
        make_backend(dtype="float64x")


def test_qwen_builder_and_custom_builder_work() -> None:
    calls = []

    def builder(seed: int):
        calls.append(seed)
        return tiny_qwen(**SMALL, seed=seed)

    b = make_backend(model="my_qwen", model_kwargs={}, model_builder=builder, seed=7, threaded=False)
    assert calls == [7]
    c = b.sample(encode(b, "1+1="), 1, SamplingParams(max_tokens=4, seed=0)).result()[0][0]
    ref = completion_logprobs(b, [c])[0]
    torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(ref), atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- data parallel
def _load_worker():
    spec = importlib.util.spec_from_file_location("ddp_worker", TESTS / "ddp_worker.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_data_parallel_step_averages_gradients_across_ranks(tmp_path: Path) -> None:
    worker = _load_worker()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
    cmd = [
        # --standalone: torchrun picks its own free rendezvous port (no pick-then-bind race)
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(TESTS / "ddp_worker.py"),
        str(tmp_path),
    ]
    done = process_group.run(cmd, env, tmp_path.parent / f"{tmp_path.name}.log", timeout=110)
    assert done.returncode == 0, done.tail()
    ranks = [torch.load(tmp_path / f"params_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["loss"] != ranks[1]["loss"]  # the ranks really saw different data
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"{name} differs across ranks"

    # One process, both ranks' rows, twice the normaliser: the same averaged gradient.
    single = make_backend(model_kwargs=worker.MODEL_KWARGS, threaded=False)
    rows = worker.rank_rows(0, single.tokenizer) + worker.rank_rows(1, single.tokenizer)
    single.forward_backward(Batch(rows), worker.SumLoss(2 * worker.NORMALISER)).result()
    single.optim_step(worker.ADAM).result()
    for name, p in single.model.named_parameters():
        torch.testing.assert_close(ranks[0]["params"][name], p.detach(), atol=1e-5, rtol=0)

    # Without averaging, rank 0 would have stepped on its own gradient only.
    alone = make_backend(model_kwargs=worker.MODEL_KWARGS, threaded=False)
    alone.forward_backward(Batch(worker.rank_rows(0, alone.tokenizer)), worker.SumLoss(worker.NORMALISER)).result()
    alone.optim_step(worker.ADAM).result()
    gap = max((ranks[0]["params"][n] - p.detach()).abs().max().item() for n, p in alone.model.named_parameters())
    assert gap > 1e-3

    # Rank 0 alone wrote the checkpoint, with both ranks' RNG states in it.
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "params_rank0.pt", "params_rank1.pt"]
    state = torch.load(tmp_path / "ckpt" / "state.pt", weights_only=True)
    assert len(state["rng"]) == 2 and not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])
    resumed = make_backend(model_kwargs=worker.MODEL_KWARGS, threaded=False)
    assert resumed.load(str(tmp_path / "ckpt")) == {"written_by_world": 2} and resumed.step == 1
