"""Cost of the per-step noise-scale estimate, and how much the min-variance weights buy.

Run: python benchmarks/bench_gns.py [--trials N]

Prints the time of ``gns.estimate`` and ``NoiseScaleTracker.update`` per step at n = 16 and
n = 1024 workers (target: under 1 ms at n = 16), then Monte Carlo variance ratios of the
min-variance combination against equal and b_i-proportional weights, next to the ratio the
Gaussian covariance model predicts, then the same against equal weights for heavy-tailed
(multivariate t) per-sample gradients at tiny local batches (the figures of the heavy-tail
note in ``cannikin/gns.py``; ~2 minutes).
"""

from __future__ import annotations

import argparse
import math
import sys
import timeit
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the references

from cannikin import gns  # noqa: E402
from references import (  # noqa: E402
    GNS_MONTE_CARLO_CASES,
    full_covariance_truth,
    per_sample_sqnorms,
)


def time_per_call(fn, repeat: int = 7, number: int = 2000) -> float:
    """Median seconds per call over ``repeat`` runs of ``number`` calls."""
    runs = timeit.repeat(fn, repeat=repeat, number=number)
    return float(np.median(runs)) / number


def bench_cost() -> None:
    rng = np.random.default_rng(0)
    print("per-step cost (median of 7 runs):")
    for n in (16, 1024):
        batches = rng.integers(4, 64, n).tolist()
        sqnorms = rng.uniform(1.0, 2.0, n).tolist()
        tracker = gns.NoiseScaleTracker(init_batch=64)
        est = time_per_call(lambda b=batches, x=sqnorms: gns.estimate(x, b, 0.9))
        upd = time_per_call(lambda b=batches, x=sqnorms, t=tracker: t.update(x, b, 0.9))
        print(f"  n = {n:5d}: estimate {est * 1e6:7.1f} us   tracker.update {upd * 1e6:7.1f} us")


def monte_carlo_ratios(
    rng: np.random.Generator, d: int, batches: list[int], noise_scale: float, trials: int
) -> None:
    b = np.asarray(batches, dtype=float)
    sigma2 = rng.uniform(0.2, 2.0, d)
    g = rng.standard_normal(d)
    g *= math.sqrt(sigma2.sum() / noise_scale) / np.linalg.norm(g)
    std = np.sqrt(sigma2) / np.sqrt(b)[:, None]
    xs, ys = [], []
    for start in range(0, trials, 500):  # chunks keep memory small at d = 1000
        local = g + rng.standard_normal((min(500, trials - start), b.size, d)) * std
        total = np.einsum("i,tid->td", b / b.sum(), local)
        xs.append(np.einsum("tid,tid->ti", local, local))
        ys.append(np.einsum("td,td->t", total, total))
    x, y = np.concatenate(xs), np.concatenate(ys)
    var_i = (x - y[:, None]) / (1.0 / b - 1.0 / b.sum())
    sqr_i = y[:, None] - var_i / b.sum()
    weights = {
        "min": gns.min_variance_weights(b, "var"),
        "equal": np.full(b.size, 1.0 / b.size),
        "prop": b / b.sum(),
    }
    for kind, samples in (("var", var_i), ("sqr", sqr_i)):
        emp = {name: np.var(samples @ w) for name, w in weights.items()}
        model = gns.estimator_covariance(
            b, kind, tr_sigma_sq=float((sigma2**2).sum()), g_sigma_g=float(g**2 @ sigma2)
        )
        theory = {name: w @ model @ w for name, w in weights.items()}
        print(f"  b={batches!s:24} phi={noise_scale:6.0f} {kind}: "
              f"min/equal {emp['min'] / emp['equal']:.3f} "
              f"(model {theory['min'] / theory['equal']:.3f})   "
              f"min/prop {emp['min'] / emp['prop']:.3f} "
              f"(model {theory['min'] / theory['prop']:.3f})")


