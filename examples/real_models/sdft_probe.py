"""What SDFT's teacher offers the student on SmolLM2: measured, per teacher prompt.

    OMP_NUM_THREADS=1 python examples/real_models/sdft_probe.py [--n 24] [--no-greedy] [--templates ...]

For held-out ``tool_calls`` requests (the ``smollm2_sdft`` recipe's new skill), the model alone
(the student: the request as its user turn) and the model shown the demonstration (the teacher:
``teacher_template`` around the request) score the correct call, and each answers greedily.
Printed per template: the mean log-probability of the correct call (whole call) and the mean
probability of its first token, how often the greedy answer is exactly the call, whether that
first token is inside the student's top-100 (the support of ``topk_logits`` with
``topk_support: student``: a token outside it carries no teacher signal at all) and how often it
is the teacher's most likely first token. Then, for one teacher (``--push``), how hard each SDFT
loss pushes the student's logit of that first token (``-dL/dz`` at the first answer position,
where the answer's format is decided). The base model is both; through training the same
numbers are the stage's ``demonstration_metrics`` (``sdft/demo_*`` in metrics.jsonl).
"""

from __future__ import annotations

import argparse
import math
from statistics import mean
from typing import Any

import torch

from tempering.algorithms.sdft.algorithm import DEFAULT_TEACHER_TEMPLATE, teacher_prompt
from tempering.plugins.datasets.tool_calls import tool_calls
from tempering.plugins.models.smollm2 import smollm2
from tempering.rlmath.divergence import full_logits_loss, topk_logits_loss

#: SDFT losses compared on the push they give the call's first token (``--push``): name -> loss
#: of (student logits, teacher log-probabilities) at one position.
LOSSES = {
    "top-100 student support, JSD (the default)": lambda s, t: topk_logits_loss(s, 0.5, 100, teacher_logits=t),
    "top-20 teacher support + tail, JSD": lambda s, t: topk_logits_loss(
        s, 0.5, 20, True, teacher_topk_logprobs=t.topk(20).values, teacher_topk_ids=t.topk(20).indices
    ),
    "top-20 teacher support + tail, forward KL": lambda s, t: topk_logits_loss(
        s, 0.0, 20, True, teacher_topk_logprobs=t.topk(20).values, teacher_topk_ids=t.topk(20).indices
    ),
    "full vocabulary, JSD": lambda s, t: full_logits_loss(s, t, 0.5),
    "full vocabulary, forward KL": lambda s, t: full_logits_loss(s, t, 0.0),
    "full vocabulary, reverse KL": lambda s, t: full_logits_loss(s, t, 1.0),
}


def first_token_push(student_logits: torch.Tensor, teacher_logp: torch.Tensor, token: int) -> dict[str, float]:
    """``-d loss / d z[token]`` for each of :data:`LOSSES` at one position: how hard one loss
    step raises the student's logit of ``token`` (0: the loss does not see it)."""
    out = {}
    for name, loss in LOSSES.items():
        z = student_logits.detach().clone().requires_grad_(True)
        (grad,) = torch.autograd.grad(loss(z, teacher_logp), z)
        out[name] = -float(grad[token])
    return out


TEMPLATES = {
    "paper": DEFAULT_TEACHER_TEMPLATE,
    "trl": "{prompt}\n\n{demonstration}",
    "like_this": "{prompt} Reply with the call only, like this: {demonstration}",
    "example_first": "Example answer: {demonstration}\n{prompt}",
    "copy": "{prompt}\nThe correct answer is: {demonstration}\nReply with exactly that answer.",
    # the demonstration as the model's own earlier answer to the same request (two turns), the
    # request asked again through the template
    "earlier_turn": "{prompt}",
    "earlier_turn_same": "{prompt} Answer the same way as before.",
}


def teacher_messages(name: str, prompt: str, demonstration: str) -> str | list[dict[str, str]]:
    if name.startswith("earlier_turn"):
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": demonstration},
            {"role": "user", "content": teacher_prompt(TEMPLATES[name], prompt, demonstration)},
        ]
    return teacher_prompt(TEMPLATES[name], prompt, demonstration)


def encode(tokenizer: Any, text: str | list[dict[str, str]]) -> list[int]:
    messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@torch.no_grad()
