"""Peak memory and time of one training forward + backward: the local backend's lean path vs the
full float32 log-softmax path it replaced, against sequence length and vocabulary.

One measured call is one ``forward_backward`` of the GRPO loss (dapo, beta 0) on ``--rows`` rows
of ``T`` tokens, split like RL: a prompt of ``(1 - f) T`` tokens (weight 0) and a completion of
``f T`` (weight 1, advantages +-1), ``f = --completion``. Two paths, alternating, same model and
batch:

* ``old``: the code before this change, re-created here -- the model's logits at every
  position, ``torch.log_softmax(logits.float(), -1)`` gathered at the targets (kept for
  backward), then the loss and ``backward`` (``tests/test_forward_memory.py`` checks that the
  two paths give bitwise the same logprobs and gradients);
* ``new``: ``LocalBackend.forward_backward``: the LM head only at the completion positions
  (``logits_to_keep``), target log-probs one chunk of positions at a time.

Models (random token ids; what matters is the shapes):

* ``smollm2``: SmolLM2-135M-Instruct, the real weights (``tempering install-model smollm2``):
  hidden 576, vocabulary 49,152, tied embeddings, and by default only its first 4 of 30 layers
  (``--smollm2-layers``): the head's cost is the real one, the body's is 4/30 of it, so a
  4,096-token call takes under a minute on 2 cores -- and the head's share of the step, so the
  saving, is larger than in the whole model (``--smollm2-layers 30`` measures that);
* ``qwen3``: ``tiny_qwen3`` (a Qwen3 with the real 151,669-token vocabulary, tied embeddings)
  at ``--qwen3-hidden`` (default 128; Qwen3-0.6B has 1024, so its head matmul costs 8x more
  there, and the time ratio here overstates the saving; the memory ratio does not depend on it).

Peak memory on the CPU: the peak resident set size during the call (``VmHWM``, reset through
``/proc/self/clear_refs`` right before it) minus the resident size just before; glibc's mmap
threshold is pinned at 64 KiB and the heap trimmed before each call, so that memory freed by
an earlier call is not reused without showing. On CUDA:
``torch.cuda.max_memory_allocated`` minus the allocated memory before the call. Parameter
gradients are freed after every call, so each call's peak includes allocating them (both paths
alike). Time on the CPU is the process's CPU time (all threads, ``time.process_time``): on a
shared machine wall time varies 3x from call to call, CPU time far less; wall medians are in
``--json``. On CUDA it is wall time.

Run: ``python benchmarks/forward_memory.py [--lengths 256 1024 4096] [--rows 1]
[--completion 0.25] [--repeats 1] [--threads 2] [--models smollm2 qwen3] [--smollm2-layers 4]
[--qwen3-hidden 128] [--lora RANK] [--max-gb 6] [--device cpu|cuda] [--dtype float32|bfloat16]
[--json FILE]``. The old path is skipped (and said so) where it would need more than ``--max-gb``:
at 4,096 tokens and a 152k vocabulary it needs ~10 GiB for one row.
The defaults take about 4 minutes on 2 busy cores. The tables are in ``docs/real-models.md``
(section "The training forward: memory and speed").
The load average is printed: on a shared machine times are noisy, memory is not.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

os.environ.setdefault("TEMPERING_PROGRESS", "0")


# ---------------------------------------------------------------------------- memory
def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024  # type: ignore[union-attr]


def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: RSS still measures, a little less exactly
        return None


LIBC = _libc()


def pin_mmap_threshold() -> None:
    """glibc: allocations >= 64 KiB are mmapped and unmapped on free (M_MMAP_THRESHOLD = -3),
    so the resident size follows the live tensors instead of a heap that keeps freed memory."""
    if LIBC is not None:
        LIBC.mallopt(-3, 64 << 10)


def measure(fn: Callable[[], Any], device: torch.device) -> tuple[float, float, int]:
    """Wall seconds, CPU seconds (this process, all threads) and peak bytes above the memory in
    use before ``fn()``."""
    gc.collect()
    if LIBC is not None:
        LIBC.malloc_trim(0)  # give the heap's free pages back, so reusing them shows as growth
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS
        base = _status("VmRSS")
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else _status("VmHWM")
    return wall, cpu, peak - base


# ---------------------------------------------------------------------------- the two paths
def old_forward_backward(backend: Any, batch: Any, loss: Any) -> None:
    """The replaced ``LocalBackend._forward_backward``: the head at every position, the float32
    log-softmax over the whole vocabulary kept for backward."""
    tensors = batch.to_tensors(backend.pad_token_id, device=backend.device)
    backend.model.train()
    logits = backend.model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"]).logits
    lp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tensors["target_ids"].unsqueeze(-1)).squeeze(-1)
    loss(lp, tensors).loss.backward()


def new_forward_backward(backend: Any, batch: Any, loss: Any) -> None:
    backend._forward_backward(batch, loss)


def rl_batch(rows: int, length: int, completion: float, vocab: int, seed: int) -> Any:
    """``rows`` rows of ``length`` random tokens: prompt weight 0, completion weight 1. Row i's
    prompt is i tokens shorter than row 0's, as in a ragged RL batch."""
    from tempering.types import Batch, Datum

    gen = torch.Generator().manual_seed(seed)
    data = []
    for i in range(rows):
        n_completion = max(1, round(completion * length))
        n_prompt = max(1, length - n_completion - i)
        ids = torch.randint(0, vocab, (n_prompt + n_completion,), generator=gen).tolist()
        # target t predicts token t + 1: the completion's tokens are targets n_prompt - 1 onwards
        w = [0.0] * (n_prompt - 1) + [1.0] * n_completion
        lps = [-1.0 if x else 0.0 for x in w]
        adv = [(1.0 if i % 2 else -1.0) if x else 0.0 for x in w]
        data.append(Datum(ids[:-1], ids[1:], w, lps, adv))
    return Batch(data)


