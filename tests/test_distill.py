"""On-policy distillation (``distill``): the oracle, the hand computation, learning, bad input.

* the full-vocabulary reverse KL equals TRL's GKD (``generalized_jsd_loss``, beta 1: reverse KL;
  lmbda 1: on the student's own samples; temperature 1) to 1e-6, loss and gradients, with the
  student and teacher running in two local backends;
* the sampled-token reverse KL and the advantages the stage writes equal a hand computation
  from the two models' logprobs (HF forwards of each row, independently of the backends), with
  the cookbook's coefficient and discount;
* a student learns the teacher's preference (KL to the teacher falls; fails at lr 1e-12);
* the teacher can be a HF folder, a run's checkpoint, a model plugin with kwargs;
* a missing teacher, another tokenizer, a bad key: one line each.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from tiny_runs import TwoTurns, tiny_recipe

from tempering.algorithms.distill.algorithm import Distill
from tempering.algorithms.distill.kl import kl_term
from tempering.algorithms.distill.loss import ReverseKLLoss
from tempering.algorithms.distill.teacher import Teacher, vocab_difference
from tempering.algorithms.sft.loss import CrossEntropyLoss
from tempering.errors import ConfigError
from tempering.loss_contract import TEACHER_TOKEN_LOGPROBS
from tempering.plugins.backends.local.backend import LocalBackend
from tempering.rlmath.kl import discounted_future_sum
from tempering.training.recipe import Recipe
from tempering.training.teacher import attach_teacher
from tempering.types import AdamParams, Batch, Datum, SamplingParams

SMALL = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
PROMPTS = ["12+34=", "50+7=", "9+9=", "3+40="]


def _backend(seed: int) -> LocalBackend:
    return LocalBackend(model="tiny_llama", model_kwargs={**SMALL, "seed": seed}, num_threads=1, threaded=False)


def _sft(backend: LocalBackend, answer: str, steps: int, lr: float = 2e-2) -> None:
    """A few SFT steps towards answering ``answer`` to every prompt: peaked distributions."""
    tok = backend.tokenizer
    rows = []
    for p in PROMPTS:
        ids = tok(p + answer)["input_ids"] + [tok.eos_token_id]
        n = len(tok(p)["input_ids"])
        rows.append(Datum(ids[:-1], ids[1:], [0.0] * (n - 1) + [1.0 / len(PROMPTS)] * (len(ids) - n)))
    for _ in range(steps):
        backend.forward_backward(Batch(rows), CrossEntropyLoss()).result()
        backend.optim_step(AdamParams(learning_rate=lr)).result()
    backend.model.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def pair() -> tuple[LocalBackend, LocalBackend]:
    """A student and a teacher of one vocabulary, each trained a little towards another answer."""
    student, teacher = _backend(0), _backend(1)
    _sft(student, "46", 6)
    _sft(teacher, "7", 10)
    return student, teacher


def _sampled_batch(student: LocalBackend, n: int = 2, max_tokens: int = 5) -> Batch:
    """The student's own samples (lmbda = 1: on-policy), as the RL engine lays them out."""
    tok = student.tokenizer
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    groups = student.sample(prompts, n, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=3)).result()
    data = [Datum.from_completion(c, advantage=0.0) for g in groups for c in g]
    assert sum(sum(1 for w in d.weights if w) for d in data) > len(data)  # something was sampled
    return Batch(data)


def _logits(backend: LocalBackend, d: Datum) -> torch.Tensor:
    return backend.model(input_ids=torch.tensor([d.input_tokens])).logits


def _row_logprobs(model: torch.nn.Module, d: Datum) -> torch.Tensor:
    """One row's next-token log-probabilities ``(T, V)``, by a plain HF forward of the row alone."""
    logits = model(input_ids=torch.tensor([d.input_tokens])).logits[0]
    return torch.log_softmax(logits.double(), -1)


# --------------------------------------------------------------------------- the oracle: TRL's GKD
@pytest.fixture(scope="module")
def gkd():
    import trl
    from trl.experimental.gkd import GKDTrainer  # a hard dependency: a missing oracle is a failure

    assert trl.__version__.startswith("1.16"), trl.__version__
    return GKDTrainer.generalized_jsd_loss