def next_logprobs(model: Any, prefix: list[int], continuation: list[int]) -> torch.Tensor:
    """Log-distributions over the next token at each continuation position, ``(len(cont), V)``."""
    ids = torch.tensor([prefix + continuation])
    logits = model(ids).logits[0, len(prefix) - 1 : len(prefix) - 1 + len(continuation)]
    return torch.log_softmax(logits.float(), -1)


@torch.no_grad()
def next_logits(model: Any, prefix: list[int]) -> torch.Tensor:
    """The logits of the first answer token, ``(V,)``."""
    return model(torch.tensor([prefix])).logits[0, -1].float()


@torch.no_grad()
def greedy(model: Any, tokenizer: Any, prefix: list[int], max_new: int = 16) -> list[int]:
    out = model.generate(torch.tensor([prefix]), max_new_tokens=max_new, do_sample=False)
    new = out[0, len(prefix) :].tolist()
    eos = tokenizer.eos_token_id
    return new[: new.index(eos)] if eos in new else new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=24, help="held-out requests")
    parser.add_argument("--templates", nargs="+", default=list(TEMPLATES))
    parser.add_argument("--show", action="store_true", help="print each teacher's greedy answer")
    parser.add_argument("--no-greedy", action="store_true", help="log-probabilities only (faster)")
    parser.add_argument("--push", default="earlier_turn", help="the template whose teacher the losses are compared on")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = smollm2()
    model.eval()
    rows = tool_calls("test", size=args.n, seed=1)
    student = {"lp": [], "lp0": [], "exact": 0}
    push: dict[str, list[float]] = {}
    teachers: dict[str, dict[str, Any]] = {
        t: {"lp": [], "lp0": [], "exact": 0, "mass0": [], "in_top100": 0, "top1": 0} for t in args.templates
    }
    for row in rows:
        call = tokenizer.encode(row["demonstration"], add_special_tokens=False)
        s_prefix = encode(tokenizer, row["prompt"])
        s_lp = next_logprobs(model, s_prefix, call)
        student["lp"].append(s_lp.gather(-1, torch.tensor(call)[:, None]).sum().item())
        student["lp0"].append(s_lp[0, call[0]].item())
        s_answer = [] if args.no_greedy else greedy(model, tokenizer, s_prefix)
        student["exact"] += tokenizer.decode(s_answer).strip() == row["answer"]
        s_logits0 = next_logits(model, s_prefix)
        in_top = bool((s_logits0.topk(100).indices == call[0]).any())
        for name in args.templates:
            t_prefix = encode(tokenizer, teacher_messages(name, row["prompt"], row["demonstration"]))
            t_lp = next_logprobs(model, t_prefix, call)
            rec = teachers[name]
            rec["lp"].append(t_lp.gather(-1, torch.tensor(call)[:, None]).sum().item())
            rec["lp0"].append(t_lp[0, call[0]].item())
            t_answer = "" if args.no_greedy else tokenizer.decode(greedy(model, tokenizer, t_prefix)).strip()
            rec["exact"] += t_answer == row["answer"]
            if args.show:
                print(f"  teacher {name}: {t_answer!r}")
            rec["in_top100"] += in_top
            rec["top1"] += int(t_lp[0].argmax()) == call[0]
            if name == args.push:
                for key, value in first_token_push(s_logits0, t_lp[0], call[0]).items():
                    push.setdefault(key, []).append(value)
            rec["mass0"].append(math.exp(t_lp[0, call[0]].item()))
        print(f"student: {tokenizer.decode(s_answer)!r}  want {row['answer']!r}", flush=True)
    n = len(rows)
    header = f"{'who':14} {'logP(call)':>10} {'P(1st tok)':>10} {'greedy exact':>12}"
    print(f"\n{header} {'1st in student top100':>22} {'teacher top-1 = 1st':>20}")
    print(f"{'student':14} {mean(student['lp']):10.2f} {mean([math.exp(x) for x in student['lp0']]):10.3f} "
          f"{student['exact'] / n:12.2f}")  # fmt: skip
    for name, rec in teachers.items():
        print(f"{'teacher ' + name:14} {mean(rec['lp']):10.2f} {mean(rec['mass0']):10.3f} {rec['exact'] / n:12.2f} "
              f"{rec['in_top100'] / n:22.2f} {rec['top1'] / n:20.2f}")  # fmt: skip
    if push:
        print(f"\npush on the call's first token (-dL/dz, teacher {args.push}; mean over requests):")
        for key, values in push.items():
            print(f"  {key:44} {mean(values):.2e}")


if __name__ == "__main__":
    main()
