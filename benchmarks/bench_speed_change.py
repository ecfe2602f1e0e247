"""A change of speed while the job runs, on CPU-quota workers (real, no emulation).

The setting of ``bench_real.py``: three gloo workers on quotas 1, 0.5 and 0.25 of a core,
MLP 64-1024-1024-10 on the digits, B = 480, Cannikin alone. After ``--change-at`` steps the
fastest and the slowest worker swap their quotas (``quota.change_share``: 0.25, 0.5, 1), as
on a shared node whose neighbour's job ends while another's starts. The cluster after the
swap is the one before with its ranks reversed, so Cannikin's own settled step before the
swap is what it should come back to; and the slowest worker before the swap is the one
Cannikin gave 0 samples, which only a measurement at work shows faster (a probe,
``PlannerConfig.refresh_after``).

Each launch runs one variant: the defaults, and ``refresh_after=None``. Printed per
variant: the mean step and the split in windows of ``--window`` steps, the re-plans that
were not on the cadence, the steps from the swap until the former slowest worker is
planned half its even share or more, and the mean step of the last ``--window`` * 4
steps over the settled mean before the swap. Last, in interleaved blocks after the run:
Cannikin against plain DDP at Cannikin's split at the end, at its split before the swap
reversed (the best split it had found, mirrored) and at the even split, with its model's
prediction of the two splits.

Run: ``python benchmarks/bench_speed_change.py [--change-at 400] [--steps 1400]`` (root
with a writable cgroup cpu controller; elsewhere it exits 2 naming the emulated fallback).
Figures only, no asserts on timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_real  # noqa: E402

AFTER = tuple(reversed(bench_real.SHARES))
"""The quotas after the swap: the fastest and the slowest worker trade places."""
VARIANTS = ("refresh_after=500 (default)", "refresh_after=None")


def _worker(out: Path, steps: int, change_at: int, refresh: bool, rounds: int,
            block_steps: int) -> None:
    import torch
    import torch.distributed as dist

    from cannikin.runtime import init_distributed
    from cannikin.runtime.quota import change_share, join_from_env

    x_all, y_all = bench_real.digits()
    rank = int(os.environ["RANK"])
    join_from_env(rank)
    torch.set_num_threads(1)
    ctx = init_distributed("gloo")
    world = ctx.world_size
    model, step = bench_real.cannikin(x_all, y_all)
    planner = model.planner
    if not refresh:
        planner.config = dataclasses.replace(planner.config, refresh_after=None)
    periods: list[float] = []
    splits: list[list[int]] = []
    before: list[int] | None = None
    mark = time.perf_counter()
    for index in range(steps):
        if index == change_at:
            before = list(planner.history[-1].local_batches)
            change_share(rank, AFTER[rank])  # each rank its own: the swap
        splits.append(list(model.plan.local_batches))
        step()
        now = time.perf_counter()
        periods.append(now - mark)
        mark = now
    assert before is not None

    # -- Cannikin against plain DDP at its split now and at its split before, mirrored --------
    ddp_step = bench_real.plain_ddp(x_all, y_all, rank, world)
    even = bench_real.even_split(world)
    mirrored = tuple(reversed(before))
    now = tuple(planner.history[-1].local_batches)
    configs = {"Cannikin": step, "DDP at its split now": lambda: ddp_step(now),
               "DDP at its split before, mirrored": lambda: ddp_step(mirrored),
               "DDP even": lambda: ddp_step(even)}
    for run in configs.values():
        run()
        run()
    blocks: dict[str, list[float]] = {name: [] for name in configs}
    names = list(configs)
    for round_ in range(rounds):
        for name in names[round_ % len(names):] + names[: round_ % len(names)]:
            with torch.no_grad():
                model(x_all[:1])  # the other blocks are a pause between Cannikin's steps
            configs[name]()  # one untimed step of the block's own
            dist.barrier()
            start = time.perf_counter()
            for _ in range(block_steps):
                configs[name]()
            dist.barrier()
            blocks[name].append((time.perf_counter() - start) / block_steps)
    if rank == 0:
        out.write_text(json.dumps({
            "periods": periods, "splits": splits, "before": before, "now": now,
            "predicted_s": {"now": model.planner.predicted(now),
                            "mirrored": model.planner.predicted(mirrored)},
            "blocks": blocks, "cores": planner.cpu_cores,
            "plans": [[r.step, r.reason, list(r.local_batches)] for r in planner.history]}))
    model.remove_hooks()
    dist.destroy_process_group()


def _report(name: str, result: dict[str, Any], change_at: int, window: int) -> None:
    periods, splits = result["periods"], result["splits"]
    print(f"\n== {name} ==")
    print(f"{'steps':>11} {'mean step ms':>13}  split (most steps)")
    for start in range(0, len(periods), window):
        chunk = periods[start:start + window]
        common = Counter(map(tuple, splits[start:start + window])).most_common(1)[0][0]
        marker = "  <- the quotas swap" if start <= change_at < start + window else ""
        print(f"{start:>5}-{start + len(chunk) - 1:<5} {1e3 * statistics.fmean(chunk):>13.1f}  "
              f"{list(common)}{marker}")
    events = [f"{s} {reason} {split}" for s, reason, split in result["plans"]
              if reason != "cadence" and s > 0]
    print("re-plans off the cadence:")
    for line in events:
        print(f"  {line}")
    share = bench_real.TOTAL / len(splits[0])
    back = next((i - change_at for i in range(change_at, len(splits))
                 if 2 * splits[i][-1] >= share), None)
    settled = statistics.fmean(periods[change_at - 4 * window:change_at])
    last = statistics.fmean(periods[-4 * window:])
    print(f"the former slowest worker planned half its share or more: "
          f"{'never' if back is None else f'{back} steps after the swap'}")
    print(f"mean step, the last {4 * window} steps over the {4 * window} before the swap "
          f"(the same cluster, ranks reversed): {last / settled:.3f} "
          f"({1e3 * last:.1f} against {1e3 * settled:.1f} ms)")
    print(f"split before the swap {result['before']}, at the end {result['now']}; the "
          f"planner's cores at the end {result['cores']}")
    predicted = {key: "-" if value is None else f"{1e3 * value:.1f} ms"
                 for key, value in result["predicted_s"].items()}
    print(f"Cannikin's model at the end predicts its split {predicted['now']}, the split "
          f"before mirrored {predicted['mirrored']}")
    blocks = result["blocks"]
    medians = {key: statistics.median(v) for key, v in blocks.items()}
    print("interleaved blocks after the run (median step ms, and Cannikin over it):")
    for key, value in medians.items():
        print(f"  {key:<36} {1e3 * value:7.1f}  {medians['Cannikin'] / value:.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description="a change of speed on CPU-quota workers")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-refresh", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1400, help="Cannikin's steps in all")
    parser.add_argument("--change-at", type=int, default=400, help="the step of the swap")
    parser.add_argument("--window", type=int, default=50, help="steps per printed window")
    parser.add_argument("--rounds", type=int, default=10, help="blocks per configuration")
    parser.add_argument("--block-steps", type=int, default=8, help="steps per block")
    bench_real.add_period_option(parser)
    args = parser.parse_args()
    if not 4 * args.window <= args.change_at <= args.steps - 4 * args.window:
        parser.error(f"--change-at {args.change_at} must leave 4 windows ({4 * args.window} "
                     f"steps) before it and after it in --steps {args.steps}")
    if args.worker is not None:
        _worker(args.worker, args.steps, args.change_at, not args.no_refresh, args.rounds,
                args.block_steps)
        return 0
    shared = ["--steps", str(args.steps), "--change-at", str(args.change_at),
              "--rounds", str(args.rounds), "--block-steps", str(args.block_steps)]
    for name in VARIANTS:
        extra = [] if name == VARIANTS[0] else ["--no-refresh"]
        result = bench_real.launch_on_quotas(Path(__file__), [*shared, *extra],
                                             args.period_ms)
        if isinstance(result, int):
            return result
        _report(name, result, args.change_at, args.window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
