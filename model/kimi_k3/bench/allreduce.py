"""The floor of a decode all-reduce on this machine's GPUs: one row-parallel output of K3 ([tokens, 7168] bf16, what
every attention o_proj and MoE down projection of a TP rank sums) reduced over TP ranks, timed as a decode step
runs it: 8 all-reduces back to back in one CUDA graph, replay time / 8 after an L2 flush, every rank alike.

    python3 -m model.kimi_k3.bench.allreduce --tp 2 --batch 1,2,4,8,16 [--json FILE]

Two implementations per size: NCCL (`torch.distributed.all_reduce`, what the TP path runs) and PyTorch's symmetric
memory one-shot all-reduce (`torch.ops.symm_mem.one_shot_all_reduce`: each rank reads every peer's buffer over
NVLink and sums; no multicast, which stays off: `distributed.MULTICAST_OFF`), each in its own TP group, so that
where the second is missing or fails, one row says why and the NCCL rows stand. Its numbers are the floor in
`model/kimi_k3/specialized/oproj_allreduce/NOTES.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from kernels.timing import time_pipeline

from ..distributed import run_tp, tp_backend
from ..parallel import TP
from .run import BenchError, batch_points

HIDDEN = 7168
CALLS_PER_GRAPH = 8


def _nccl(tp: TP, x: torch.Tensor):
    """One NCCL all-reduce of `x` in place: (closure, its result after one eager call)."""
    def fn() -> torch.Tensor:
        dist.all_reduce(x, group=tp.group)
        return x

    return fn, fn().clone()


def _symm_mem_one_shot(tp: TP, x: torch.Tensor):
    """One one-shot all-reduce of a symmetric-memory copy of `x`: (closure, its result after one eager call)."""
    import torch.distributed._symmetric_memory as symm_mem

    buf = symm_mem.empty(*x.shape, dtype=x.dtype, device=x.device)
    symm_mem.rendezvous(buf, tp.group.group_name)
    buf.copy_(x)

    def fn() -> torch.Tensor:
        return torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", tp.group.group_name)

    return fn, fn().clone()


IMPLS = {"nccl": _nccl, "symm_mem_one_shot": _symm_mem_one_shot}


def allreduce_on_rank(tp: TP, device: torch.device, impl: str, batches: list[int], iters: int) -> list[dict]:
    """Rows {impl, tp, tokens, bytes, us, us_q1, us_q3, ranks_us, correct} of one implementation at every size;
    `us` and its quartiles are the slowest rank's."""
    rows = []
    for tokens in batches:
        xs = [torch.full((tokens, HIDDEN), tp.rank + 1.0, dtype=torch.bfloat16, device=device)
              for _ in range(CALLS_PER_GRAPH)]
        made = [IMPLS[impl](tp, x) for x in xs]
        correct = all(bool((out == tp.size * (tp.size + 1) / 2).all()) for _, out in made)
        timing = time_pipeline([fn for fn, _ in made], iters=iters)
        times: list = [None] * tp.size
        dist.all_gather_object(times, (timing.median_us, timing.q1_us, timing.q3_us), group=tp.group)
        us, q1, q3 = max(times)
        rows.append({"impl": impl, "tp": tp.size, "tokens": tokens, "bytes": tokens * HIDDEN * 2, "us": us,
                     "us_q1": q1, "us_q3": q3, "ranks_us": [t[0] for t in times], "correct": correct})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m model.kimi_k3.bench.allreduce", description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="ranks, one GPU each (default 2)")
    p.add_argument("--batch", default="1,2,4,8,16", help="tokens per all-reduce (default 1,2,4,8,16)")
    p.add_argument("--iters", type=int, default=200, help="timed replays per size (default 200)")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the rows as JSON to FILE")
    args = p.parse_args(argv)
    try:
        batches = batch_points(args.batch)
        if args.tp < 2:
            raise BenchError("--tp: an all-reduce needs at least 2 ranks")
        tp_backend("cuda", args.tp)
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = []
    for impl in IMPLS:  # one group each: a failing implementation cannot take the other's rows with it
        try:
            rows += run_tp(allreduce_on_rank, args.tp, impl, batches, args.iters, device="cuda", timeout=300)
        except Exception as e:  # noqa: BLE001 - e.g. symmetric memory missing from this torch: a row that says so
            rows.append({"impl": impl, "tp": args.tp, "error": f"{type(e).__name__}: {e}".splitlines()[0]})
    for r in rows:
        if "error" in r:
            print(f"TP{r['tp']} {r['impl']:>18}: {r['error']}")
            continue
        ranks = ", ".join(f"{t:.1f}" for t in r["ranks_us"])
        print(f"TP{r['tp']} {r['impl']:>18} {r['tokens']:>3} tokens {r['bytes'] / 1e3:>6.1f} kB: {r['us']:.1f} µs "
              f"(IQR {r['us_q1']:.1f}-{r['us_q3']:.1f}; ranks {ranks}){'' if r['correct'] else ' WRONG SUM'}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
