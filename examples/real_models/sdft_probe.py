"""What SDFT's teacher offers the student on SmolLM2: measured, per teacher prompt.

    OMP_NUM_THREADS=1 python examples/real_models/sdft_probe.py [--run runs/smollm2_sdft] [--n 24]

For held-out ``tool_calls`` requests (the ``smollm2_sdft`` recipe's new skill), the model alone
(the student: the request as its user turn) and the model shown the demonstration (the teacher:
``teacher_template`` around the request) score the correct call, and each answers greedily.
Printed per template: the mean log-probability of the correct call (whole call, and its first
token), how often the greedy answer is exactly the call, and -- on the student's own greedy
answer, the tokens SDFT actually scores -- how much of the teacher's mass at the first answer
token lies on the correct first token, and whether that token is inside the student's top-100
(the support of ``topk_logits`` with ``topk_support: student``: a token outside it carries no
teacher signal at all), and how often it is the teacher's most likely first token. ``--run`` loads a run's LoRA adapter (its latest checkpoint) as the
student instead of the base model, to follow the same numbers through training.
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
def greedy(model: Any, tokenizer: Any, prefix: list[int], max_new: int = 16) -> list[int]:
    out = model.generate(torch.tensor([prefix]), max_new_tokens=max_new, do_sample=False)
    new = out[0, len(prefix) :].tolist()
    eos = tokenizer.eos_token_id
    return new[: new.index(eos)] if eos in new else new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=24, help="held-out requests")
    parser.add_argument("--run", help="a run folder: its latest LoRA adapter is the student")
    parser.add_argument("--templates", nargs="+", default=list(TEMPLATES))
    parser.add_argument("--show", action="store_true", help="print each teacher's greedy answer")
    parser.add_argument("--no-greedy", action="store_true", help="log-probabilities only (faster)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = smollm2()
    if args.run:
        model = load_adapter(model, args.run)
    model.eval()
    rows = tool_calls("test", size=args.n, seed=1)
    student = {"lp": [], "lp0": [], "exact": 0}
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
        # the student's own first-token distribution: is the correct first token in its top-100?
        s_first = next_logprobs(model, s_prefix, s_answer[:1] or call[:1])[0]
        in_top = bool((s_first.topk(100).indices == call[0]).any())
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
            rec["mass0"].append(math.exp(t_lp[0, call[0]].item()))
        print(f"student: {tokenizer.decode(s_answer)!r}  want {row['answer']!r}", flush=True)
    n = len(rows)
    print(
        f"\n{'who':14} {'logP(call)':>10} {'P(1st tok)':>10} {'greedy exact':>12} {'1st in student top100':>22} {'teacher top-1 = 1st':>20}"
    )
    print(f"{'student':14} {mean(student['lp']):10.2f} {mean([math.exp(x) for x in student['lp0']]):10.3f} "
          f"{student['exact'] / n:12.2f}")  # fmt: skip
    for name, rec in teachers.items():
        print(f"{'teacher ' + name:14} {mean(rec['lp']):10.2f} {mean(rec['mass0']):10.3f} {rec['exact'] / n:12.2f} "
              f"{rec['in_top100'] / n:22.2f} {rec['top1'] / n:20.2f}")  # fmt: skip


def load_adapter(model: Any, run_dir: str) -> Any:
    """The run's latest checkpoint's LoRA adapter on top of ``model``."""
    import glob
    import os

    from peft import PeftModel

    found = sorted(glob.glob(os.path.join(run_dir, "checkpoints", "*", "**", "adapter_config.json"), recursive=True))
    if not found:
        raise SystemExit(f"{run_dir}: no LoRA adapter under checkpoints/ (adapter_config.json)")
    return PeftModel.from_pretrained(model, os.path.dirname(found[-1]))


if __name__ == "__main__":
    main()
