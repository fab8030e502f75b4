"""Training step time, sharded (FSDP2) vs replicated (DDP) local backend, side by side.

Both sides run on 2 gloo ranks on the CPU (``torchrun --standalone``, launched by this script),
in one process group: each rank builds one ``parallel: ddp`` and one ``parallel: fsdp`` backend
from the same model and seed and the steps alternate between them, so a change in the machine's
load hits both alike. A step is ``forward_backward`` (cross-entropy on the rank's own rows) plus
``optim_step`` (AdamW, gradient clipped at 1.0). Printed: the median step time and IQR of
each side, the ratio fsdp/ddp, and the weights (frozen too) + Adam moments each rank holds
(FSDP keeps ``1/world_size`` of them; what the ratio buys).

On a CPU with gloo the ratio measures FSDP's extra collectives (an all-gather per layer in the
forward and again in the backward, a reduce-scatter per layer) against DDP's one bucketed
all-reduce; on GPUs with NCCL these overlap with compute, here they do not.

Run: ``python benchmarks/fsdp_vs_ddp.py [--steps 10] [--warmup 2] [--rows 16] [--lora]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("TEMPERING_PROGRESS", "0")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps per side")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first")
    p.add_argument("--rows", type=int, default=16, help="rows per rank per step")
    p.add_argument("--nproc", type=int, default=2, help="ranks (gloo processes)")
    p.add_argument("--model-kwargs", default="{}", help="JSON for tiny_llama (default: its 661k-param shape)")
    p.add_argument("--lora", action="store_true", help="LoRA rank 8 instead of full fine-tuning")
    p.add_argument("--out", help=argparse.SUPPRESS)  # set by the launcher for the workers
    return p.parse_args()


def launch(args: argparse.Namespace) -> None:
    """Run this file under torchrun and print the table rank 0 left behind."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(args.nproc),
            __file__,
            *sys.argv[1:],
            "--out",
            out,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1"}
        load_start = os.getloadavg()
        subprocess.run(cmd, env=env, check=True)
        load_end = os.getloadavg()
        with open(out) as f:
            result = json.load(f)
    report(result, args, load_start, load_end)


def rows_for(rank: int, n: int, tokenizer: Any) -> list[Any]:
    from tempering.types import Datum

    out = []
    for i in range(n):
        a, b = 37 * rank + 11 * i, 7 * i + 3
        ids = tokenizer.encode(f"{a}+{b}={a + b}") + [tokenizer.eos_token_id]
        out.append(Datum(ids[:-1], ids[1:], [1.0] * (len(ids) - 1)))
    return out


def held_bytes(backend: Any) -> int:
    """Bytes of all weights (frozen ones too) plus Adam's two moments of the trainable ones on
    this rank: its shard under FSDP, everything under DDP."""

    def local(ps: Any) -> int:
        return sum(t.numel() * t.element_size() for t in (p.to_local() if hasattr(p, "to_local") else p for p in ps))

    return local(backend.model.parameters()) + 2 * local(backend._trainable)


def worker(args: argparse.Namespace) -> None:
    import torch

    from tempering.algorithms.sft.loss import CrossEntropyLoss
    from tempering.plugins.backends.local import distributed
    from tempering.plugins.backends.local.backend import LocalBackend
    from tempering.types import AdamParams, Batch

    assert distributed.init_from_env(), "the launcher runs this under torchrun"
    rank = distributed.rank()
    lora = {"rank": 8} if args.lora else None
    kwargs = json.loads(args.model_kwargs)
    sides = {
        mode: LocalBackend(model_kwargs=kwargs, lora=lora, seed=0, num_threads=1, parallel=mode)
        for mode in ("ddp", "fsdp")
    }
    batch = Batch(rows_for(rank, args.rows, sides["ddp"].tokenizer))
    adam = AdamParams(learning_rate=1e-4, grad_clip_norm=1.0)
    times: dict[str, list[float]] = {mode: [] for mode in sides}
    for step in range(args.warmup + args.steps):
        for mode, backend in sides.items():
            distributed.barrier()
            start = time.perf_counter()
            backend.forward_backward(batch, CrossEntropyLoss()).result()
            backend.optim_step(adam).result()
            distributed.barrier()  # a step ends when the slowest rank is done
            if step >= args.warmup:
                times[mode].append(time.perf_counter() - start)
    held = {mode: held_bytes(b) for mode, b in sides.items()}
    params = sum(p.numel() for p in sides["ddp"].model.parameters())
    for backend in sides.values():
        backend.close()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times, "held": held, "params": params, "world": distributed.world_size()}, f)
    distributed.barrier()
    torch.distributed.destroy_process_group()


def report(result: dict[str, Any], args: argparse.Namespace, load_start: tuple, load_end: tuple) -> None:
    def stats(xs: list[float]) -> tuple[float, float]:
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        return statistics.median(xs), q[2] - q[0]

    kind = "LoRA r=8" if args.lora else "full fine-tuning"
    print(
        f"\n{result['world']} gloo ranks, tiny_llama {result['params']:,} params, {kind}, "
        f"{args.rows} rows/rank, {args.steps} steps per side after {args.warmup} warmup"
    )
    print(f"{'':6} {'median ms':>10} {'IQR ms':>8} {'weights+Adam held per rank':>28}")
    med = {}
    for mode in ("ddp", "fsdp"):
        med[mode], iqr = stats(result["times"][mode])
        print(f"{mode:6} {1e3 * med[mode]:10.1f} {1e3 * iqr:8.1f} {result['held'][mode] / 2**20:24.2f} MiB")
    print(
        f"ratio fsdp/ddp step time: {med['fsdp'] / med['ddp']:.2f}x; "
        f"memory held fsdp/ddp: {result['held']['fsdp'] / result['held']['ddp']:.2f}x"
    )
    print(
        f"load average (1/5/15 min) at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}, "
        f"at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}"
    )


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.out:
        worker(arguments)
    else:
        launch(arguments)
