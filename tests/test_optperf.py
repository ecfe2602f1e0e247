"""OptPerf (DESIGN.md §2) against brute force, an LP solver and property tests."""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cannikin.optperf import (
    Splitter,
    _hand_out,
    costly_workers,
    even_split,
    optimal_split,
    proportional_split,
    step_time_curve,
    without_worker,
    zero_split,
)
from cannikin.perf import ClusterModel, CommModel, NodeModel
from references import greedy_hand_out, lp_bound
from test_perf import timeline_step_time


def random_cluster(rng: np.random.Generator, n: int, m: int, cap: int = 200) -> ClusterModel:
    nodes = []
    for i in range(n):
        lo = int(rng.integers(0, 4))
        hi = int(lo + rng.integers(1, cap)) if rng.random() < 0.7 else None
        speed = float(10 ** rng.uniform(0, 1))  # up to 10x slower
        nodes.append(NodeModel(
            fwd=(float(rng.uniform(0, 0.1)), speed * float(rng.uniform(1e-3, 1e-2))),
            bwd=(float(rng.uniform(0, 0.1)), speed * float(rng.uniform(1e-3, 2e-2))),
            min_batch=lo, max_batch=hi, name=f"w{i}",
        ))
    rho = [*np.sort(rng.uniform(0, 1, m - 1)).tolist(), 1.0]
    comm = CommModel(buckets=[(r, float(rng.uniform(0, 0.3))) for r in rho])
    return ClusterModel(nodes=nodes, comm=comm)


def bounds(cluster: ClusterModel, uncapped: int) -> tuple[int, int]:
    lo = sum(n.min_batch for n in cluster.nodes)
    hi = sum(uncapped if n.max_batch is None else n.max_batch for n in cluster.nodes)
    return lo, hi


def brute_force(cluster: ClusterModel, total: int) -> float:
    ranges = [range(n.min_batch, (total if n.max_batch is None else n.max_batch) + 1)
              for n in cluster.nodes]
    return min(cluster.step_time(s) for s in itertools.product(*ranges) if sum(s) == total)


def test_matches_brute_force_on_small_clusters() -> None:
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(120):
        cluster = random_cluster(rng, int(rng.integers(1, 4)), int(rng.integers(1, 4)), cap=10)
        lo, hi = bounds(cluster, 14)
        for total in range(lo, min(hi, 14) + 1):
            plan = optimal_split(cluster, total)
            assert sum(plan.local_batches) == total
            assert plan.step_time == pytest.approx(brute_force(cluster, total), rel=1e-12)
            assert plan.step_time == pytest.approx(cluster.step_time(plan.local_batches),
                                                   rel=1e-12)
            checked += 1
    assert checked > 500


def test_within_one_sample_of_the_lp_bound() -> None:
    rng = np.random.default_rng(1)
    for _ in range(60):
        n = int(rng.integers(1, 65))
        cluster = random_cluster(rng, n, int(rng.integers(1, 5)))
        lo, hi = bounds(cluster, 10**6)
        total = int(rng.integers(lo, min(hi, lo + 60 * n) + 1))
        bound = lp_bound(cluster, total)
        plan = optimal_split(cluster, total)
        one_sample = float(cluster.arrays.slopes.max())
        assert bound - 1e-9 <= plan.step_time <= bound + one_sample + 1e-9
        assert step_time_curve(cluster)(total) == pytest.approx(bound, rel=1e-7, abs=1e-9)


def test_curve_breakpoints_match_lp() -> None:
    rng = np.random.default_rng(2)
    cluster = random_cluster(rng, 12, 3, cap=40)
    curve = step_time_curve(cluster)
    lo, hi = bounds(cluster, 10**6)
    for total in np.linspace(lo, min(hi, lo + 600), 25):
        assert curve(float(total)) == pytest.approx(lp_bound(cluster, float(total)), rel=1e-7)
    assert np.all(np.diff(curve.batch) > 0) and np.all(np.diff(curve.time) >= 0)
    slopes = np.diff(curve.time) / np.diff(curve.batch)
    assert np.all(np.diff(slopes) >= -1e-9)  # convex in B
    with pytest.raises(ValueError, match="feasible range"):
        curve(lo - 1)