def test_full_vocabulary_reverse_kl_equals_trl_gkd_beta_1(pair, gkd):
    """Our loss through the local backend (student) with the teacher's distributions from a
    second backend, against GKD's ``generalized_jsd_loss(beta=1, temperature=1)`` on the same
    samples: the loss and every parameter's gradient to 1e-6."""
    student, teacher = pair
    batch = _sampled_batch(student)
    rows = Batch([Datum(d.input_tokens, d.target_tokens, d.weights) for d in batch.data])
    for d in batch.data:
        d.extra["completion_len"] = len(d.target_tokens)
    attach_teacher(teacher, batch, rows, "full", 0)
    student.model.zero_grad(set_to_none=True)
    ours = student.forward_backward(batch, ReverseKLLoss("full")).result()
    our_grads = {n: p.grad.clone() for n, p in student.model.named_parameters() if p.grad is not None}
    student.model.zero_grad(set_to_none=True)

    # GKD: student logits with gradients, teacher logits without, every row in one sequence
    # (its batchmean is a mean over the labelled tokens, so rows may be concatenated)
    student_logits = torch.cat([_logits(student, d) for d in rows.data], 1)
    with torch.no_grad():
        teacher_logits = torch.cat(
            [teacher.model(input_ids=torch.tensor([d.input_tokens])).logits for d in rows.data], 1
        )
    labels = torch.tensor([[t if w else -100 for d in rows.data for t, w in zip(d.target_tokens, d.weights)]])
    trl_loss = gkd(student_logits, teacher_logits, labels=labels, beta=1.0, temperature=1.0)
    trl_loss.backward()
    trl_grads = {n: p.grad.clone() for n, p in student.model.named_parameters() if p.grad is not None}
    student.model.zero_grad(set_to_none=True)

    diff = max((our_grads[n] - trl_grads[n]).abs().max().item() for n in trl_grads)
    scale = max(g.abs().max().item() for g in trl_grads.values())
    print(f"loss {ours['loss']:.9f} vs GKD {trl_loss.item():.9f}; max |grad diff| {diff:.1e} (max |grad| {scale:.1e})")
    assert trl_loss.item() > 0.05  # two different models: a real divergence
    assert ours["loss"] == pytest.approx(trl_loss.item(), abs=1e-6)
    assert ours["distill/kl_full"] == pytest.approx(trl_loss.item(), abs=1e-6)  # token mean, coef 1
    assert set(our_grads) == set(trl_grads) and scale > 1e-3
    assert diff < 1e-6


def test_top_k_with_the_whole_vocabulary_is_the_full_reverse_kl(pair):
    """A top-k support holding every token (tail bucket empty) is the full-vocabulary KL."""
    student, teacher = pair
    batch = _sampled_batch(student)
    vocab = student.model.config.vocab_size
    values = {}
    for estimator in ("full", "top_k"):
        b = Batch([Datum(d.input_tokens, d.target_tokens, d.weights) for d in batch.data])
        for d in b.data:
            d.extra["completion_len"] = len(d.target_tokens)
        loss = ReverseKLLoss(estimator, top_k=vocab, add_tail=True)
        attach_teacher(teacher, b, Batch(list(b.data)), loss.teacher_needs.input, vocab)
        values[estimator] = student.forward_backward(b, loss).result()["loss"]
        student.model.zero_grad(set_to_none=True)
    assert values["top_k"] == pytest.approx(values["full"], abs=1e-5)