# ---------------------------------------------------------------------------- models
def build_backend(name: str, args: argparse.Namespace) -> Any:
    from tempering.plugins.backends.local.backend import LocalBackend

    lora = {"rank": args.lora, "alpha": 2 * args.lora} if args.lora else None
    common = {"lora": lora, "device": args.device, "dtype": args.dtype, "num_threads": args.threads, "threaded": False}
    if name == "qwen3":
        return LocalBackend(
            model="tiny_qwen3",
            model_kwargs={
                "hidden_size": args.qwen3_hidden,
                "intermediate_size": 2 * args.qwen3_hidden,
                "max_position_embeddings": 8192,
            },
            **common,
        )
    if name == "smollm2":
        from tempering.plugins.models.smollm2 import smollm2

        def truncated(seed: int = 0) -> tuple[Any, Any]:
            model, tokenizer = smollm2()
            model.model.layers = model.model.layers[: args.smollm2_layers]
            model.config.num_hidden_layers = len(model.model.layers)
            return model, tokenizer

        return LocalBackend(model="smollm2", model_builder=truncated, **common)
    raise SystemExit(f"unknown model {name!r}: choose smollm2 or qwen3")


def describe(backend: Any) -> str:
    cfg = backend.model.config
    cfg = getattr(cfg, "text_config", cfg)
    n = sum(p.numel() for p in backend.model.parameters()) / 1e6
    return (
        f"{cfg.model_type}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}, {n:.1f}M params"
    )


