"""Planning with gradient accumulation (issue 18): the time model of k passes per step,
and OptPerf and goodput over it, against a reference written from the formula and
brute force over every split."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from cannikin.goodput import choose_batch_size, efficiency
from cannikin.optperf import Splitter, optimal_split, zero_split
from cannikin.perf import ClusterModel, CommModel, NodeModel, even_passes, micro_batches


def reference_time(node: NodeModel, comm: CommModel, batch: int) -> float:
    """One worker's step: k - 1 passes of full forward and backward, then the last pass of
    b/k samples, whose backward overlaps the all-reduce bucket by bucket (every bucket,
    not only the binding ones)."""
    cap = node.micro_batch
    passes = 1 if cap is None or batch <= cap else math.ceil(batch / cap)
    passes = node.fixed_passes or passes
    last = batch / passes
    (f0, f1), (k0, k1) = node.fwd, node.bwd
    earlier = (passes - 1) * (f0 + k0) + (f1 + k1) * (batch - last)
    costs = [c for _, c in comm.buckets]
    tail = max(f0 + f1 * last + rho * (k0 + k1 * last) + sum(costs[j:])
               for j, (rho, _) in enumerate(comm.buckets))
    return earlier + tail


def reference_step(cluster: ClusterModel, split: tuple[int, ...]) -> float:
    return max(reference_time(n, cluster.comm, b) for n, b in zip(cluster.nodes, split,
                                                                 strict=True))


def accumulating_cluster(rng: np.random.Generator, n: int, m: int) -> ClusterModel:
    nodes = []
    for i in range(n):
        speed = float(10 ** rng.uniform(0, 1))
        micro = int(rng.integers(1, 6))
        accumulates = rng.random() < 0.75
        top = int(micro * rng.integers(1, 5)) if accumulates else micro
        # now and then a minimum beyond one pass (a probe pins a worker's batch)
        least = int(rng.integers(0, top + 1)) if rng.random() < 0.2 else int(rng.integers(0, 2))
        nodes.append(NodeModel(
            fwd=(float(rng.uniform(0, 0.05)), speed * float(rng.uniform(1e-3, 1e-2))),
            bwd=(float(rng.uniform(0, 0.05)), speed * float(rng.uniform(1e-3, 2e-2))),
            min_batch=least, max_batch=top,
            micro_batch=micro if accumulates else None, name=f"w{i}"))
    rho = [*np.sort(rng.uniform(0, 1, m - 1)).tolist(), 1.0]
    comm = CommModel(buckets=[(r, float(rng.uniform(0, 0.1))) for r in rho])
    return ClusterModel(nodes=nodes, comm=comm)


def splits(cluster: ClusterModel, total: int) -> list[tuple[int, ...]]:
    ranges = [range(n.min_batch, min(total, n.max_batch or total) + 1) for n in cluster.nodes]
    return [s for s in itertools.product(*ranges) if sum(s) == total]


def test_micro_batches_are_as_few_and_as_even_as_fit() -> None:
    assert micro_batches(130, 64) == (44, 43, 43)
    assert micro_batches(128, 64) == (64, 64)
    assert micro_batches(64, 64) == (64,)
    assert micro_batches(7, None) == (7,)
    assert micro_batches(0, 4) == (0,)
    for batch in range(0, 60):
        for cap in range(1, 12):
            sizes = micro_batches(batch, cap)
            assert sum(sizes) == batch and max(sizes) <= cap
            assert len(sizes) == max(1, math.ceil(batch / cap))
            assert max(sizes) - min(sizes) <= 1 and list(sizes) == sorted(sizes, reverse=True)
    with pytest.raises(ValueError, match="cap=0"):
        micro_batches(5, 0)
    with pytest.raises(ValueError, match="batch=-1"):
        micro_batches(-1, 4)


def test_node_times_match_the_formula() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        cluster = accumulating_cluster(rng, int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        for _ in range(20):
            split = tuple(int(rng.integers(0, (n.max_batch or 1) + 1)) for n in cluster.nodes)
            want = [reference_time(n, cluster.comm, b) for n, b in zip(cluster.nodes, split,
                                                                      strict=True)]
            np.testing.assert_allclose(cluster.node_times(split), want, rtol=1e-12)


def test_optimal_split_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    checked = accumulated = 0
    for _ in range(150):
        cluster = accumulating_cluster(rng, int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        lo = sum(n.min_batch for n in cluster.nodes)
        hi = sum(n.max_batch or 0 for n in cluster.nodes)
        for total in range(lo, min(hi, 24) + 1):
            best = min(reference_step(cluster, s) for s in splits(cluster, total))
            plan = optimal_split(cluster, total)
            assert sum(plan.local_batches) == total
            assert all(n.min_batch <= b <= (n.max_batch or b)
                       for n, b in zip(cluster.nodes, plan.local_batches, strict=True))
            assert plan.step_time == pytest.approx(best, rel=1e-9)
            assert reference_step(cluster, plan.local_batches) == pytest.approx(best, rel=1e-9)
            accumulated += any(n.micro_batch is not None and b > n.micro_batch
                               for n, b in zip(cluster.nodes, plan.local_batches, strict=True))
            checked += 1
    assert checked > 1000 and accumulated > 200


def test_step_times_for_a_range_match_brute_force() -> None:
    rng = np.random.default_rng(2)
    for _ in range(40):
        cluster = accumulating_cluster(rng, int(rng.integers(2, 4)), 2)
        lo = sum(n.min_batch for n in cluster.nodes)
        hi = min(sum(n.max_batch or 0 for n in cluster.nodes), 20)
        times = Splitter(cluster).step_times(lo, hi)
        want = [min(reference_step(cluster, s) for s in splits(cluster, t))
                for t in range(lo, hi + 1)]
        np.testing.assert_allclose(times, want, rtol=1e-9)


def test_curve_is_a_lower_bound_and_tight_at_its_breakpoints() -> None:
    rng = np.random.default_rng(3)
    for _ in range(40):
        cluster = accumulating_cluster(rng, int(rng.integers(2, 4)), 2)
        splitter = Splitter(cluster)
        curve = splitter.curve
        for total in range(math.ceil(curve.min_total), int(min(curve.max_total, 20)) + 1):
            assert curve(total) <= splitter.split(total).step_time * (1 + 1e-12)


def test_goodput_choice_matches_brute_force() -> None:
    rng = np.random.default_rng(4)
    for _ in range(30):
        cluster = accumulating_cluster(rng, int(rng.integers(2, 4)), 2)
        hi = sum(n.max_batch or 0 for n in cluster.nodes)
        init = max(sum(n.min_batch for n in cluster.nodes), 1)
        if hi < init + 2:
            continue
        noise = float(10 ** rng.uniform(0, 2))
        choice = choose_batch_size(cluster, noise, init, hi)
        goodput = {t: t * efficiency(t, init, noise)
                   / min(reference_step(cluster, s) for s in splits(cluster, t))
                   for t in range(init, hi + 1)}
        assert choice.goodput == pytest.approx(max(goodput.values()), rel=1e-9)


def test_a_batch_beyond_the_memory_caps_accumulates_on_the_fast_worker() -> None:
    fast = NodeModel(fwd=(0.002, 1e-4), bwd=(0.004, 2e-4), max_batch=512, micro_batch=64)
    slow = NodeModel(fwd=(0.002, 4e-4), bwd=(0.004, 8e-4), max_batch=512, micro_batch=64)
    cluster = ClusterModel([fast, slow], CommModel([(0.5, 0.01), (1.0, 0.01)]))
    plan = optimal_split(cluster, 300)
    assert plan.local_batches[0] > 128 and plan.local_batches[1] <= 128
    assert plan.step_time == pytest.approx(reference_step(cluster, plan.local_batches))
    # within the caps accumulation is used only where it pays: equal speeds, no extra pass
    even = ClusterModel([fast, NodeModel(fwd=fast.fwd, bwd=fast.bwd, max_batch=512,
                                         micro_batch=64)], cluster.comm)
    assert optimal_split(even, 128).local_batches == (64, 64)


def test_zero_split_with_accumulation_is_never_worse() -> None:
    rng = np.random.default_rng(5)
    for _ in range(40):
        cluster = accumulating_cluster(rng, 3, 2)
        lo = sum(n.min_batch for n in cluster.nodes)
        hi = min(sum(n.max_batch or 0 for n in cluster.nodes), 18)
        for total in range(max(lo, 1), hi + 1):
            plan = zero_split(cluster, total)
            assert sum(plan.local_batches) == total
            assert reference_step(cluster, plan.local_batches) <= (
                optimal_split(cluster, total).step_time * (1 + 1e-12))


def test_bad_micro_batch() -> None:
    with pytest.raises(ValueError, match="needs a max_batch"):
        NodeModel(fwd=(0, 1e-3), bwd=(0, 1e-3), micro_batch=8)
    with pytest.raises(ValueError, match="micro_batch=0"):
        NodeModel(fwd=(0, 1e-3), bwd=(0, 1e-3), max_batch=8, micro_batch=0)


def test_even_passes_are_exactly_so_many_with_the_empty_ones_first() -> None:
    assert even_passes(10, 3) == (4, 3, 3)
    assert even_passes(9, 3) == (3, 3, 3)
    assert even_passes(2, 3) == (0, 1, 1)  # the last pass, which weighs the all-reduce
    assert even_passes(0, 3) == (0, 0, 0)
    for batch in range(0, 40):
        for count in range(1, 9):
            sizes = even_passes(batch, count)
            assert len(sizes) == count and sum(sizes) == batch
            assert max(sizes) - min(sizes) <= 1
            assert sizes[-1] > 0 or batch == 0
            assert list(sizes) in (sorted(sizes), sorted(sizes, reverse=True))  # one rescale
    with pytest.raises(ValueError, match="count=0"):
        even_passes(5, 0)


def fixed_cluster(rng: np.random.Generator, n: int, m: int) -> ClusterModel:
    """Workers that run every step in a fixed number of passes (some in one)."""
    nodes = []
    for i in range(n):
        speed = float(10 ** rng.uniform(0, 1))
        passes = int(rng.integers(1, 5))
        nodes.append(NodeModel(
            fwd=(float(rng.uniform(0, 0.05)), speed * float(rng.uniform(1e-3, 1e-2))),
            bwd=(float(rng.uniform(0, 0.05)), speed * float(rng.uniform(1e-3, 2e-2))),
            min_batch=int(rng.integers(0, 3)), max_batch=int(rng.integers(4, 12)),
            fixed_passes=passes, name=f"w{i}"))
    rho = [*np.sort(rng.uniform(0, 1, m - 1)).tolist(), 1.0]
    comm = CommModel(buckets=[(r, float(rng.uniform(0, 0.1))) for r in rho])
    return ClusterModel(nodes=nodes, comm=comm)


def test_fixed_passes_time_and_optimal_split_match_the_formula_and_brute_force() -> None:
    # k passes of b/k from the first sample: (k-1) whole passes and the last one's backward
    # overlapping the all-reduce, as the runtime runs Lightning's accumulate_grad_batches
    rng = np.random.default_rng(6)
    checked = 0
    for _ in range(60):
        cluster = fixed_cluster(rng, int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        for b in range(0, 12):
            split = tuple(min(b, n.max_batch or b) for n in cluster.nodes)
            want = [reference_time(n, cluster.comm, x) for n, x in zip(cluster.nodes, split,
                                                                       strict=True)]
            np.testing.assert_allclose(cluster.node_times(split), want, rtol=1e-12)
        lo = sum(n.min_batch for n in cluster.nodes)
        hi = min(sum(n.max_batch or 0 for n in cluster.nodes), 20)
        for total in range(max(lo, 1), hi + 1):
            best = min(reference_step(cluster, s) for s in splits(cluster, total))
            assert optimal_split(cluster, total).step_time == pytest.approx(best, rel=1e-9)
            checked += 1
    assert checked > 300
    with pytest.raises(ValueError, match="two rules"):
        NodeModel(fwd=(0, 1e-3), bwd=(0, 1e-3), max_batch=8, micro_batch=4, fixed_passes=2)
    with pytest.raises(ValueError, match="fixed_passes=0"):
        NodeModel(fwd=(0, 1e-3), bwd=(0, 1e-3), fixed_passes=0)
