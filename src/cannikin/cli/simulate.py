"""``cannikin simulate``: every policy on one simulated cluster and workload, same seed."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

from cannikin.log import setup_logging

logger = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate", help="compare DDP, AdaptDL, LB-BSP, Cannikin and an oracle on a "
                         "simulated heterogeneous cluster",
        description=__doc__.splitlines()[0])
    p.add_argument("--cluster", default="paper16",
                   help="cluster TOML file or built-in scenario (default: paper16; "
                        "see --list)")
    p.add_argument("--workload", default="resnet18-cifar10",
                   help="workload name (default: resnet18-cifar10; see --list)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--target-epochs", type=float, default=None, metavar="E",
                   help="override the workload's target (equivalent epochs at the initial "
                        "batch), e.g. for a quick run")
    p.add_argument("--policies", default=None,
                   help="comma-separated subset of ddp,adaptdl,lb-bsp,cannikin,oracle")
    p.add_argument("--max-micro-batches", type=int, default=1, metavar="K",
                   help="passes of at most its memory cap a worker may run per step, "
                        "gradients accumulated (default 1: one pass)")
    p.add_argument("--json", metavar="PATH", help="write per-policy figures as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of batch size and throughput")
    p.add_argument("--list", action="store_true",
                   help="list devices, workloads and scenarios, then exit")
    p.add_argument("--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=run)


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "not reached"
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _listing() -> str:
    from cannikin.sim import SCENARIOS, devices, workloads

    lines = ["devices:"]
    lines += [f"  {d.name:8s} {d.memory_gb:5.0f} GB  {d.relative_speed:4.2f}x V100"
              for d in devices().values()]
    lines.append("workloads:")
    lines += [f"  {name:18s} {w.description}" for name, w in workloads().items()]
    lines.append("scenarios:")
    lines += [f"  {name:18s} {spec.summary()}" for name, spec in SCENARIOS.items()]
    return "\n".join(lines)


def table(summary: dict[str, dict[str, float | None]]) -> str:
    """The comparison as a fixed-width text table."""
    rows = [("policy", "time to target", "vs oracle", "mean step", "mean batch",
             "pred. error")]
    for name, s in summary.items():
        err = s.get("prediction_error_median")
        rows.append((
            name, _fmt_time(s["time_to_target_s"]), _fmt_ratio(s["ratio_to_oracle"]),
            f"{1000 * (s['mean_step_time_s'] or math.nan):.1f} ms",
            f"{s['mean_total_batch'] or 0:.0f}",
            "-" if err is None else f"{100 * err:.1f}%",
        ))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if k == 0 else c.rjust(w)
                       for k, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    setup_logging(0, args.verbose)
    from cannikin.sim import POLICY_NAMES, SimConfig, cluster_from_arg, compare, workload

    if args.list:
        print(_listing())
        return 0
    try:
        spec = cluster_from_arg(args.cluster)
        wl = workload(args.workload)
        if args.target_epochs is not None:
            if not args.target_epochs > 0:
                raise ValueError(f"--target-epochs must be > 0, got {args.target_epochs:g}")
            wl = dataclasses.replace(wl, target_epochs=args.target_epochs)
        policies = (tuple(p.strip() for p in args.policies.split(",") if p.strip())
                    if args.policies else POLICY_NAMES)
        for name in policies:
            if name not in POLICY_NAMES:
                raise ValueError(f"unknown policy {name!r}; known policies: "
                                 f"{', '.join(POLICY_NAMES)}")
        config = SimConfig(seed=args.seed, max_micro_batches=args.max_micro_batches)
        comparison = compare(spec, wl, config, policies)
    except ValueError as exc:
        print(f"cannikin simulate: error: {exc}", file=sys.stderr)
        return 2
    summary = comparison.summary()
    passes = (f", up to {args.max_micro_batches} passes per step"
              if args.max_micro_batches > 1 else "")
    print(f"{wl.name} on {spec.name or args.cluster} ({spec.num_workers} workers: "
          f"{spec.summary()}), seed {args.seed}{passes}")
    print(table(summary))
    if args.json:
        payload: dict[str, Any] = {
            "cluster": spec.name or args.cluster, "cluster_summary": spec.summary(),
            "num_workers": spec.num_workers, "workload": wl.name, "seed": args.seed,
            "max_micro_batches": args.max_micro_batches, **summary,
        }
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n", "utf-8")
    if args.plot:
        from cannikin.sim.plot import plot_comparison

        plot_comparison(comparison, args.plot)
    return 0