# --------------------------------------------------------------------------- the sampled-token KL by hand
@pytest.mark.parametrize("coef, discount, aggregation", [(1.0, 0.0, "token_mean"), (0.5, 0.9, "sum")])
def test_sampled_reverse_kl_and_advantages_equal_a_hand_computation(pair, coef, discount, aggregation):
    """The stage's ``prepare``: the teacher scores the student's samples; ``distill/teacher_kl``
    is the token mean of ``log p_s - log p_t`` on the sampled tokens and each token's advantage
    is ``-coef * sum_j discount**j (log p_s - log p_t)_{t+j}`` times the normaliser -- both
    computed here from HF forwards of each row through the two models, not the backends."""
    student, teacher = pair
    batch = _sampled_batch(student)
    stage = Distill(teacher="unused", kl={"coef": coef, "discount": discount, "aggregation": aggregation})
    stage.backend, stage.recompute = student, False
    stage.term = kl_term(stage.kl, "kl")
    stage.teacher_model = Teacher(teacher)
    metrics = stage.prepare(None, batch, 0, [])  # type: ignore[arg-type]

    diffs, n_tokens = [], sum(1 for d in batch.data for w in d.weights if w)
    with torch.no_grad():
        for d in batch.data:
            targets = torch.tensor(d.target_tokens).unsqueeze(-1)
            s = _row_logprobs(student.model, d).gather(-1, targets).squeeze(-1)
            t = _row_logprobs(teacher.model, d).gather(-1, targets).squeeze(-1)
            k = [float(si - ti) if w else 0.0 for si, ti, w in zip(s, t, d.weights)]
            diffs += [x for x, w in zip(k, d.weights) if w]
            expect = []
            for i in range(len(k)):  # the return-to-go, written out
                expect.append(-coef * sum(discount**j * k[i + j] for j in range(len(k) - i)))
            norm = 1.0 / n_tokens if aggregation == "token_mean" else 1.0
            expect = [a * norm if w else 0.0 for a, w in zip(expect, d.weights)]
            assert d.advantages == pytest.approx(expect, abs=1e-5)
            for ti, got, w in zip(t.tolist(), d.extra[TEACHER_TOKEN_LOGPROBS], d.weights):
                if w:
                    assert got == pytest.approx(ti, abs=1e-5)
    assert metrics["distill/teacher_kl"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-5)
    assert abs(metrics["distill/teacher_kl"]) > 0.05


def test_discounted_future_sum_is_the_return_to_go():
    x = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    assert discounted_future_sum(x, 0.5).tolist() == [[1 - 1 + 0.125 + 0.375, -2 + 0.25 + 0.75, 0.5 + 1.5, 3.0]]
    assert discounted_future_sum(x, 0.0).tolist() == x.tolist()
    with pytest.raises(ValueError, match="discount"):
        discounted_future_sum(x, 1.5)


# --------------------------------------------------------------------------- the stage learns
ROWS = [{"prompt": f"{a}+{b}=", "answer": "7"} for a in range(10) for b in range(10)]


@pytest.fixture(scope="module")
def teacher_folder(tmp_path_factory) -> str:
    """A tiny teacher that answers 7 to every sum, saved as a Hugging Face folder (what
    ``tempering export`` writes)."""
    b = _backend(5)
    tok = b.tokenizer
    rows = []
    for r in ROWS[::4]:
        ids = tok(r["prompt"] + "7")["input_ids"] + [tok.eos_token_id]
        n = len(tok(r["prompt"])["input_ids"])
        rows.append(Datum(ids[:-1], ids[1:], [0.0] * (n - 1) + [1.0 / 25] * (len(ids) - n)))
    for _ in range(40):
        b.forward_backward(Batch(rows), CrossEntropyLoss()).result()
        b.optim_step(AdamParams(learning_rate=2e-2)).result()
    return b.export_pretrained(str(tmp_path_factory.mktemp("teacher") / "sevens"))


def _recipe(
    tmp_path: Path, name: str, teacher: object, run: dict[str, object] | None = None, **stage: object
) -> Recipe:
    spec = {
        "name": "distill",
        "teacher": teacher,
        "dataset": ROWS,
        "steps": 2,
        "prompts_per_step": 4,
        "group_size": 2,
        "max_tokens": 3,
        "optimizer": {"learning_rate": 1e-2},
        **stage,
    }
    return tiny_recipe(tmp_path, name, spec, SMALL, **(run or {}))


def _kl_rows(result) -> list[float]:
    return [r["distill/teacher_kl"] for r in result.history if "distill/teacher_kl" in r]