def test_workers_in_different_regimes() -> None:
    """A backward-heavy worker is compute-bound (last bucket binds) while a forward-heavy one
    is communication-bound (first bucket binds), in the same optimal split."""
    nodes = [NodeModel(fwd=(0.0, 0.01), bwd=(0.0, 1.0), name="bwd-heavy"),
             NodeModel(fwd=(0.0, 0.5), bwd=(0.0, 0.01), name="fwd-heavy")]
    cluster = ClusterModel(nodes=nodes, comm=CommModel(buckets=[(0.1, 5.0), (1.0, 0.1)]))
    for total in (8, 13, 20):
        plan = optimal_split(cluster, total)
        assert plan.step_time == pytest.approx(brute_force(cluster, total), rel=1e-12)
        arr = cluster.arrays
        per_bucket = arr.offsets + arr.slopes * np.array(plan.local_batches)[:, None]
        assert np.argmax(per_bucket[0]) == 1  # bwd-heavy: backward end + c_m
        assert np.argmax(per_bucket[1]) == 0  # fwd-heavy: first bucket + all comm


def test_equal_finish_times_within_one_sample() -> None:
    """DESIGN §2 corollary: workers off their bounds finish together, within one sample."""
    rng = np.random.default_rng(3)
    balanced = 0
    for _ in range(30):
        cluster = random_cluster(rng, int(rng.integers(2, 40)), 2)
        lo, hi = bounds(cluster, 10**6)
        total = int(rng.integers(lo, min(hi, lo + 50 * cluster.size) + 1))
        plan = optimal_split(cluster, total)
        arr = cluster.arrays
        b = np.array(plan.local_batches, dtype=np.float64)
        finish = cluster.node_times(b)
        one_more = np.max(arr.offsets + arr.slopes * (b + 1)[:, None], axis=1)
        lowest = float(np.max(np.max(arr.offsets + arr.slopes * arr.lo[:, None], axis=1)))
        free = b < arr.hi
        if plan.step_time == lowest:
            continue  # a worker's minimum batch sets the pace: nothing to balance
        assert np.all(one_more[free] >= plan.step_time * (1 - 1e-12))
        above = (b > arr.lo) & free  # off both bounds
        assert np.all(finish[above] >= plan.step_time - arr.slopes[above].max(axis=1) - 1e-12)
        balanced += 1
    assert balanced >= 20


def test_honours_min_and_max_batch() -> None:
    nodes = [NodeModel(fwd=(0, 0.001), bwd=(0, 0.002), max_batch=5, name="fast-small-memory"),
             NodeModel(fwd=(0, 0.1), bwd=(0, 0.2), min_batch=3, name="slow-with-a-minimum")]
    cluster = ClusterModel(nodes=nodes)
    assert optimal_split(cluster, 8).local_batches == (5, 3)
    assert optimal_split(cluster, 9).local_batches == (5, 4)
    assert optimal_split(cluster, 4).local_batches == (1, 3)


@pytest.mark.parametrize("total, match", [
    (11, "exceeds the sum of the workers' max_batch \\(10"),
    (1, "below the sum of the workers' min_batch \\(2"),
    (4.5, "must be an integer"),
    (True, "must be an integer"),
])
def test_bad_totals(total: object, match: str) -> None:
    cluster = ClusterModel(nodes=[NodeModel(fwd=(0, 1), bwd=(0, 1), min_batch=1, max_batch=5)] * 2)
    with pytest.raises(ValueError, match=match):
        optimal_split(cluster, total)  # type: ignore[arg-type]


def test_bad_clusters() -> None:
    zero = ClusterModel(nodes=[NodeModel(fwd=(0, 1), bwd=(0, 1)),
                               NodeModel(fwd=(1, 0), bwd=(1, 0), name="flat")])
    with pytest.raises(ValueError, match="node 1 \\('flat'\\).*must be > 0"):
        optimal_split(zero, 4)
    with pytest.raises(ValueError, match="finite"):
        optimal_split(ClusterModel(nodes=[NodeModel(fwd=(math.nan, 1), bwd=(0, 1))]), 4)
    with pytest.raises(ValueError, match="finite"):
        optimal_split(ClusterModel(nodes=[NodeModel(fwd=(0, 1), bwd=(0, math.inf))]), 4)
    with pytest.raises(ValueError, match="at least one node"):
        optimal_split(ClusterModel(nodes=[]), 4)


