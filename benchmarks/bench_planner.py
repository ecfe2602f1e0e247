"""Planner cost and quality (DESIGN.md §7): prints figures, asserts nothing.

    python benchmarks/bench_planner.py [--clusters 1000] [--seed 0]

Cost: ``optimal_split`` per call at n = 16, 256, 1024 workers (2 buckets), with the
cluster's arrays cached (the planner re-splitting one model) and from a fresh
``ClusterModel`` (a new model after a re-fit); ``choose_batch_size`` per call at n = 16
and 1024; time and peak memory of the straggler clusters of issue 17 at n = 1024; a full
re-plan at n = 1024 (every worker refitted at once by ``perf.fit_nodes``, then a fresh
``ClusterModel`` and ``choose_batch_size``). Quality
over random clusters: the integer split's step time against the LP
lower bound of §2 (solved independently by scipy's HiGHS) and against the even and
throughput-proportional splits. Timings on a shared machine are noisy: the best of
several repeats is reported next to the median.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
import timeit
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references

from cannikin.goodput import choose_batch_size  # noqa: E402
from cannikin.optperf import even_split, optimal_split, proportional_split  # noqa: E402
from cannikin.perf import (  # noqa: E402
    ClusterModel,
    CommModel,
    NodeFitter,
    NodeModel,
    fit_nodes,
)
from references import lp_bound  # noqa: E402

# Relative per-sample speed and memory (max local batch) of a few GPU kinds, roughly
# A100 : V100 : T4 : K80 for a ResNet-50-sized model; intercepts are per-step overheads.
DEVICES = [(1.0, 256), (1.8, 128), (3.5, 96), (6.0, 64)]


def random_cluster(rng: np.random.Generator, n: int) -> ClusterModel:
    nodes = []
    for i in range(n):
        slow, cap = DEVICES[int(rng.integers(len(DEVICES)))]
        slow *= float(rng.uniform(0.9, 1.1))
        nodes.append(NodeModel(
            fwd=(float(rng.uniform(0.002, 0.01)), slow * 4e-4),
            bwd=(float(rng.uniform(0.002, 0.01)), slow * 8e-4),
            max_batch=cap, min_batch=1, name=f"w{i}",
        ))
    comm = CommModel(buckets=[(float(rng.uniform(0.1, 0.5)), float(rng.uniform(0.005, 0.05))),
                              (1.0, float(rng.uniform(0.001, 0.01)))])
    return ClusterModel(nodes=nodes, comm=comm)


FAST = NodeModel(fwd=(0.005, 5e-5), bwd=(0.01, 1e-4))
COMM = CommModel(buckets=[(0.5, 0.01), (1.0, 0.01)])


def straggler_cases(n: int = 1024) -> list[tuple[str, Callable[[], object]]]:
    """Clusters of uncapped fast workers with one or a few workers 10-1000x slower, and
    slopes down to 1e-9 s/sample (issue 17): the planner's worst cases for the number of
    samples any worker could finish by the step time."""

    def choose(slow: list[NodeModel], phi: float = 1e4) -> Callable[[], object]:
        cluster = ClusterModel(nodes=[FAST] * (n - len(slow)) + slow, comm=COMM)
        return lambda: choose_batch_size(cluster, phi, 16 * n, 128 * n)

    tiny = NodeModel(fwd=(0.005, 1e-9), bwd=(0.01, 1e-9))
    mixed = ([NodeModel(fwd=(0.0, 2e-6), bwd=(0.0, 2e-6))] * 100
             + [NodeModel(fwd=(1.0, 2e-6), bwd=(0.0, 2e-6))] * (n - 124)
             + [NodeModel(fwd=(4.0, 0.01), bwd=(0.0, 0.01))])
    split = ClusterModel(nodes=mixed[:n - 23] + mixed[-1:])  # the 1001 workers
    few = ClusterModel(nodes=[FAST] * (n - 4) + [NodeModel(fwd=(0.5, 5e-3), bwd=(1.0, 1e-2))] * 4,
                       comm=COMM)
    return [
        ("choose, one 0.5 s straggler", choose([NodeModel(fwd=(0.5, 0.01), bwd=(0.5, 0.02))])),
        ("choose, one 2 s straggler", choose([NodeModel(fwd=(1.0, 0.02), bwd=(1.0, 0.04))])),
        ("choose, 0.5 s straggler, pure noise",
         choose([NodeModel(fwd=(0.5, 0.01), bwd=(0.5, 0.02))], phi=float("inf"))),
        ("choose, 2 workers 10x slower, phi 300",
         choose([NodeModel(fwd=(0.05, 5e-4), bwd=(0.1, 1e-3))] * 2, phi=300.0)),
        ("choose, 4 workers 100x slower", lambda: choose_batch_size(few, 1e4, 16 * n, 128 * n)),
        ("choose, 2 workers at 1e-9 s/sample", choose([tiny] * 2)),
        ("choose, 1e-9 s/sample + straggler",
         choose([tiny, NodeModel(fwd=(0.5, 0.01), bwd=(0.5, 0.02))])),
        ("split, issue's B = 30500", lambda: optimal_split(split, 30500)),
        ("split, 4 slower at B = 64n", lambda: optimal_split(few, 64 * n)),
        ("split, 1e-9 s/sample at B = 128n", lambda: optimal_split(
            ClusterModel(nodes=[FAST] * (n - 2) + [tiny] * 2, comm=COMM), 128 * n)),
    ]


def time_and_memory(fn: Callable[[], object], repeat: int = 3) -> tuple[float, float, object]:
    """Best wall time (ms) of ``repeat`` calls, peak memory (MB) traced in a separate call
    (numpy reports its buffers to tracemalloc), and the result."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    tracemalloc.start()
    fn()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return best * 1e3, peak / 2**20, result


