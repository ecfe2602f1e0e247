"""What re-plans cost over a long run on CPU-quota workers: one rank decides, or every rank.

The setting of ``bench_real.py`` (three gloo workers on quotas 1, 0.5 and 0.25 of a core,
MLP 64-1024-1024-10 on the digits, B = 480), Cannikin alone, no emulation. Each round
trains a fresh model for ``--steps`` steps twice, in a rotated order: as the runtime does
(the rank with the most CPU chooses each re-plan and broadcasts it, :meth:`Planner.replan`'s
``share``), and with every rank choosing for itself (``share`` left out, as before).

A re-plan runs in the optimizer step it follows; the slowest rank's re-plan holds up every
rank, which waits for it in the next step's all-reduce. So its cost is counted over the
two steps from its own: their wall time on rank 0 over twice the median step without a
re-plan. Printed per mode (medians over rounds): the mean step after the first
``--skip`` steps, the median step of those without a re-plan (quiet), the re-plans, the
slowest rank's re-plan wall time, that two-step excess and its share of the run, and the
paired ratio of the mean steps (noisy: the machine's load moves the quiet steps by more
than the re-plans cost).

Run: ``python benchmarks/bench_replan.py`` (root with a writable cgroup cpu controller;
elsewhere it exits 2 naming the emulated fallback). Figures only, no asserts on timing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_real import SHARES, cannikin, digits, launch_on_quotas  # noqa: E402

MODES = ("one rank decides", "every rank decides")


def _worker(out: Path, rounds: int, steps: int) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    from cannikin.runtime import init_distributed
    from cannikin.runtime.quota import join_from_env

    x_all, y_all = digits()
    join_from_env(int(os.environ["RANK"]))
    torch.set_num_threads(1)
    init_distributed("gloo")

    def run(mode: str) -> dict[str, Any]:
        hdp, step = cannikin(x_all, y_all)
        planner = hdp.planner
        replan = planner.replan
        replans: list[tuple[int, float]] = []  # (step, this rank's wall seconds)

        def timed(step: int, reason: str = "cadence", **kwargs: Any) -> Any:
            if mode == "every rank decides":
                kwargs.pop("share", None)
            start = time.perf_counter()
            record = replan(step, reason, **kwargs)
            replans.append((step, time.perf_counter() - start))
            return record

        planner.replan = timed  # type: ignore[method-assign]
        ends = []
        dist.barrier()
        for _ in range(steps):
            step()
            ends.append(time.perf_counter())
        hdp.remove_hooks()
        return {"ends": ends, "replans": replans, "split": list(hdp.plan.local_batches)}

    runs: dict[str, list[Any]] = {mode: [] for mode in MODES}
    for round_ in range(rounds):
        for mode in MODES[round_ % 2:] + MODES[: round_ % 2]:
            mine = run(mode)
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, mine["replans"])
            runs[mode].append({"ends": mine["ends"], "split": mine["split"],
                               "replans": [[step, max(r[i][1] for r in gathered)]
                                           for i, (step, _) in enumerate(gathered[0])]})
    if dist.get_rank() == 0:
        out.write_text(json.dumps(runs))
    dist.destroy_process_group()


def _summary(run: dict[str, Any], skip: int) -> dict[str, float]:
    """One run's mean step after ``skip`` steps, its re-plans there, their slowest-rank
    wall time and their two-step excess (see the docstring)."""
    ends = run["ends"]
    steps = [b - a for a, b in zip(ends, ends[1:], strict=False)]  # steps[i]: step i + 1
    planned = {step for step, _ in run["replans"] if step >= skip}
    touched = {s + k for s in planned for k in (0, 1)}
    quiet = [t for i, t in enumerate(steps, start=1) if i >= skip and i not in touched]
    base = statistics.median(quiet)
    excess = [steps[s - 1] + steps[s] - 2 * base for s in planned if 1 <= s < len(steps)]
    return {"mean_ms": 1e3 * statistics.fmean(steps[skip - 1:]), "quiet_ms": 1e3 * base,
            "replans": len(planned),
            "plan_ms": 1e3 * statistics.median([t for s, t in run["replans"] if s >= skip]
                                               or [0.0]),
            "excess_ms": 1e3 * statistics.median(excess or [0.0]),
            "share": sum(excess) / sum(steps[skip - 1:])}


def main() -> int:
    parser = argparse.ArgumentParser(description="re-plans' cost on CPU-quota workers")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help="runs per mode")
    parser.add_argument("--steps", type=int, default=400, help="steps per run")
    parser.add_argument("--skip", type=int, default=30,
                        help="first steps left out of the figures (the warm-up's re-plans)")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < args.skip + 20 or args.skip < 1:
        parser.error(f"--rounds {args.rounds}, --steps {args.steps}, --skip {args.skip}: "
                     "need rounds >= 1, skip >= 1 and steps >= skip + 20")
    if args.worker is not None:
        _worker(args.worker, args.rounds, args.steps)
        return 0
    result = launch_on_quotas(Path(__file__), ["--rounds", str(args.rounds), "--steps",
                                               str(args.steps)])
    if isinstance(result, int):
        return result
    print(f"bench_replan: {len(SHARES)} gloo workers on CPU quotas "
          f"{', '.join(f'{s:g}' for s in SHARES)}; {args.rounds} runs of {args.steps} steps "
          f"per mode, figures over steps {args.skip}-{args.steps} (medians over runs)")
    summaries = {mode: [_summary(run, args.skip) for run in runs]
                 for mode, runs in result.items()}
    print(f"{'mode':20s} {'step ms':>8s} {'quiet ms':>8s} {'re-plans':>8s} {'re-plan ms':>10s} "
          f"{'2-step excess ms':>16s} {'share of run':>12s}  final splits")
    for mode, rows in summaries.items():
        def mid(key: str, rows: list[dict[str, float]] = rows) -> float:
            return statistics.median(row[key] for row in rows)
        splits = "; ".join("/".join(map(str, run["split"])) for run in result[mode])
        print(f"{mode:20s} {mid('mean_ms'):8.1f} {mid('quiet_ms'):8.1f} {mid('replans'):8.0f} "
              f"{mid('plan_ms'):10.1f} "
              f"{mid('excess_ms'):16.1f} {mid('share'):12.1%}  {splits}")
    ratios = [a["mean_ms"] / b["mean_ms"] for a, b in zip(*summaries.values(), strict=True)]
    print(f"mean step, {MODES[0]} / {MODES[1]}, paired by round: "
          + ", ".join(f"{r:.3f}" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