def test_step_times_for_a_range_match_single_splits() -> None:
    rng = np.random.default_rng(4)
    for _ in range(12):
        cluster = random_cluster(rng, int(rng.integers(1, 20)), int(rng.integers(1, 4)))
        lo, hi = bounds(cluster, 10**6)
        first = int(rng.integers(lo, min(hi, lo + 300) + 1))
        last = int(rng.integers(first, min(hi, first + 200) + 1))
        times = Splitter(cluster).step_times(first, last)
        ref = [optimal_split(cluster, total).step_time for total in range(first, last + 1)]
        assert times == pytest.approx(ref, rel=1e-12)


def test_vectorised_hand_out_equals_heap() -> None:
    """The listed hand-out gives exactly the heap's samples, also where a fast worker could
    finish far more than the remainder by the time it takes (a straggler) and with slopes
    of 1e-9 s/sample next to offsets of 1 s (the inverse loses digits there)."""
    rng = np.random.default_rng(5)
    for k in range(60):
        n = int(rng.integers(2, 300))
        cluster = random_cluster(rng, n, int(rng.integers(1, 4)))
        nodes = list(cluster.nodes)
        if k % 3 == 1:  # a straggler: the others' room by its time is huge
            nodes[int(rng.integers(n))] = NodeModel(fwd=(5.0, 0.1), bwd=(5.0, 0.1))
        if k % 3 == 2:  # tiny slopes
            for i in rng.integers(0, n, 3):
                nodes[int(i)] = NodeModel(fwd=(1.0, 1e-9), bwd=(float(rng.uniform(0, 1)), 1e-9),
                                          max_batch=nodes[int(i)].max_batch)
        cluster = ClusterModel(nodes=nodes, comm=cluster.comm)
        arr = cluster.arrays
        base = np.minimum(rng.integers(0, 30, n), arr.hi).astype(np.int64)
        base = np.maximum(base, arr.lo.astype(np.int64))
        room = float(np.sum(arr.hi - base))
        remaining = int(rng.integers(1, int(min(room, 3 * n)) + 1))
        fast = _hand_out(arr, base, remaining)
        assert fast.tolist() == greedy_hand_out(cluster, base.tolist(), remaining)


def test_step_times_with_a_straggler_match_the_greedy_from_the_minima() -> None:
    """Every total's step time from the heap greedy started at the minima (an independent
    route), where the fast workers could finish far more than the range by the straggler's
    time."""
    rng = np.random.default_rng(13)
    for _ in range(6):
        cluster = random_cluster(rng, int(rng.integers(2, 12)), int(rng.integers(1, 3)))
        cluster = ClusterModel(nodes=[*cluster.nodes, NodeModel(fwd=(3.0, 0.05), bwd=(3.0, 0.1))],
                               comm=cluster.comm)
        lo, hi = bounds(cluster, 10**6)
        first = int(rng.integers(lo, min(hi, lo + 300) + 1))
        last = min(hi, first + 400)
        times = Splitter(cluster).step_times(first, last)
        minima = [n.min_batch for n in cluster.nodes]
        ref = [cluster.step_time(greedy_hand_out(cluster, minima, total - lo))
               for total in range(first, last + 1)]
        assert times.tolist() == ref


def test_straggler_costs_bounded_memory() -> None:
    """Issue 17's reproducers: a fast worker could finish thousands of samples by a
    straggler's time; only what the total needs is listed (<= 50 MB at n = 1024)."""
    import tracemalloc

    nodes = ([NodeModel(fwd=(0, 2e-6), bwd=(0, 2e-6))] * 100
             + [NodeModel(fwd=(1, 2e-6), bwd=(0, 2e-6))] * 900
             + [NodeModel(fwd=(4, .01), bwd=(0, .01))])
    tracemalloc.start()
    plan = optimal_split(ClusterModel(nodes=nodes), 30500)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50 * 2**20
    assert sum(plan.local_batches) == 30500 and plan.local_batches[-1] == 1
    assert plan.step_time == pytest.approx(4.02)


def test_large_cluster_matches_lp() -> None:
    rng = np.random.default_rng(6)
    cluster = random_cluster(rng, 1024, 2)
    lo, _ = bounds(cluster, 10**6)
    plan = optimal_split(cluster, lo + 16 * 1024)
    bound = lp_bound(cluster, lo + 16 * 1024)
    assert bound <= plan.step_time <= bound + float(cluster.arrays.slopes.max())