@pytest.mark.parametrize("estimator", ["sampled", "full"])
def test_student_learns_the_teachers_preference(tmp_path, teacher_folder, estimator):
    """A fresh student distilled from the sevens teacher: the KL to the teacher on the
    student's own samples falls by a measured factor and the student answers 7; the same run at
    lr 1e-12 stays where it started."""
    stage = {
        "steps": 30,
        "prompts_per_step": 8,
        "group_size": 4,
        "kl": estimator,
        "optimizer": {"learning_rate": 2e-2},
        "eval": {"dataset": ROWS[1::7], "max_tokens": 2},
    }
    learnt = _recipe(tmp_path, f"learn_{estimator}", teacher_folder, **stage).run()
    stage["optimizer"] = {"learning_rate": 1e-12}
    frozen = _recipe(tmp_path, f"frozen_{estimator}", teacher_folder, **stage).run()
    kl, kl_frozen = _kl_rows(learnt), _kl_rows(frozen)
    first, last = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    acc = [r["eval/accuracy"] for r in learnt.history if "eval/accuracy" in r]
    acc_frozen = [r["eval/accuracy"] for r in frozen.history if "eval/accuracy" in r]
    print(
        f"{estimator}: teacher_kl {first:.3f} -> {last:.3f}; frozen {sum(kl_frozen[:3]) / 3:.3f} -> "
        f"{sum(kl_frozen[-3:]) / 3:.3f}; held-out answers 7: {acc[0]:.2f} -> {acc[-1]:.2f} "
        f"(frozen {acc_frozen[-1]:.2f})"
    )
    assert len(kl) == 30 and all(math.isfinite(x) for x in kl)
    assert first > 5.0 and last < first / 20  # measured 14.3 -> about 0 (seed 0, both estimators)
    assert sum(kl_frozen[-3:]) / 3 > 0.8 * sum(kl_frozen[:3]) / 3
    assert acc[0] < 0.2 and acc[-1] >= 0.8 and acc_frozen[-1] < 0.2


# --------------------------------------------------------------------------- where the teacher comes from
def test_teacher_from_a_run_checkpoint_and_from_a_model_plugin(tmp_path, teacher_folder):
    """``{run: folder}`` rebuilds the run's backend at its checkpoint; ``{model: tiny_llama,
    model_kwargs}`` builds a model plugin. The run's policy is scored, not its base: the KL to
    it differs from the KL to the untrained base model."""
    sft_rows = [{"prompt": r["prompt"], "answer": "7"} for r in ROWS]
    Recipe(
        name="teacher_run",
        output_dir=str(tmp_path / "teacher_run"),
        loggers=[],
        backend={"name": "local", "model": "tiny_llama", "model_kwargs": SMALL, "num_threads": 1},
        stages=[{"name": "sft", "dataset": sft_rows, "steps": 20, "optimizer": {"learning_rate": 2e-2}}],
    ).run()
    from_run = _recipe(
        tmp_path, "from_run", {"run": str(tmp_path / "teacher_run")}, kl={"estimator": "top_k", "top_k": 4}
    )
    from_plugin = _recipe(tmp_path, "from_plugin", {"model": "tiny_llama", "model_kwargs": SMALL})
    assert str(tmp_path / "teacher_run") != teacher_folder
    kl_run, kl_plugin = _kl_rows(from_run.run()), _kl_rows(from_plugin.run())
    assert len(kl_run) == len(kl_plugin) == 2
    # the same weights as the student (seed 0, nothing trained yet): KL exactly 0 at step 1
    assert kl_plugin[0] == pytest.approx(0.0, abs=1e-6)
    assert kl_run[0] > 0.5  # the run's trained policy prefers 7; the student does not
    # a string naming a run folder is a run teacher
    assert _kl_rows(_recipe(tmp_path, "run_str", str(tmp_path / "teacher_run")).run())[0] > 0.5


