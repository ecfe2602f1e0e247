"""Policies compared on the paper-like 16-GPU scenario, and the wall time of 1024 workers.

Run: python benchmarks/bench_sim.py [--quick] [--seed N]

For each workload on ``paper16`` it prints the comparison table of ``cannikin simulate``
and Cannikin's time to target as a fraction of AdaptDL's (expected <= 0.6), of DDP's
(<= 0.3) and of the oracle's (<= 1.10), and the oracle's own fractions: what the simulated
cluster allows at best. Then it times one full simulation (all five
policies) of ResNet-18/CIFAR-10 on the 1024-worker ``scale1024`` scenario (target: under
2 minutes). ``--quick`` skips ResNet-50/ImageNet, whose 90 epochs take a few minutes.
"""

from __future__ import annotations

import argparse
import time

from cannikin.cli.simulate import table
from cannikin.sim import SCENARIOS, SimConfig, compare, workload

EXPECTED = {"adaptdl": 0.6, "ddp": 0.3, "oracle": 1.10}


def _ratios(summary: dict[str, dict[str, float | None]], policy: str,
            with_targets: bool) -> str:
    mine = summary[policy]["time_to_target_s"]
    parts = []
    for other, limit in EXPECTED.items():
        theirs = summary[other]["time_to_target_s"]
        if other == policy:
            continue
        if mine is None or theirs is None:
            parts.append(f"vs {other}: n/a")
            continue
        ratio = mine / theirs
        verdict = f" ({'met' if ratio <= limit else 'missed'} <= {limit})" if with_targets else ""
        parts.append(f"vs {other} {ratio:.3f}x{verdict}")
    return f"{policy} time to target " + ", ".join(parts)


def bench_paper16(names: list[str], seed: int) -> None:
    spec = SCENARIOS["paper16"]
    print(f"paper16: {spec.summary()}, seed {seed}\n")
    for name in names:
        start = time.perf_counter()
        comparison = compare(spec, workload(name), SimConfig(seed=seed))
        wall = time.perf_counter() - start
        summary = comparison.summary()
        print(f"{name} ({wall:.1f} s wall)")
        print(table(summary))
        print(_ratios(summary, "cannikin", with_targets=True))
        print(_ratios(summary, "oracle", with_targets=False) + " (the model's limit)\n")


def bench_scale(seed: int) -> None:
    spec = SCENARIOS["scale1024"]
    start = time.perf_counter()
    comparison = compare(spec, workload("resnet18-cifar10"), SimConfig(seed=seed))
    wall = time.perf_counter() - start
    decisions = sum(len(r.history_time_s) for r in comparison.results.values())
    print(f"scale1024 ({spec.num_workers} workers: {spec.summary()}), resnet18-cifar10")
    print(table(comparison.summary()))
    print(f"1024-worker simulation, all 5 policies: {wall:.1f} s wall "
          f"({decisions} planning decisions; target < 120 s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip resnet50-imagenet")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    names = ["resnet18-cifar10", "bert-base-squad", "gpt-small-lm"]
    if not args.quick:
        names.insert(1, "resnet50-imagenet")
    bench_paper16(names, args.seed)
    bench_scale(args.seed)


if __name__ == "__main__":
    main()