def test_extreme_magnitudes() -> None:
    """Slopes and offsets over 12 orders of magnitude (1e-9 s/sample next to 1e3 s): float
    rounding in inverting tau must neither lose a sample nor break the bounds."""
    rng = np.random.default_rng(9)
    for _ in range(300):
        n, m = int(rng.integers(1, 40)), int(rng.integers(1, 5))
        nodes = []
        for _ in range(n):
            lo = int(rng.integers(0, 3))
            hi = int(lo + rng.integers(1, 10 ** int(rng.integers(1, 5)))) if rng.random() < 0.6 \
                else None
            nodes.append(NodeModel(
                fwd=(float(10 ** rng.uniform(-9, 3)), float(10 ** rng.uniform(-9, 3))),
                bwd=(float(10 ** rng.uniform(-9, 3)), float(10 ** rng.uniform(-9, 3))),
                min_batch=lo, max_batch=hi))
        rho = [*np.sort(rng.uniform(0, 1, m - 1)).tolist(), 1.0]
        cluster = ClusterModel(nodes=nodes, comm=CommModel(
            buckets=[(r, float(10 ** rng.uniform(-6, 2))) for r in rho]))
        lo_sum, hi_sum = bounds(cluster, 10**7)
        total = int(rng.integers(lo_sum, min(hi_sum, lo_sum + 10 ** int(rng.integers(1, 6))) + 1))
        plan = optimal_split(cluster, total)
        assert sum(plan.local_batches) == total and within_bounds(cluster, plan.local_batches)
        bound = step_time_curve(cluster)(total)
        assert bound * (1 - 1e-9) <= plan.step_time
        assert plan.step_time <= bound + float(cluster.arrays.slopes.max()) + 1e-9 * bound


def test_deterministic() -> None:
    rng = np.random.default_rng(7)
    cluster = random_cluster(rng, 50, 2)
    twin = ClusterModel(nodes=list(cluster.nodes), comm=cluster.comm)
    lo, _ = bounds(cluster, 10**6)
    assert optimal_split(cluster, lo + 999) == optimal_split(twin, lo + 999)


def test_baselines() -> None:
    nodes = [NodeModel(fwd=(0, 1), bwd=(0, 1)), NodeModel(fwd=(0, 3), bwd=(0, 3))]
    cluster = ClusterModel(nodes=nodes)
    assert even_split(cluster, 9).local_batches == (5, 4)
    assert proportional_split(cluster, 8).local_batches == (6, 2)
    assert proportional_split(cluster, 8, throughput=[1.0, 1.0]).local_batches == (4, 4)
    with pytest.raises(ValueError, match="throughput"):
        proportional_split(cluster, 8, throughput=[1.0, 0.0])


@st.composite
def clusters(draw: st.DrawFn) -> tuple[ClusterModel, int]:
    n = draw(st.integers(1, 12))
    m = draw(st.integers(1, 3))
    pos = st.floats(1e-4, 1.0, allow_nan=False, allow_infinity=False)
    nonneg = st.floats(0.0, 1.0, allow_nan=False, allow_infinity=False)
    nodes = []
    for _ in range(n):
        lo = draw(st.integers(0, 3))
        hi = draw(st.one_of(st.none(), st.integers(max(lo, 1), lo + 60)))
        nodes.append(NodeModel(fwd=(draw(nonneg), draw(pos)), bwd=(draw(nonneg), draw(pos)),
                               min_batch=lo, max_batch=hi))
    rho = sorted(draw(st.lists(st.floats(0.0, 1.0), min_size=m - 1, max_size=m - 1)))
    comm = CommModel(buckets=[(r, draw(nonneg)) for r in [*rho, 1.0]])
    cluster = ClusterModel(nodes=nodes, comm=comm)
    lo_sum, hi_sum = bounds(cluster, 10**6)
    total = draw(st.integers(lo_sum, min(hi_sum, lo_sum + 300)))
    return cluster, total


def within_bounds(cluster: ClusterModel, local: tuple[int, ...]) -> bool:
    return all(n.min_batch <= b <= (n.max_batch if n.max_batch is not None else b)
               for n, b in zip(cluster.nodes, local, strict=True))


