"""Independent references shared by the tests and the benchmarks (which put this
directory on their path), so a benchmark's figure and a test's assertion measure against
the same thing."""

from __future__ import annotations

import heapq
import math

import numpy as np
import numpy.typing as npt
from scipy.optimize import linprog

from cannikin.perf import ClusterModel, FitConfig
from cannikin.rowfit import LEAST_TIME_FRACTION, SCALE_FLOOR

FloatArray = npt.NDArray[np.float64]

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


def robust_line_of(cfg: FitConfig, b: FloatArray, y: FloatArray, anchors: FloatArray) -> (
    tuple[float, float]
):
    """One worker's line ``y = intercept + slope*b`` as ``cannikin.rowfit.robust_lines``
    fits it, for one row alone, with np.median and plain sums: the reference for its
    vectorised code. ``b``, ``y``: the window's samples in time order; ``anchors``: rows
    (batch, time, weight)."""
    a_b, a_y, a_w = anchors[:, 0], anchors[:, 1], anchors[:, 2]
    b_all, y_all = np.concatenate([b, a_b]), np.concatenate([y, a_y])
    positive = b_all > 0
    proportional = float(np.median(y_all[positive] / b_all[positive]))
    order = np.argsort(b, kind="stable")
    bs, ys, n = b[order], y[order], len(b)
    half = (n + 1) // 2
    pairs = [(ys[i + h] - ys[i]) / (bs[i + h] - bs[i])
             for h in range(half - 2, half + 3) if 1 <= h < n
             for i in range(n - h) if bs[i + h] != bs[i]]
    slope = float(np.median(pairs)) if pairs else 0.0
    intercept = math.nan
    tiny = np.finfo(float).tiny
    least = LEAST_TIME_FRACTION * float(np.abs(y).sum()) / max(n, 1) + tiny
    for _ in range(2):
        line = slope * b + np.median(y - slope * b)
        relative = (y - line) / np.maximum(np.abs(line), least)
        deviation = np.abs(relative - np.median(relative))
        scale = 1.4826 * np.median(deviation) + SCALE_FLOOR
        inlier = deviation <= cfg.outlier_sigmas * scale
        used_b = np.concatenate([b[inlier], a_b])
        used_y = np.concatenate([y[inlier], a_y])
        weight = np.concatenate([np.ones(int(inlier.sum())), a_w])
        if np.unique(used_b).size >= 2:
            slope, intercept = _shrunk_line(used_b, used_y, weight, proportional,
                                            cfg.slope_prior_sd)
    if math.isnan(intercept):
        intercept = float(np.median(y - slope * b))
    if intercept < 0:
        slope, intercept = float(used_b @ used_y / (used_b @ used_b)), 0.0
    floor = cfg.min_slope_fraction * proportional
    if slope < floor:
        slope, intercept = floor, max(0.0, float(np.median(used_y - floor * used_b)))
    return intercept, slope


def _shrunk_line(b: FloatArray, y: FloatArray, weight: FloatArray, prior: float,
                 prior_sd: float) -> tuple[float, float]:
    """(slope, intercept) by weighted least squares, the slope's ridge toward ``prior``
    weighed by the residual variance over the prior's ((prior_sd * prior)^2)."""
    total = weight.sum()
    b_mean, y_mean = (weight * b).sum() / total, (weight * y).sum() / total
    sxx = (weight * (b - b_mean) ** 2).sum()
    sxy = (weight * (b - b_mean) * (y - y_mean)).sum()
    residual = (y - y_mean) - sxy / sxx * (b - b_mean)
    noise_var = (weight * residual**2).sum() / max(total - 2, 1.0)
    prior_var = (prior_sd * prior) ** 2
    ridge = noise_var / prior_var if prior_var > 0 else 0.0
    slope = (sxy + ridge * prior) / (sxx + ridge)
    return float(slope), float(y_mean - slope * b_mean)


def change_point_of(cfg: FitConfig, log_ratio: FloatArray) -> int:
    """Where ``cannikin.rowfit.change_points`` puts one row's change point (0: none), by a
    loop over the splits with two-pass variances: the reference for its running sums."""
    centre = np.median(log_ratio)
    reach = max(cfg.outlier_sigmas * 1.4826 * np.median(np.abs(log_ratio - centre)),
                cfg.drift_clip)
    x = np.clip(log_ratio, centre - reach, centre + reach)
    n, best, best_z = len(x), 0, 0.0
    for k in range(cfg.drift_min_segment, n - cfg.drift_min_segment + 1):
        before, after = x[:k], x[k:]
        shift = abs(after.mean() - before.mean())
        within = ((before - before.mean()) ** 2).sum() + ((after - after.mean()) ** 2).sum()
        error = (math.sqrt(within / (n - 2)) + SCALE_FLOOR) * math.sqrt(1 / k + 1 / (n - k))
        lasting = shift > math.log1p(cfg.drift_min_change) and shift > cfg.drift_sigmas * error
        if lasting and shift / error > best_z:
            best, best_z = k, shift / error
    return best


def per_sample_sqnorms(
    rng: np.random.Generator,
    g: FloatArray,
    chol: FloatArray,
    batches: list[int],
    trials: int,
    t_dof: float | None = None,
) -> tuple[FloatArray, FloatArray]:
    """|g_i|^2 and |g|^2 built from explicit per-sample gradients with covariance chol chol'.

    With ``t_dof`` the per-sample gradients are multivariate t (one heavy-tailed scale per
    sample, rescaled so the covariance is still chol chol').
    """
    total = sum(batches)
    noise = rng.standard_normal((trials, total, g.size)) @ chol.T
    if t_dof is not None:
        noise *= np.sqrt((t_dof - 2) / rng.chisquare(t_dof, (trials, total, 1)))
    samples = g + noise
    bounds = np.cumsum([0, *batches])
    local = np.stack([samples[:, lo:hi].mean(axis=1) for lo, hi in
                      zip(bounds[:-1], bounds[1:], strict=True)], axis=1)
    glob = samples.mean(axis=1)
    return np.einsum("tid,tid->ti", local, local), np.einsum("td,td->t", glob, glob)


def full_covariance_truth(rng: np.random.Generator, d: int, noise_scale: float) -> (
    tuple[FloatArray, FloatArray]
):
    """A random G and full Sigma (a random rotation of uneven variances) with
    tr(Sigma) / |G|^2 = noise_scale."""
    rot, _ = np.linalg.qr(rng.standard_normal((d, d)))
    cov = rot @ np.diag(rng.uniform(0.2, 2.0, d)) @ rot.T
    g = rng.standard_normal(d)
    g *= math.sqrt(np.trace(cov) / noise_scale) / np.linalg.norm(g)
    return g, cov
