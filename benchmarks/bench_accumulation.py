"""Simulator: time to target with and without micro-batches beyond the memory caps.

Run: python benchmarks/bench_accumulation.py [--seed N] [--passes K]

GPT-small (124M parameters, seq 1024) holds 9 samples in 16 GB and 24 in 40 GB, so the
goodput-chosen batch runs into the memory caps. For each cluster it runs AdaptDL,
Cannikin and the oracle once with one pass per step and once with up to K passes
(``SimConfig.max_micro_batches``), and prints each one's time to target and mean batch,
and the time with passes as a fraction of the time without (simulator figures).
"""

from __future__ import annotations

import argparse
import dataclasses

from cannikin.sim import SCENARIOS, ClusterSpec, SimConfig, compare, workload

CLUSTERS = {
    "16GB-mixed": ClusterSpec(devices=("V100",) * 4 + ("P100",) * 4 + ("T4",) * 4,
                              bandwidth_gbps=25.0, latency_us=1000.0, name="16GB-mixed"),
    "homogeneous16": SCENARIOS["homogeneous16"],
    "paper16": SCENARIOS["paper16"],
}
POLICIES = ("adaptdl", "cannikin", "oracle")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--passes", type=int, default=8, help="max micro-batches per step")
    args = parser.parse_args()
    wl = workload("gpt-small-lm")
    for name, spec in CLUSTERS.items():
        print(f"{wl.name} on {name}: {spec.summary()}, seed {args.seed}")
        print(f"{'policy':10} {'1 pass':>12} {'batch':>6} {f'{args.passes} passes':>12} "
              f"{'batch':>6} {'with / without':>15}")
        config = SimConfig(seed=args.seed)
        one = compare(spec, wl, config, POLICIES).summary()
        more = compare(spec, wl, dataclasses.replace(config, max_micro_batches=args.passes),
                       POLICIES).summary()
        for policy in POLICIES:
            a, b = one[policy], more[policy]
            ta, tb = a["time_to_target_s"], b["time_to_target_s"]
            ratio = "n/a" if ta is None or tb is None else f"{tb / ta:.3f}"
            print(f"{policy:10} {_minutes(ta):>12} {a['mean_total_batch'] or 0:>6.0f} "
                  f"{_minutes(tb):>12} {b['mean_total_batch'] or 0:>6.0f} {ratio:>15}")
        print()


def _minutes(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds / 60:.1f} min"


if __name__ == "__main__":
    main()