@settings(max_examples=150, deadline=None)
@given(clusters())
def test_properties(case: tuple[ClusterModel, int]) -> None:
    cluster, total = case
    plan = optimal_split(cluster, total)
    assert sum(plan.local_batches) == total
    assert within_bounds(cluster, plan.local_batches)
    assert plan.step_time == pytest.approx(cluster.step_time(plan.local_batches), rel=1e-12)
    bound = step_time_curve(cluster)(total)
    assert bound * (1 - 1e-9) - 1e-12 <= plan.step_time
    assert plan.step_time <= bound + float(cluster.arrays.slopes.max()) * (1 + 1e-9)
    for baseline in (even_split(cluster, total), proportional_split(cluster, total)):
        if within_bounds(cluster, baseline.local_batches):
            assert plan.step_time <= baseline.step_time * (1 + 1e-12)


def brute_force_with_zeros(cluster: ClusterModel, total: int) -> tuple[float, tuple[int, ...]]:
    """The best split over b_i in {0} U [min_batch, max_batch], by enumeration."""
    ranges = [[0, *range(max(n.min_batch, 1), (total if n.max_batch is None else n.max_batch)
                         + 1)] for n in cluster.nodes]
    return min((cluster.step_time(s), s) for s in itertools.product(*ranges) if sum(s) == total)


def fixed_cost_cluster(rng: np.random.Generator, n: int, min_batch: int) -> ClusterModel:
    """Workers up to 8x slower with fixed costs that make the slowest ones worth dropping
    to 0 samples (random_cluster's rarely are)."""
    nodes = []
    for i in range(n):
        speed = float(2 ** rng.uniform(0, 3))
        nodes.append(NodeModel(fwd=(speed * float(rng.uniform(0.02, 0.2)),
                                    speed * float(rng.uniform(1e-3, 1e-2))),
                               bwd=(speed * float(rng.uniform(0.02, 0.2)),
                                    speed * float(rng.uniform(1e-3, 2e-2))),
                               min_batch=min_batch,
                               max_batch=int(rng.integers(4, 12)) if rng.random() < 0.3 else None,
                               name=f"w{i}"))
    rho = [*np.sort(rng.uniform(0, 1, int(rng.integers(0, 3)))).tolist(), 1.0]
    return ClusterModel(nodes=nodes, comm=CommModel(buckets=[(r, float(rng.uniform(0, 0.05)))
                                                             for r in rho]))


def test_zeros_allowed_match_brute_force_on_small_clusters() -> None:
    rng = np.random.default_rng(7)
    checked = zeros = 0
    for _ in range(60):
        cluster = fixed_cost_cluster(rng, int(rng.integers(2, 5)), min_batch=1)
        for total in range(1, 13):
            caps = [nd.max_batch for nd in cluster.nodes]
            if None not in caps and sum(c for c in caps if c is not None) < total:
                continue
            plan = zero_split(cluster, total)
            best, _ = brute_force_with_zeros(cluster, total)
            assert sum(plan.local_batches) == total
            assert plan.step_time == pytest.approx(best, rel=1e-12)
            assert plan.step_time == pytest.approx(cluster.step_time(plan.local_batches),
                                                   rel=1e-12)
            if total >= cluster.size:  # optimal_split cannot go below min_batch = 1 here
                assert plan.step_time <= optimal_split(cluster, total).step_time
            zeros += 0 in plan.local_batches and total >= cluster.size
            checked += 1
    print(f"zero_split = brute force on {checked} cases, {zeros} with a worker at 0 "
          "where every worker could have had one")
    assert checked > 500 and zeros > 100