HEAVY_TAIL_CASES = [([1, 2, 8, 20], 30, 10.0), ([1, 2, 8, 20], 100, 1000.0),
                    ([1, 1, 1, 29], 30, 10.0), ([1, 1, 1, 29], 100, 1000.0)]
"""(local batches, d, noise scale): issue 17's tiny batches and a straggler's split, in the
tests' regime (signal-dominated, few dimensions) and a noise-dominated one."""


def heavy_tail_ratios(batches: list[int], d: int, noise_scale: float, t_dof: float | None,
                      truths: int, trials: int) -> tuple[float, float, float]:
    """Var(min-variance) / Var(equal weights) of S*, G2* and log phi (to first order,
    S*/S - G2*/G2), pooled over ``truths`` random G and Sigma (full, rotated) of ``trials``
    steps each, from explicit per-sample gradients (t with ``t_dof`` degrees of freedom,
    or Gaussian for None). Pooled: a t5 variance converges slowly (it needs eighth
    moments), one truth's ratio moves by +-5%."""
    b = np.asarray(batches, dtype=float)
    weights = {"min": gns.min_variance_weights(b, "var"), "equal": np.full(b.size, 1 / b.size)}
    rel: dict[str, dict[str, list[np.ndarray]]] = {w: {"var": [], "sqr": []} for w in weights}
    rng = np.random.default_rng(7)
    for _ in range(truths):
        g, cov = full_covariance_truth(rng, d, noise_scale)
        chol = np.linalg.cholesky(cov)
        for start in range(0, trials, 1000):  # chunks keep memory small at d = 100
            x, y = per_sample_sqnorms(rng, g, chol, batches, min(1000, trials - start), t_dof)
            var_i = (x - y[:, None]) / (1.0 / b - 1.0 / b.sum())  # the module's S_i, G2_i
            sqr_i = y[:, None] - var_i / b.sum()
            for name, w in weights.items():  # relative to the truth, so truths pool
                rel[name]["var"].append(var_i @ w / np.trace(cov))
                rel[name]["sqr"].append(sqr_i @ w / (g @ g))
    pooled = {name: {k: np.concatenate(v) for k, v in kinds.items()} for name, kinds in rel.items()}

    def ratio(of: Callable[[dict[str, np.ndarray]], np.ndarray]) -> float:
        return float(np.var(of(pooled["min"])) / np.var(of(pooled["equal"])))

    return (ratio(lambda p: p["var"]), ratio(lambda p: p["sqr"]),
            ratio(lambda p: p["var"] - p["sqr"]))


def bench_heavy_tails(truths: int, trials: int) -> None:
    print(f"heavy tails: Var(min-variance) / Var(equal weights), {truths} random G, Sigma x "
          f"{trials} steps (> 1: equal weights win)")
    for batches, d, phi in HEAVY_TAIL_CASES:
        for t_dof in (None, 10.0, 5.0):
            var, sqr, log_phi = heavy_tail_ratios(batches, d, phi, t_dof, truths, trials)
            tails = "Gaussian" if t_dof is None else f"t{t_dof:g}"
            print(f"  b={batches!s:14} d={d:3d} phi={phi:6g} {tails:8s}: S* {var:.3f}  "
                  f"G2* {sqr:.3f}  log phi {log_phi:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4000, help="Monte Carlo trials per case")
    parser.add_argument("--tail-truths", type=int, default=6,
                        help="random G, Sigma per heavy-tail case")
    parser.add_argument("--tail-trials", type=int, default=20000,
                        help="Monte Carlo steps per heavy-tail truth")
    args = parser.parse_args()
    bench_cost()
    print(f"Monte Carlo variance ratios ({args.trials} trials; < 1 means min-variance wins):")
    rng = np.random.default_rng(1)
    for d, batches, phi in GNS_MONTE_CARLO_CASES:  # the cases tests/test_gns.py checks
        monte_carlo_ratios(rng, d, batches, phi, args.trials)
    bench_heavy_tails(args.tail_truths, args.tail_trials)


if __name__ == "__main__":
    main()