def test_an_interrupted_stage_resumes_with_the_same_teacher(tmp_path, teacher_folder):
    """Stopped after 2 of 4 steps and run again: the teacher is opened again from its folder
    and the resumed steps are the uninterrupted run's, to the last digit of the KL."""
    straight = _kl_rows(_recipe(tmp_path, "straight", teacher_folder, steps=4).run())
    stop = {"max_total_steps": 2, "checkpoint_every": 1}
    first = _kl_rows(_recipe(tmp_path, "resumed", teacher_folder, run=stop, steps=4).run())
    rest = _kl_rows(_recipe(tmp_path, "resumed", teacher_folder, run={"checkpoint_every": 1}, steps=4).run())
    assert len(first) == 2 and len(straight) == 4
    assert first + rest[-2:] == pytest.approx(straight, abs=1e-6)


def test_multi_turn_episodes_are_distilled_on_the_sampled_turns_only(tmp_path):
    """The RL engine's episodes feed distillation as they feed GRPO: the teacher scores each
    episode's whole row and the KL counts the model's turns only (tool answers at weight 0)."""
    chat = {**SMALL, "chat": True, "max_position_embeddings": 256}
    rows = [{"prompt": f"what is {i}+{i}?"} for i in range(4)]
    result = Recipe(
        name="episodes",
        output_dir=str(tmp_path / "episodes"),
        loggers=[],
        backend={"name": "local", "model": "tiny_llama", "model_kwargs": chat, "num_threads": 1},
        stages=[
            {
                "name": "distill",
                "teacher": {"model": "tiny_llama", "model_kwargs": {**chat, "seed": 3}},
                "dataset": rows,
                "steps": 2,
                "prompts_per_step": 2,
                "max_tokens": 4,
                "sampler": {"name": "environment", "environment": TwoTurns, "max_turns": 2},
                "optimizer": {"learning_rate": 1e-2},
            }
        ],
    ).run()
    steps = [r for r in result.history if "loss" in r]
    assert len(steps) == 2
    assert all(abs(r["distill/teacher_kl"]) > 0.01 and math.isfinite(r["loss"]) for r in steps)
    assert all(r["env/turns_mean"] == 2.0 for r in steps)


# --------------------------------------------------------------------------- bad input: one line each
def _error(tmp_path: Path, teacher: object, **stage: object) -> str:
    with pytest.raises(ConfigError) as info:
        _recipe(tmp_path, "bad", teacher, **stage).run()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_missing_teacher_is_one_line(tmp_path):
    message = _error(tmp_path, None)
    assert message.startswith("stages[0].teacher: distillation needs a teacher")


def test_another_tokenizer_is_refused_in_one_line(tmp_path):
    message = _error(tmp_path, {"model": "tiny_llama", "model_kwargs": {**SMALL, "chars": "0123456789+= x"}})
    assert message.startswith("stages[0].teacher.model: the teacher's tokenizer is not the student's")
    assert "1 only the teacher's" in message and "use a teacher of the student's model family" in message


def test_vocab_difference_compares_vocabularies_not_objects(pair):
    student, teacher = pair
    assert student.tokenizer is not teacher.tokenizer
    assert vocab_difference(student.tokenizer, teacher.tokenizer) is None


BAD = [
    ("no/such/folder", {}, "stages[0].teacher.model: 'no/such/folder' is not a registered model builder"),
    ({"model": "tiny_llama", "run": "runs/x"}, {}, "stages[0].teacher: give exactly one of model, run or backend"),
    ({"model": "tiny_llama", "modle_kwargs": {}}, {}, "stages[0].teacher.modle_kwargs: unknown key"),
    ({"run": "no/such/run"}, {}, "stages[0].teacher.run: no such folder 'no/such/run'"),
    ("tinker://run/sampler_weights/x", {}, "stages[0].teacher.model: 'tinker://run/sampler_weights/x' is a weights"),
    ("tiny_llama", {"kl": "fulll"}, "stages[0].kl.estimator: use one of sampled, full, top_k (got 'fulll'). Did you"),
    ("tiny_llama", {"kl": {"estimator": "full"}, "loss": "ppo"}, "stages[0].loss: kl.estimator 'full' is itself"),
    ("tiny_llama", {"kl": {"estimator": "full", "aggregation": "sum"}}, "stages[0].kl.aggregation: sum is for"),
    ("tiny_llama", {"kl": {"discount": 2}}, "stages[0].kl.discount: must be in [0, 1], got 2"),
    ("tiny_llama", {"drop_zero_variance": True}, "stages[0].drop_zero_variance: without a reward"),
]