def test_an_idle_workers_own_all_reduce_matches_brute_force() -> None:
    """Where a step with a worker at 0 has an all-reduce of its own (a CPU-only job's busy
    workers reduce among themselves), against the enumeration of every split, each timed
    by the model of its kind: the same workers with the busy all-reduce or with the idle
    one, two plain ClusterModels. Dropping the busy worker of the fewest samples one at a
    time is exact here in 706 of 719 cases, and never slower than the plan made without
    the idle all-reduce, as that plan runs (faster in 19)."""
    rng = np.random.default_rng(11)
    exact = checked = gained = 0
    for _ in range(60):
        base = fixed_cost_cluster(rng, int(rng.integers(2, 5)), min_batch=1)
        busy = ClusterModel(nodes=base.nodes, comm=CommModel(
            buckets=[(r, 10 * c) for r, c in base.comm.buckets]))
        idle = CommModel(buckets=[(r, c * float(rng.uniform(0.1, 1.0)))
                                  for r, c in busy.comm.buckets])
        routed = ClusterModel(nodes=base.nodes, comm=idle)
        cluster = ClusterModel(nodes=base.nodes, comm=busy.comm, idle_comm=idle)
        for total in range(1, 13):
            caps = [nd.max_batch for nd in cluster.nodes]
            if None not in caps and sum(c for c in caps if c is not None) < total:
                continue
            ranges = [[0, *range(1, total + 1 if nd.max_batch is None else nd.max_batch + 1)]
                      for nd in cluster.nodes]
            best = min((routed if 0 in split else busy).step_time(split)
                       for split in itertools.product(*ranges) if sum(split) == total)
            plan = zero_split(cluster, total)
            kind = routed if 0 in plan.local_batches else busy
            assert sum(plan.local_batches) == total
            assert plan.step_time == pytest.approx(kind.step_time(plan.local_batches), rel=1e-12)
            assert plan.step_time >= best * (1 - 1e-12)
            unaware = zero_split(busy, total).local_batches  # as it runs, on either route
            unaware_s = (routed if 0 in unaware else busy).step_time(unaware)
            assert plan.step_time <= unaware_s * (1 + 1e-12)
            exact += plan.step_time == pytest.approx(best, rel=1e-12)
            gained += plan.step_time < unaware_s * (1 - 1e-9)
            checked += 1
    print(f"an idle all-reduce: zero_split exact in {exact} of {checked} cases, faster than "
          f"without it in {gained}")
    assert checked > 500 and exact >= 0.97 * checked and gained >= 10


def test_zeros_with_a_larger_minimum_are_valid_and_never_worse() -> None:
    # b_i in {0} U [2, cap]: not a convex set, zero_split is a heuristic here; it must be
    # valid, never worse than optimal_split, and is compared with the enumeration
    rng = np.random.default_rng(8)
    exact = checked = 0
    for _ in range(40):
        cluster = fixed_cost_cluster(rng, int(rng.integers(2, 5)), min_batch=2)
        for total in range(2 * cluster.size, 15):
            caps = [nd.max_batch for nd in cluster.nodes]
            if None not in caps and sum(c for c in caps if c is not None) < total:
                continue
            plan = zero_split(cluster, total)
            assert sum(plan.local_batches) == total
            assert all(b == 0 or b >= 2 for b in plan.local_batches), plan
            assert plan.step_time <= optimal_split(cluster, total).step_time
            best, _ = brute_force_with_zeros(cluster, total)
            exact += plan.step_time == pytest.approx(best, rel=1e-12)
            checked += 1
    print(f"min_batch 2: zero_split exact in {exact} of {checked} cases")
    assert checked > 150 and exact >= 0.95 * checked


def test_zero_split_leaves_plans_without_a_worker_at_its_minimum_alone() -> None:
    rng = np.random.default_rng(9)
    for _ in range(200):
        cluster = random_cluster(rng, int(rng.integers(1, 6)), int(rng.integers(1, 4)))
        lo, hi = bounds(cluster, 300)
        total = int(rng.integers(lo, min(hi, 300) + 1))
        plan = optimal_split(cluster, total)
        if not any(0 < b == nd.min_batch
                   for b, nd in zip(plan.local_batches, cluster.nodes, strict=True)):
            assert zero_split(cluster, total) == plan


