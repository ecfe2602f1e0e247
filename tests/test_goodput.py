"""Goodput and the choice of B (DESIGN.md §3) against brute force and an AdaptDL-style reference."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cannikin.goodput import choose_batch_size, choose_even_batch_size, efficiency
from cannikin.optperf import optimal_split
from cannikin.perf import ClusterModel, CommModel, NodeModel
from test_optperf import random_cluster


def test_efficiency() -> None:
    assert efficiency(64, 64, 100.0) == 1.0
    assert efficiency(128, 64, 0.0) == pytest.approx(0.5)  # no noise: twice the samples wasted
    assert efficiency(128, 64, 64.0) == pytest.approx(128 / 192)
    assert efficiency(4096, 64, math.inf) == 1.0  # pure noise: any batch is fully efficient
    # gain / scale with the AdaScale gain of §3 (S per sample, |G|^2 = 1):
    s, g2, b0, b = 300.0, 1.0, 32, 256
    gain = (s / b0 + g2) / (s / b + g2)
    assert efficiency(b, b0, s / g2) == pytest.approx(gain / (b / b0))


@pytest.mark.parametrize("args, match", [
    ((64, 32, math.nan), "noise_scale"),
    ((64, 32, -1.0), "noise_scale"),
    ((0, 32, 1.0), "total_batch"),
    ((64, math.inf, 1.0), "init_batch"),
])
def test_efficiency_rejects_bad_input(args: tuple[float, float, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        efficiency(*args)


def brute_goodput(cluster: ClusterModel, phi: float, lo: int, hi: int) -> tuple[int, float]:
    best_total, best = lo, -1.0
    for total in range(lo, hi + 1):
        value = total * efficiency(total, lo, phi) / optimal_split(cluster, total).step_time
        if value > best * (1 + 1e-12):
            best_total, best = total, value
    return best_total, best


@pytest.mark.parametrize("seed", range(4))
def test_exact_maximiser_against_dense_grid(seed: int) -> None:
    """Every integer B in range, each split optimally: the choice is the exact best."""
    rng = np.random.default_rng(seed)
    for _ in range(10):
        cluster = random_cluster(rng, int(rng.integers(1, 9)), int(rng.integers(1, 4)))
        lo = max(1, sum(n.min_batch for n in cluster.nodes))
        cap = sum(10**6 if n.max_batch is None else n.max_batch for n in cluster.nodes)
        hi = min(cap, lo + int(rng.integers(0, 400)))
        phi = float(10 ** rng.uniform(-1, 4))
        choice = choose_batch_size(cluster, phi, lo, hi, min_gain=0.0)
        best_total, best = brute_goodput(cluster, phi, lo, hi)
        assert choice.goodput == pytest.approx(best, rel=1e-12)
        assert choice.total_batch == best_total
        assert choice.plan == optimal_split(cluster, best_total)
        assert choice.goodput == pytest.approx(
            choice.total_batch * choice.efficiency / choice.plan.step_time)


def adaptdl_choice(node: NodeModel, comm: CommModel, n: int, phi: float, init: int,
                   max_batch: int) -> int:
    """Pollux/AdaptDL-style: every replica gets the same local batch b, B = n*b; pick the
    b with the best goodput, evaluating the step time of one replica (all are equal)."""
    rho, remaining = comm.ready_fractions, comm.remaining
    best_b, best = 0, -1.0
    for b in range(math.ceil(init / n), max_batch // n + 1):
        step = max(node.forward_time(b) + r * node.backward_time(b) + c
                   for r, c in zip(rho, remaining, strict=True))
        value = n * b / step * (phi + init) / (phi + n * b)
        if value > best:
            best_b, best = b, value
    return n * best_b


@pytest.mark.parametrize("n, phi", [(1, 50.0), (4, 300.0), (8, 2000.0), (16, 40.0), (3, 1e5)])
def test_homogeneous_cluster_matches_adaptdl(n: int, phi: float) -> None:
    node = NodeModel(fwd=(0.02, 0.001), bwd=(0.03, 0.002), max_batch=256)
    comm = CommModel(buckets=[(0.3, 0.05), (1.0, 0.02)])
    cluster = ClusterModel(nodes=[node] * n, comm=comm)
    init, max_batch = 8 * n, 256 * n
    choice = choose_batch_size(cluster, phi, init, max_batch, min_gain=0.0)
    expected = adaptdl_choice(node, comm, n, phi, init, max_batch)
    assert choice.total_batch == expected
    assert len(set(choice.plan.local_batches)) == 1  # equal workers, equal shares


def test_noise_extremes() -> None:
    cluster = ClusterModel(nodes=[NodeModel(fwd=(0.1, 0.01), bwd=(0.1, 0.02)),
                                  NodeModel(fwd=(0.1, 0.03), bwd=(0.1, 0.06))])
    assert choose_batch_size(cluster, 0.0, 16, 200).total_batch == 16  # no noise: smallest
    assert choose_batch_size(cluster, math.inf, 16, 200).total_batch == 200  # max throughput
    capped = ClusterModel(nodes=[NodeModel(fwd=(0.1, 0.01), bwd=(0.1, 0.02), max_batch=100),
                                 NodeModel(fwd=(0.1, 0.03), bwd=(0.1, 0.06), max_batch=100)])
    # The slow worker's cap binds late: peak throughput is where the fast one fills up.
    expected, _ = brute_goodput(capped, math.inf, 16, 200)
    assert choose_batch_size(capped, math.inf, 16, 200).total_batch == expected < 200


def test_hysteresis() -> None:
    rng = np.random.default_rng(11)
    cluster = random_cluster(rng, 6, 2)
    lo = max(1, sum(n.min_batch for n in cluster.nodes))
    best = choose_batch_size(cluster, 500.0, lo, lo + 2000, min_gain=0.0)

    def goodput(total: int) -> float:
        return total * efficiency(total, lo, 500.0) / optimal_split(cluster, total).step_time

    near = next(b for b in range(best.total_batch - 1, lo - 1, -1)
                if 1.02 < best.goodput / goodput(b) < 1.04)
    stay = choose_batch_size(cluster, 500.0, lo, lo + 2000, current=near)  # 5% default
    assert stay.total_batch == near and stay.plan == optimal_split(cluster, near)
    assert stay.goodput == pytest.approx(goodput(near))
    moved = choose_batch_size(cluster, 500.0, lo, lo + 2000, current=near, min_gain=0.01)
    assert moved.total_batch == best.total_batch
    outside = choose_batch_size(cluster, 500.0, lo, lo + 2000, current=lo + 5000)
    assert outside.total_batch == best.total_batch  # current out of range: move


def test_flat_goodput_over_a_huge_range() -> None:
    """Pure noise, no caps, B up to 1e9: throughput keeps rising; the scan stays bounded."""
    cluster = ClusterModel(nodes=[NodeModel(fwd=(0.01, 1e-4), bwd=(0.01, 2e-4)),
                                  NodeModel(fwd=(0.01, 3e-4), bwd=(0.01, 6e-4))])
    choice = choose_batch_size(cluster, math.inf, 16, 10**9)
    assert choice.total_batch == 10**9
    assert choice.plan == optimal_split(cluster, 10**9)


def test_range_is_clipped_to_the_caps() -> None:
    cluster = ClusterModel(nodes=[NodeModel(fwd=(0.1, 0.01), bwd=(0.1, 0.02), max_batch=50)] * 2)
    choice = choose_batch_size(cluster, math.inf, 8, 10_000)
    assert choice.total_batch == 100
    with pytest.raises(ValueError, match="fits the workers' bounds"):
        choose_batch_size(cluster, 10.0, 200, 400)


@pytest.mark.parametrize("kwargs, match", [
    ({"noise_scale": math.nan}, "noise_scale"),
    ({"init_batch": 0}, "init_batch"),
    ({"max_batch": 4}, "max_batch"),
    ({"min_gain": -0.1}, "min_gain"),
    ({"current": 3.5}, "current"),
])
def test_choose_rejects_bad_input(kwargs: dict[str, object], match: str) -> None:
    cluster = ClusterModel(nodes=[NodeModel(fwd=(0.1, 0.01), bwd=(0.1, 0.02))])
    args: dict[str, object] = {"noise_scale": 10.0, "init_batch": 8, "max_batch": 64, **kwargs}
    with pytest.raises(ValueError, match=match):
        choose_batch_size(cluster, **args)  # type: ignore[arg-type]


def test_large_cluster_beats_sampled_totals() -> None:
    rng = np.random.default_rng(12)
    cluster = random_cluster(rng, 256, 2)
    lo = max(1, sum(n.min_batch for n in cluster.nodes))
    cap = sum(10**6 if n.max_batch is None else n.max_batch for n in cluster.nodes)
    hi = min(cap, lo + 64 * 256)
    choice = choose_batch_size(cluster, 5000.0, lo, hi, min_gain=0.0)
    for total in rng.integers(lo, hi + 1, 100):
        other = int(total) * efficiency(int(total), lo, 5000.0) / optimal_split(
            cluster, int(total)).step_time
        assert choice.goodput >= other * (1 - 1e-12)


def test_even_choice_keeps_a_cap_among_uncapped_workers() -> None:
    """AdaptDL's policy with one worker capped (a cap lowered after an out-of-memory) and
    one not: each total is shared as evenly as the cap allows, never above it (the even
    split of every worker was taken as soon as one was uncapped: (20, 20) over a cap of 4)."""
    line = ((0.01, 1e-3), (0.02, 2e-3))
    cluster = ClusterModel(nodes=[NodeModel(*line, max_batch=4), NodeModel(*line)])
    choice = choose_even_batch_size(cluster, 1e6, 4, 40)
    assert choice.total_batch == 40 and choice.plan.local_batches == (4, 36)
