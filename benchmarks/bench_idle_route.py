"""What a worker with 0 samples pays for the gradient sum: an all-reduce over every rank
against the idle route (the busy workers all-reduce, one of them broadcasts the sum to the
idle one, ``cannikin.runtime.routes``), on CPU-quota workers.

Three gloo workers in cgroups limited to 1, 0.5 and 0.25 of a core (10 ms CFS period) sum a
float32 gradient of ``--numel`` elements (default 1.1M: the MLP 64-1024-1024-10 of
``bench_real.py``) over and over, the quarter-core worker idle. In interleaved blocks of 10
(every round runs both, in alternating order):

* ``all-reduce``: one all-reduce over every rank (plain DDP's collective);
* ``idle route``: an all-reduce over ranks 0 and 1, then rank 0's broadcast to rank 2.

Prints each rank's process CPU (every thread) and the wall time per sum, medians over rounds.
On a quota worker one ms of CPU costs 1 / share ms of wall time.

Run: ``python benchmarks/bench_idle_route.py`` (as root where the cgroup cpu controller is
writable; elsewhere it exits 2 with one line). Figures only, no asserts on timing.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # the parent imports this checkout's quota module

from cannikin.runtime.quota import QuotaGroups, QuotaUnavailable  # noqa: E402

SHARES = (1.0, 0.5, 0.25)
BLOCK = 10


def _worker(out: Path, numel: int, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    from cannikin.runtime.quota import join_from_env

    rank = int(os.environ["RANK"])
    join_from_env(rank)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    busy, fan = dist.new_group([0, 1]), dist.new_group([0, 2])
    gradient = torch.randn(numel)

    def all_reduce() -> None:
        dist.all_reduce(gradient)

    def idle_route() -> None:
        if rank != 2:
            dist.all_reduce(gradient, group=busy)
        if rank != 1:
            dist.broadcast(gradient, src=0, group=fan)

    ways = {"all-reduce": all_reduce, "idle route": idle_route}
    cpu: dict[str, list[float]] = {name: [] for name in ways}
    wall: dict[str, list[float]] = {name: [] for name in ways}
    for round_ in range(rounds + 1):  # the first round warms up
        for name in list(ways)[:: 1 if round_ % 2 else -1]:
            dist.barrier()
            cpu_start, start = time.process_time(), time.perf_counter()
            for _ in range(BLOCK):
                ways[name]()
            dist.barrier()
            if round_:
                cpu[name].append((time.process_time() - cpu_start) / BLOCK)
                wall[name].append((time.perf_counter() - start) / BLOCK)
    every: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(every, {name: statistics.median(v) for name, v in cpu.items()})
    if rank == 0:
        out.write_text(json.dumps({"cpu": every, "wall": {
            name: statistics.median(v) for name, v in wall.items()}}))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--numel", type=int, default=1_100_000, help="gradient elements")
    parser.add_argument("--rounds", type=int, default=12, help="blocks of each way")
    args = parser.parse_args()
    for name in ("numel", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if args.worker is not None:
        _worker(args.worker, args.numel, args.rounds)
        return 0
    try:
        groups = QuotaGroups.create(SHARES)
    except QuotaUnavailable as err:
        print(f"bench_idle_route: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, groups:
        out = Path(tmp) / "bench.json"
        env = {**os.environ, **groups.env(), "PYTHONPATH": str(ROOT / "src"),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={len(SHARES)}", __file__, "--worker", str(out), "--numel",
               str(args.numel), "--rounds", str(args.rounds)]
        proc = subprocess.run(cmd, env=env, timeout=600, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"bench_idle_route: workers failed (exit {proc.returncode}):\n"
                  f"{proc.stderr[-4000:]}", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    print(f"bench_idle_route: {args.numel} float32 summed over 3 gloo workers on CPU quotas "
          f"{', '.join(f'{s:g}' for s in SHARES)} of a core, rank 2 idle; medians over "
          f"{args.rounds} blocks of {BLOCK}")
    print(f"{'':12s} {'CPU ms by rank':>24s} {'wall ms':>8s}")
    for name, wall_s in result["wall"].items():
        cpu = " ".join(f"{1e3 * rank[name]:7.2f}" for rank in result["cpu"])
        print(f"{name:12s} {cpu:>24s} {1e3 * wall_s:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