def test_costly_worker_what_if_matches_an_independent_computation() -> None:
    # worker 2 is 4x slower with a fixed cost above the others' whole step: it is planned 0
    # and still sets the step; without it the all-reduce is also cheaper (ring: per-rank
    # traffic 2(n-1)/n), so the step is faster still
    comm = CommModel(buckets=[(0.5, 0.01), (1.0, 0.02)])
    nodes = [NodeModel(fwd=(0.01 * k, 0.0005 * k), bwd=(0.02 * k, 0.001 * k), name=f"w{i}")
             for i, k in enumerate((1.0, 2.0, 4.0))]
    cluster = ClusterModel(nodes=nodes, comm=comm)
    total = 24
    plan = zero_split(cluster, total)
    assert plan.local_batches[2] == 0
    found = costly_workers(cluster, plan)
    assert [w.rank for w in found] == [2]
    # independent: two workers, each bucket's all-reduce at (2*1/2) / (2*2/3) of the time
    ring = (2 * 1 / 2) / (2 * 2 / 3)
    rest = ClusterModel(nodes=nodes[:2], comm=CommModel(buckets=[(0.5, 0.01 * ring),
                                                                 (1.0, 0.02 * ring)]))
    alone = min(timeline_step_time(rest, [b, total - b]) for b in range(total + 1))
    with_it = timeline_step_time(cluster, list(plan.local_batches))
    assert found[0].without_step_time == pytest.approx(alone, rel=1e-12)
    assert found[0].step_time == pytest.approx(with_it, rel=1e-12)
    assert found[0].cost_s == pytest.approx(with_it - alone, rel=1e-12)
    assert found[0].speedup == pytest.approx(with_it / alone, rel=1e-12)
    print(f"costly worker: {found[0].cost_s * 1e3:.1f} ms per step, "
          f"{found[0].speedup:.2f}x faster without it")
    assert without_worker(cluster, 2).comm.total == pytest.approx(0.03 * ring)
    # a worker that costs nothing once at 0 (no fixed time, no communication) is not listed
    free = [NodeModel(fwd=(0.0, 0.0005 * k), bwd=(0.0, 0.001 * k)) for k in (1.0, 1.0, 40.0)]
    cheap = ClusterModel(nodes=free, comm=CommModel())
    plan = zero_split(cheap, total)
    assert plan.local_batches[2] == 0 and costly_workers(cheap, plan) == ()


def test_costly_workers_with_noise_match_a_monte_carlo() -> None:
    # with noisy workers both sides are expected maxima: check them by simulation
    rng = np.random.default_rng(3)
    comm = CommModel(buckets=[(1.0, 0.01)])
    nodes = [NodeModel(fwd=(0.01 * k, 0.0005 * k), bwd=(0.02 * k, 0.001 * k), noise=0.2,
                       name=f"w{i}") for i, k in enumerate((1.0, 1.0, 3.0))]
    cluster = ClusterModel(nodes=nodes, comm=comm)
    plan = zero_split(cluster, 40)
    found = costly_workers(cluster, plan)
    assert [w.rank for w in found] == [2]
    rest = without_worker(cluster, 2)
    split = zero_split(rest, 40).local_batches

    def simulate(model: ClusterModel, local: tuple[int, ...]) -> float:
        compute = np.array([nd.forward_time(b) + nd.backward_time(b)
                            for nd, b in zip(model.nodes, local, strict=True)])
        draws = compute * np.exp(0.2 * rng.standard_normal((400_000, compute.size)))
        return float(np.mean(draws.max(axis=1))) + model.comm.total

    assert found[0].step_time == pytest.approx(simulate(cluster, plan.local_batches), rel=2e-3)
    assert found[0].without_step_time == pytest.approx(simulate(rest, split), rel=2e-3)


def test_zero_split_by_expected_time_picks_the_candidate_with_the_smaller_expectation() -> None:
    rng = np.random.default_rng(10)
    differ = 0
    for _ in range(60):
        base = fixed_cost_cluster(rng, int(rng.integers(2, 5)), min_batch=1)
        noisy = ClusterModel(nodes=[dataclasses.replace(nd, noise=float(rng.uniform(0, 0.4)))
                                    for nd in base.nodes], comm=base.comm)
        for total in range(base.size, 13):
            caps = [nd.max_batch for nd in base.nodes]
            if None not in caps and sum(c for c in caps if c is not None) < total:
                continue
            assert zero_split(base, total, expected=True) == zero_split(base, total)
            candidates = {optimal_split(noisy, total).local_batches,
                          zero_split(noisy, total).local_batches}
            got = zero_split(noisy, total, expected=True).local_batches
            assert got in candidates
            assert noisy.expected_step_time(list(got)) == min(
                noisy.expected_step_time(list(c)) for c in candidates)
            differ += got != zero_split(noisy, total).local_batches
    print(f"the expected step time chose differently from the means in {differ} cases")


FLAT = 1e-5
"""A flat floor rises 1e-6 of its worker's time per sample in the model (perf.
_FLOOR_SLOPE): at most this much at the small clusters' batches."""


def with_cpu_floors(rng: np.random.Generator, cluster: ClusterModel) -> ClusterModel:
    """Most workers get a CPU floor that binds over part of their range (some flat: the
    same CPU at every batch), the others none."""
    nodes = []
    for node in cluster.nodes:
        floor = None
        if rng.random() < 0.75:
            floor = (float(rng.uniform(0, 0.8)),
                     0.0 if rng.random() < 0.2 else float(rng.uniform(0, 0.08)))
        nodes.append(dataclasses.replace(node, cpu_floor=floor))
    return ClusterModel(nodes=nodes, comm=cluster.comm)