@pytest.mark.parametrize("teacher, stage, expected", BAD)
def test_bad_keys_are_one_line_at_their_path(tmp_path, teacher, stage, expected):
    assert _error(tmp_path, teacher, **stage).startswith(expected)


def test_no_reward_logs_no_reward_metrics(tmp_path):
    """Without a reward there is nothing to report as reward/accuracy (zeros would read as a
    task failed), and no zero-variance collapse to warn of; with one, both signals train."""
    plain = _recipe(tmp_path, "plain", "tiny_llama").run()
    rows = [r for r in plain.history if "loss" in r]
    assert rows and not any("reward/mean" in r or "groups/zero_variance_frac" in r for r in rows)
    rewarded = _recipe(tmp_path, "rewarded", "tiny_llama", reward="exact_match").run()
    assert all("reward/mean" in r for r in rewarded.history if "loss" in r)
    assert os.path.isdir(tmp_path / "rewarded")


def test_a_reward_stays_required_where_the_stage_has_no_other_signal(tmp_path):
    """``reward: null`` is for a stage whose ``prepare`` brings the signal (distill); GRPO
    without a reward would train on zero advantages, silently: refused in one line."""
    with pytest.raises(ConfigError) as info:
        Recipe(
            name="grpo",
            output_dir=str(tmp_path / "grpo"),
            loggers=[],
            backend={"name": "local", "model": "tiny_llama", "model_kwargs": SMALL, "num_threads": 1},
            stages=[{"name": "grpo", "reward": None, "dataset": ROWS, "steps": 1}],
        ).run()
    assert str(info.value) == "stages[0].reward: grpo learns from a reward; give one (e.g. reward: exact_match)"


def test_tempering_plugins_lists_distill(fresh_registry):
    component = fresh_registry.get("algorithm", "distill")
    assert component.plugin.dist == "tempering" and component.load() is Distill


# --------------------------------------------------------------------------- the examples
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "distill"


def test_the_tiny_examples_run_as_documented(tmp_path, monkeypatch):
    """examples/distill/teacher.yaml, then tiny.yaml reading that run as its teacher (from the
    folder the commands run in), each shortened to a few steps."""
    monkeypatch.chdir(tmp_path)
    Recipe.from_yaml(str(EXAMPLES / "teacher.yaml"), ["stages.sft.steps=20", "stages.sft.eval.every=0"]).run()
    student = Recipe.from_yaml(str(EXAMPLES / "tiny.yaml"), ["stages.distill.steps=2", "stages.distill.eval.every=0"])
    kl = _kl_rows(student.run())
    assert len(kl) == 2 and all(k > 0.5 for k in kl)  # a fresh student, far from a trained teacher


def test_the_smollm2_example_is_valid(monkeypatch):
    """examples/distill/smollm2.yaml's config and data as a run checks them, with the base
    model standing in for its teacher (the export is built by the experiment, not by CI): no
    model is loaded."""
    from tempering.registry import get_registry
    from tempering.training.recipe import RunContext, find_recipe

    monkeypatch.chdir(EXAMPLES.parents[1])
    reg = get_registry()
    cfg = find_recipe(str(EXAMPLES / "smollm2.yaml"), ["stages.distill.teacher=smollm2"]).to_dict()
    reg.check("backend", cfg["backend"], "backend")
    ctx = RunContext(reg, None, cfg, cfg["output_dir"], [], cfg["seed"])
    stage = reg.build("algorithm", {k: v for k, v in cfg["stages"][0].items() if k != "id"}, "stages[0]")
    stage.validate(ctx)
    assert cfg["stages"][0]["kl"] == "sampled" and cfg["backend"]["model"] == "smollm2"