# ---------------------------------------------------------------------------- main
def cells(row: dict[str, Any], markdown: bool = False) -> Any:
    """The peak and time columns of one result (the old path's as skipped when it was)."""
    mib = 2**20
    if "old_peak" in row:
        old_peak, old_s = f"{row['old_peak'] / mib:,.0f} MiB", f"{row['old_s']:.2f} s"
        peak_ratio, time_ratio = f"{row['new_peak'] / row['old_peak']:.2f}", f"{row['new_s'] / row['old_s']:.2f}"
    else:
        old_peak, old_s = f"skipped (~{row['old_estimate_gib']:.0f} GiB > --max-gb)", "-"
        peak_ratio = time_ratio = "-"
    new_peak, new_s = f"{row['new_peak'] / mib:,.0f} MiB", f"{row['new_s']:.2f} s"
    if markdown:
        return [old_peak, new_peak, f"**{peak_ratio}**", old_s, new_s, f"**{time_ratio}**"]
    if "old_peak" not in row:
        return f"peak {new_peak}, time {new_s} (old path {old_peak})"
    return f"peak {old_peak} -> {new_peak} ({peak_ratio}x), time {old_s} -> {new_s} ({time_ratio}x)"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["smollm2", "qwen3"])
    p.add_argument("--lengths", nargs="+", type=int, default=[256, 1024, 4096], help="tokens per row (T)")
    p.add_argument("--rows", type=int, default=1, help="rows per call (memory grows linearly for both paths)")
    p.add_argument("--completion", type=float, default=0.25, help="completion share of each row")
    p.add_argument("--repeats", type=int, default=1, help="measured calls per path and length (alternating)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smollm2-layers", type=int, default=4, help="keep SmolLM2's first N of 30 layers")
    p.add_argument("--qwen3-hidden", type=int, default=128, help="tiny_qwen3's width (Qwen3-0.6B: 1024)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument(
        "--max-gb",
        type=float,
        default=6.0,
        help="skip the old path where its float32 (rows, T, V) tensors would need more (GiB)",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import warnings

    from transformers.utils import logging as hf_logging

    from tempering.algorithms.grpo.loss import GRPOLoss

    warnings.filterwarnings("ignore")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    pin_mmap_threshold()
    device = torch.device(args.device)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    loss = GRPOLoss(loss_type="dapo", beta=0.0)
    paths = {"old": old_forward_backward, "new": new_forward_backward}
    results: list[dict[str, Any]] = []
    for name in args.models:
        backend = build_backend(name, args)
        vocab = backend.model.config.vocab_size
        print(
            f"{name}: {describe(backend)}; {args.dtype}, {args.device}, "
            f"{'LoRA r=' + str(args.lora) if args.lora else 'full FT'}",
            flush=True,
        )
        for j, length in enumerate(args.lengths):
            batch = rl_batch(args.rows, length, args.completion, vocab, seed=length)
            # the old path holds ~4 float32 (rows, T, V) tensors at once (logits, log-softmax, their gradients)
            old_estimate = 4 * 4 * args.rows * length * vocab / 2**30
            todo = [k for k in paths if k == "new" or old_estimate <= args.max_gb]
            runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in todo}
            for i in range(args.repeats + (j == 0)):  # one warmup round, at the first length
                for path in todo if i % 2 == 0 else reversed(todo):
                    measured = measure(functools.partial(paths[path], backend, batch, loss), device)
                    backend.model.zero_grad(set_to_none=True)
                    if i or j:
                        runs[path].append(measured)
            row: dict[str, Any] = {
                "model": name,
                "vocab": vocab,
                "T": length,
                "rows": args.rows,
                "old_estimate_gib": old_estimate,
            }
            for path, values in runs.items():
                row[f"{path}_wall"] = statistics.median(w for w, _, _ in values)
                row[f"{path}_s"] = statistics.median(c if device.type == "cpu" else w for w, c, _ in values)
                row[f"{path}_peak"] = max(m for _, _, m in values)
            results.append(row)
            print(f"  T={length:5d}: {cells(row)}", flush=True)
        backend.close()
        del backend
        gc.collect()
    load_end = os.getloadavg()

    print()
    cpu_time = "CPU time of this process (all threads): steadier than wall time on a shared machine"
    print(
        f"torch {torch.__version__}, {args.threads} thread(s), {os.cpu_count()} CPUs; rows {args.rows}, "
        f"completion {args.completion:.0%} of each row; medians of {args.repeats} calls, peak = max; time = "
        f"{cpu_time if device.type == 'cpu' else 'wall'}"
    )
    print(
        f"load average (1/5/15 min) at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
        f"at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}; whole run {time.perf_counter() - t_start:.0f} s"
    )
    print()
    print("| model | vocab | T | peak old | peak new | new/old | time old | time new | new/old |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(f"| {r['model']} | {r['vocab']:,} | {r['T']} | " + " | ".join(cells(r, markdown=True)) + " |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(
                {"args": vars(args), "load_start": load_start, "load_end": load_end, "results": results}, fh, indent=2
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
