"""``cannikin plan``: the optimal split of a total batch over a described cluster.

A worker may be planned 0 samples when the step is faster so; one that still slows the
step at 0 (its fixed time, its share of the all-reduce) is named, with the step time the
planner's model predicts without it. With ``--max-micro-batches K`` a worker's share may
exceed its memory cap, in up to K passes of at most the cap (gradient accumulation).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from cannikin.log import setup_logging

SHOW_COSTLY = 8
"""Workers named in the what-if lines at most; ``--json`` lists them all."""


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "plan", help="print the optimal split of a batch for a cluster description",
        description=__doc__.splitlines()[0])
    p.add_argument("--cluster", required=True,
                   help="cluster TOML file (same format as `cannikin simulate`) or a "
                        "built-in scenario name")
    p.add_argument("--batch", type=int, required=True, help="total batch size to split")
    p.add_argument("--workload", default="resnet50-imagenet",
                   help="workload whose profile sets each device's speed "
                        "(default: resnet50-imagenet)")
    p.add_argument("--max-micro-batches", type=int, default=1, metavar="K",
                   help="passes of at most its memory cap a worker may run per step, "
                        "gradients accumulated (default 1: one pass)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    setup_logging(0, False)
    import numpy as np

    from cannikin.optperf import costly_workers, share_split, zero_split
    from cannikin.perf import micro_batches
    from cannikin.sim import GroundTruth, cluster_from_arg, device, workload

    try:
        if args.max_micro_batches < 1:
            raise ValueError(f"--max-micro-batches {args.max_micro_batches} must be >= 1 "
                             f"(1: one pass per step)")
        spec = cluster_from_arg(args.cluster)
        wl = workload(args.workload)
        truth = GroundTruth(spec, wl, max_micro_batches=args.max_micro_batches)
        caps = truth.max_local_batch
        room = truth.max_share
        if not spec.num_workers <= args.batch <= room.sum():
            hint = ("" if args.max_micro_batches > 1 else
                    "; --max-micro-batches K lets each worker run K passes of its cap")
            raise ValueError(f"--batch {args.batch} does not fit: it must be between the "
                             f"worker count {spec.num_workers} and {int(room.sum())}, the "
                             f"total memory cap for {wl.name} times "
                             f"{args.max_micro_batches} passes{hint}")
        even = np.array(share_split(args.batch, np.ones(spec.num_workers), room.tolist(),
                                    minimum=1))
        cluster, plan = truth.linearised_plan(lambda c: zero_split(c, args.batch), even)
        costly = costly_workers(cluster, plan)
    except ValueError as exc:
        print(f"cannikin plan: error: {exc}", file=sys.stderr)
        return 2
    split = np.array(plan.local_batches)
    print(f"{wl.name}, total batch {args.batch}, on {spec.num_workers} workers "
          f"({spec.summary()})")
    passes = [micro_batches(int(b), int(cap) if args.max_micro_batches > 1 else None)
              for b, cap in zip(split, caps, strict=True)]
    print(f"{'worker':>6}  {'device':8}  {'local batch':>11}  {'memory cap':>10}  "
          f"{'passes':>6}  {'compute (ms)':>12}")
    for i, node in enumerate(cluster.nodes):
        b = int(split[i])
        compute = sum(node.forward_time(m) + node.backward_time(m) for m in passes[i])
        print(f"{i:>6}  {device(spec.devices[i]).name:8}  {b:>11}  {int(caps[i]):>10}  "
              f"{len(passes[i]):>6}  {1000 * compute:>12.1f}")
    even_time = truth.expected_step_time(even)
    opt_time = truth.expected_step_time(split)
    print(f"predicted step time: {1000 * plan.step_time:.1f} ms "
          f"(planner model; simulator ground truth {1000 * opt_time:.1f} ms, "
          f"even split {1000 * even_time:.1f} ms, {even_time / opt_time:.2f}x slower)")
    for worker in costly[:SHOW_COSTLY]:
        print(f"worker {worker.rank} ({device(spec.devices[worker.rank]).name}) gets 0 samples "
              f"and still costs {1000 * worker.cost_s:.1f} ms per step (its fixed time or its "
              f"all-reduce share): without it {1000 * worker.without_step_time:.1f} ms, "
              f"{worker.speedup:.2f}x faster (planner model, all-reduce as a ring of "
              f"{spec.num_workers - 1})")
    if len(costly) > SHOW_COSTLY:
        print(f"... and {len(costly) - SHOW_COSTLY} more such workers (all in --json)")
    if args.json:
        payload = {"workload": wl.name, "total_batch": args.batch,
                   "devices": [device(d).name for d in spec.devices],
                   "local_batches": [int(b) for b in split],
                   "micro_batches": [list(p) for p in passes],
                   "predicted_step_time_s": plan.step_time,
                   "simulated_step_time_s": opt_time, "even_split_step_time_s": even_time,
                   "costly_workers": [{"worker": w.rank, "cost_s": w.cost_s,
                                       "step_time_without_s": w.without_step_time,
                                       "speedup_without": w.speedup} for w in costly]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n", "utf-8")
    return 0