def floored_step_time(cluster: ClusterModel, split: tuple[int, ...]) -> float:
    """Reference: the event replay of the step, or the longest CPU floor if longer."""
    floors = [n.cpu_floor[0] + n.cpu_floor[1] * b
              for n, b in zip(cluster.nodes, split, strict=True) if n.cpu_floor is not None]
    return max([timeline_step_time(cluster, list(split)), *floors])


def test_cpu_floors_match_brute_force_on_small_clusters() -> None:
    rng = np.random.default_rng(11)
    checked = floor_binds = 0
    for _ in range(100):
        cluster = with_cpu_floors(rng, random_cluster(rng, int(rng.integers(1, 4)),
                                                      int(rng.integers(1, 4)), cap=10))
        lo, hi = bounds(cluster, 14)
        for total in range(lo, min(hi, 14) + 1):
            ranges = [range(n.min_batch, (total if n.max_batch is None else n.max_batch) + 1)
                      for n in cluster.nodes]
            best = min(floored_step_time(cluster, s)
                       for s in itertools.product(*ranges) if sum(s) == total)
            plan = optimal_split(cluster, total)
            assert sum(plan.local_batches) == total
            assert plan.step_time == pytest.approx(best, rel=FLAT)
            assert plan.step_time == pytest.approx(
                floored_step_time(cluster, plan.local_batches), rel=FLAT)
            floor_binds += plan.step_time > timeline_step_time(cluster, list(plan.local_batches))
            checked += 1
    print(f"optimal_split with CPU floors = brute force on {checked} cases, a floor sets "
          f"the step in {floor_binds}")
    assert checked > 400 and floor_binds > 100


def test_cpu_floors_keep_the_curve_on_the_lp_bound() -> None:
    """The breakpoints of T*(B) include every crossing of a floor with a bucket's line."""
    rng = np.random.default_rng(12)
    for _ in range(40):
        n = int(rng.integers(1, 20))
        cluster = with_cpu_floors(rng, random_cluster(rng, n, int(rng.integers(1, 5))))
        curve = step_time_curve(cluster)
        lo, hi = bounds(cluster, 10**6)
        for total in np.linspace(lo, min(hi, lo + 40 * n), 9):
            assert curve(float(total)) == pytest.approx(lp_bound(cluster, float(total)),
                                                        rel=1e-7, abs=1e-9)


def test_cpu_floors_with_zeros_match_brute_force() -> None:
    rng = np.random.default_rng(13)
    checked = zeros = 0
    for _ in range(40):
        cluster = with_cpu_floors(rng, fixed_cost_cluster(rng, int(rng.integers(2, 5)), 1))
        for total in range(1, 11):
            caps = [nd.max_batch for nd in cluster.nodes]
            if None not in caps and sum(c for c in caps if c is not None) < total:
                continue
            ranges = [[0, *range(1, (total if n.max_batch is None else n.max_batch) + 1)]
                      for n in cluster.nodes]
            best = min(floored_step_time(cluster, s)
                       for s in itertools.product(*ranges) if sum(s) == total)
            plan = zero_split(cluster, total)
            assert plan.step_time == pytest.approx(best, rel=FLAT)
            zeros += 0 in plan.local_batches
            checked += 1
    assert checked > 250 and zeros > 50


def test_a_cpu_floor_over_micro_batches_is_the_max_of_both() -> None:
    """Where a worker accumulates, its time is its passes' or its floor's, the longer."""
    plain = NodeModel(fwd=(0.01, 0.002), bwd=(0.02, 0.004), max_batch=40, micro_batch=12)
    floored = dataclasses.replace(plain, cpu_floor=(0.15, 0.003))
    comm = CommModel(buckets=[(0.5, 0.02), (1.0, 0.01)])
    b = np.arange(0, 41, dtype=np.float64)
    without = ClusterModel(nodes=[plain], comm=comm).node_times(b[None, :])[0]
    with_floor = ClusterModel(nodes=[floored], comm=comm).node_times(b[None, :])[0]
    np.testing.assert_allclose(with_floor, np.maximum(without, 0.15 + 0.003 * b), rtol=1e-12)
    assert np.any(with_floor > without) and np.any(with_floor == without)
