"""Independent references shared by the tests and the benchmarks (which put this
directory on their path), so a benchmark's figure and a test's assertion measure against
the same thing."""

from __future__ import annotations

import heapq
import math

import numpy as np
from scipy.optimize import linprog

from cannikin.perf import ClusterModel

GNS_MONTE_CARLO_CASES = [
    (100, [8, 80], 2000.0),
    (500, [4, 8, 40], 50.0),
    (1000, [40, 4, 4, 4, 4, 4], 400.0),
    (200, [5, 5, 5, 50], 5.0),
    (300, [2, 4, 8, 16, 20], 100.0),
    (100, [10, 10, 10, 10], 40.0),
]
"""(d, local batches, noise scale): n = 2..6, b_i uneven by 10x, noise- to
signal-dominated; the noise-scale estimator's Monte Carlo cases."""


def lp_bound(cluster: ClusterModel, total: float) -> float:
    """min t s.t. t >= d_ij + a_ij b_i, sum b = B, lo <= b <= hi (the LP of DESIGN §2),
    solved by scipy's HiGHS: a lower bound on any integer split's step time."""
    arr = cluster.arrays
    n, m = arr.slopes.shape
    a_ub = np.zeros((n * m, n + 1))
    for i in range(n):
        a_ub[i * m:(i + 1) * m, i] = arr.slopes[i]
    a_ub[:, n] = -1.0
    b_ub = -arr.offsets.reshape(-1)
    a_eq = np.concatenate([np.ones(n), [0.0]])[None, :]
    bnds = [(float(lo), None if math.isinf(hi) else float(hi))
            for lo, hi in zip(arr.lo, arr.hi, strict=True)] + [(None, None)]
    res = linprog(np.concatenate([np.zeros(n), [1.0]]), A_ub=a_ub, b_ub=b_ub, A_eq=a_eq,
                  b_eq=[total], bounds=bnds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"the LP bound did not solve: {res.message}")
    return float(res.fun)


def greedy_hand_out(cluster: ClusterModel, base: list[int], remaining: int) -> list[int]:
    """Hand ``remaining`` samples out one at a time from a heap of next-sample finishing
    times (ties: the lower worker first), each worker's time evaluated as
    ``max_j(offsets + slopes * b)``: the exact greedy of DESIGN §2, one pop per sample."""
    arr = cluster.arrays
    result = list(base)

    def finish(i: int, b: int) -> float:
        return float(np.max(arr.offsets[i] + arr.slopes[i] * float(b)))

    heap = [(finish(i, b + 1), i) for i, b in enumerate(result) if b + 1 <= arr.hi[i]]
    heapq.heapify(heap)
    for _ in range(remaining):
        _, i = heapq.heappop(heap)
        result[i] += 1
        if result[i] + 1 <= arr.hi[i]:
            heapq.heappush(heap, (finish(i, result[i] + 1), i))
    return result