def bench_stragglers() -> None:
    print("stragglers at n = 1024: best of 3 (ms), peak traced memory (MB)")
    for name, fn in straggler_cases():
        ms, mb, _ = time_and_memory(fn)
        print(f"  {name:38s} {ms:8.2f} ms {mb:8.2f} MB")


def filled_fitters(rng: np.random.Generator, n: int) -> tuple[list[NodeFitter],
                                                                Callable[[], None]]:
    """A re-plan's state at n workers: each window full (64 steps of a held plan at two
    batch sizes, 10% timing noise) and the warm-up's even split remembered; and a function
    that adds one more step's sample to every worker (so that the next fit is a refit)."""
    fitters = [NodeFitter() for _ in range(n)]
    slow = rng.uniform(1.0, 4.0, n)
    steps = [0]

    def add(batch: list[int], remember: bool) -> None:
        noise = rng.lognormal(0.0, 0.1, n) * slow
        for f, b, s in zip(fitters, batch, noise.tolist(), strict=True):
            f.add(b, s * (0.005 + 5e-5 * b), s * (0.01 + 1e-4 * b), remember=remember)

    def step() -> None:
        steps[0] += 1
        add([int(32 / s) + steps[0] % 2 for s in slow.tolist()], False)

    for _ in range(4):
        add([32] * n, True)
    for _ in range(fitters[0].window):
        step()
    return fitters, step


def bench_replan(rng: np.random.Generator, repeat: int = 10) -> None:
    """A full re-plan on every rank after a step: refit every worker, build the cluster
    model (its arrays included) and choose the total; the best of ``repeat`` (the figures
    move by +-20% between runs on a shared machine), with the page faults per re-plan.

    Timed twice: in this process as it is, then after freeing one 16 MB array, as a
    training process frees activations every step. glibc returns the top of its heap to
    the system once more than twice its largest freed large block lies free there, and
    takes fresh (faulting) pages back at the next re-plan: in a numpy-only process that
    is 0 to ~3800 faults (up to ~5 ms) a re-plan depending on what ran before, after one
    16 MB free 0 (also after ``import torch`` and one tensor freed). Reusing a buffer for
    the windows did not help: it made 3000 faults of 900 in two of three runs.
    """
    n = 1024
    fitters, step = filled_fitters(rng, n)
    comm = CommModel(buckets=[(0.5, 0.01), (1.0, 0.01)])
    names = [f"w{i}" for i in range(n)]

    def replan() -> tuple[float, float, int]:
        step()  # untimed: each worker's new sample
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        nodes = fit_nodes(fitters, names, [1] * n, [None] * n)
        refitted = time.perf_counter()
        cluster = ClusterModel(nodes=[nd for nd in nodes if nd is not None], comm=comm)
        choose_batch_size(cluster, 1e4, 16 * n, 128 * n)
        end = time.perf_counter()
        return (refitted - start, end - refitted,
                resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)

    for state in ("as it is", "after a 16 MB free"):
        if state != "as it is":
            freed = np.ones(2 << 20)
            del freed
        runs = np.array([replan() for _ in range(repeat)])
        fit_ms, choose_ms = runs[:, :2].min(axis=0) * 1e3
        whole_ms = runs[:, :2].sum(axis=1).min() * 1e3
        tracemalloc.start()
        replan()
        mb = tracemalloc.get_traced_memory()[1] / 2**20
        tracemalloc.stop()
        print(f"re-plan at n = {n}, best of {repeat}, process {state}: refit of every worker "
              f"{fit_ms:.1f} ms ({fit_ms / n * 1e3:.0f} us each) + cluster and "
              f"choose_batch_size {choose_ms:.1f} ms; whole re-plan {whole_ms:.1f} ms, peak "
              f"{mb:.2f} MB, {np.median(runs[:, 2]):.0f} page faults (median); an unchanged "
              "worker's refit is its cached fit")


