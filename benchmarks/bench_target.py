"""Time to accuracy on emulated and on real (CPU-quota) workers, side by side.

Each repeat runs ``cannikin demo --target`` once with sleep-padded speeds and once on CPU
quotas (the order alternates between repeats, so a change in the shared machine's load hits
both alike). One demo trains three runs on the same data and seed, each until the held-out
accuracy reaches the target: DDP (even split, fixed B0), AdaptDL-like (even split, goodput
batch) and Cannikin (optimal split, goodput batch). Printed per run: wall seconds to the
target, mean total batch, final held-out accuracy; then the median over repeats of
Cannikin's time as a fraction of each baseline's.

The quota speeds follow the demo's default 1,1,2,4, scaled to the machine's cores. Where the
cgroup cpu controller is not writable the quota half is left out, with the demo's one line on
why.

Run: ``python benchmarks/bench_target.py [--repeats 3] [--target 0.97] [--task digits]``
(``--task teacher --target 0.82 --epochs 8``: the synthetic task whose batch grows). Figures
only, no asserts on timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cannikin.demo.config import TASKS

PHASES = ("even", "adaptdl", "cannikin")
TITLES = {"even": "DDP", "adaptdl": "AdaptDL-like", "cannikin": "Cannikin"}
CLI = [sys.executable, "-c", "import sys; from cannikin.cli import main; sys.exit(main())"]


QUOTA_REFUSED = 2
"""The demo's exit status when CPU quotas cannot be set here."""


def _demo(heterogeneity: str, target: float, epochs: int, task: str,
          out: Path) -> dict[str, Any] | None:
    """One ``cannikin demo --target`` run: its JSON report, or None where the quota
    half cannot run (the demo's reason printed)."""
    out.mkdir(parents=True)
    report = out / "report.json"
    command = [*CLI, "demo", "--task", task, "--target", str(target), "--epochs", str(epochs),
               "--heterogeneity", heterogeneity, "--no-progress",
               "--out", str(out), "--json", str(report)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if done.returncode == QUOTA_REFUSED and heterogeneity == "quota":
        print(f"quota half left out: {done.stderr.strip().splitlines()[-1]}")
        return None
    if done.returncode != 0:
        raise SystemExit(f"cannikin demo --heterogeneity {heterogeneity} failed "
                         f"(exit {done.returncode}):\n{done.stderr[-2000:]}")
    data: dict[str, Any] = json.loads(report.read_text())
    return data


def _line(heterogeneity: str, repeat: int, report: dict[str, Any]) -> str:
    cells = []
    for phase in PHASES:
        run = report[phase]
        reached = run["time_to_target_s"]
        time = "not reached" if reached is None else f"{reached:6.1f} s"
        cells.append(f"{TITLES[phase]} {time} B {run['mean_batch']:5.1f} "
                     f"acc {100 * run['accuracy']:.1f}%")
    return f"{heterogeneity:8s} #{repeat}: " + " | ".join(cells)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.97)
    parser.add_argument("--epochs", type=int, default=20, help="budget per run")
    parser.add_argument("--task", choices=TASKS, default="digits")
    args = parser.parse_args()
    if args.repeats < 1 or not 0 < args.target < 1:
        parser.error(f"need --repeats >= 1 (got {args.repeats}) and 0 < --target < 1 "
                     f"(got {args.target})")
    kinds = ["emulate", "quota"]
    ratios: dict[str, dict[str, list[float]]] = {k: {"even": [], "adaptdl": []} for k in kinds}
    with tempfile.TemporaryDirectory(prefix="bench-target-") as tmp:
        for repeat in range(args.repeats):
            for kind in list(kinds if repeat % 2 == 0 else kinds[::-1]):
                report = _demo(kind, args.target, args.epochs, args.task,
                               Path(tmp) / f"{kind}{repeat}")
                if report is None:
                    kinds.remove(kind)
                    continue
                print(_line(kind, repeat, report), flush=True)
                for baseline, ratio in report["time_to_target_vs"].items():
                    if ratio is not None:
                        ratios[kind][baseline].append(ratio)
    print(f"\nCannikin's time to {100 * args.target:g}% as a fraction of each baseline's "
          f"(median over {args.repeats} repeats, min-max):")
    for kind in kinds:
        cells = [f"{TITLES[b]} {statistics.median(v):.2f}x ({min(v):.2f}-{max(v):.2f})"
                 for b, v in ratios[kind].items() if v]
        print(f"  {kind:8s} " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