def per_call_ms(fn: object, number: int, repeat: int = 7) -> tuple[float, float]:
    times = [t / number * 1e3 for t in timeit.repeat(fn, number=number, repeat=repeat)]  # type: ignore[arg-type]
    return min(times), statistics.median(times)


def bench_cost(rng: np.random.Generator) -> None:
    print("cost per call (ms): best / median of 7 repeats")
    for n in (16, 256, 1024):
        cluster = random_cluster(rng, n)
        total = 32 * n
        number = max(5, 4000 // n)
        cached = per_call_ms(lambda c=cluster, b=total: optimal_split(c, b), number)
        fresh = per_call_ms(
            lambda c=cluster, b=total: optimal_split(ClusterModel(nodes=c.nodes, comm=c.comm), b),
            number)
        print(f"  optimal_split      n={n:5d}: {cached[0]:7.3f} / {cached[1]:7.3f}   "
              f"(fresh ClusterModel: {fresh[0]:7.3f} / {fresh[1]:7.3f})")
    many = random_cluster(rng, 1024)
    rho = [*np.sort(rng.uniform(0.05, 1, 29)).tolist(), 1.0]
    many = ClusterModel(nodes=many.nodes, comm=CommModel(
        buckets=[(r, float(rng.uniform(5e-4, 5e-3))) for r in rho]))
    cost = per_call_ms(lambda: optimal_split(many, 32 * 1024), 5)
    print(f"  optimal_split      n= 1024, 30 buckets ({len(many.comm.binding())} can bind): "
          f"{cost[0]:7.3f} / {cost[1]:7.3f}")
    for n in (16, 1024):
        cluster = random_cluster(rng, n)
        number = max(3, 1000 // n)
        for phi in (2000.0, float("inf")):
            cost = per_call_ms(
                lambda c=cluster, k=n, p=phi: choose_batch_size(c, p, 8 * k, 128 * k), number)
            print(f"  choose_batch_size  n={n:5d}: {cost[0]:7.3f} / {cost[1]:7.3f}   "
                  f"(B in [{8 * n}, {128 * n}], noise scale {phi:g})")


def bench_quality(rng: np.random.Generator, count: int) -> None:
    to_lp, gain_even, gain_prop = [], [], []
    infeasible_even = 0
    for _ in range(count):
        n = int(rng.integers(2, 65))
        cluster = random_cluster(rng, n)
        cap = sum(node.max_batch or 0 for node in cluster.nodes)
        total = int(rng.integers(n, int(0.8 * cap) + 1))
        plan = optimal_split(cluster, total)
        to_lp.append(plan.step_time / lp_bound(cluster, total))
        even = even_split(cluster, total)
        caps = [node.max_batch or 0 for node in cluster.nodes]
        if all(b <= c for b, c in zip(even.local_batches, caps, strict=True)):
            gain_even.append(even.step_time / plan.step_time)
        else:
            infeasible_even += 1
        gain_prop.append(proportional_split(cluster, total).step_time / plan.step_time)
    print(f"quality over {count} random clusters (n = 2..64, 2 buckets, B up to 80% of caps)")
    print(f"  step time / LP lower bound: median {np.median(to_lp):.5f}, "
          f"max {np.max(to_lp):.5f}, min {np.min(to_lp):.5f}")
    print(f"  even split / optimal:  median {np.median(gain_even):.3f}x, "
          f"max {np.max(gain_even):.3f}x (even split over a memory cap in {infeasible_even} "
          "clusters, left out)")
    print(f"  proportional split / optimal (caps ignored): median {np.median(gain_prop):.3f}x, "
          f"max {np.max(gain_prop):.3f}x, min {np.min(gain_prop):.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clusters", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    bench_cost(rng)
    bench_stragglers()
    bench_replan(rng)
    bench_quality(rng, args.clusters)


if __name__ == "__main__":
    main()
