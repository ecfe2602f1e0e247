"""The planner loop under bad measurements (pure, one process).

A 4-worker ground-truth cluster (slowdowns 1, 2, 1, 1; B = 128) is measured with 5%
noise and fed to the planner as the runtime does (each step's timings arrive with the next
step's exchange). Against it: a worker that reports NaN, inf or negative times; single
10x straggler steps; a worker whose speed halves mid-run. Every plan must be valid (sums
to B, within the local bounds and caps); outliers must not move it; drift must be followed
within DRIFT_BOUND_STEPS. Quality is the true step time of the plan over the true optimum;
NaN on the steps of a probe (PlannerConfig.probe_error: one re-plan interval off the optimum
on purpose, to measure a worker at another batch size), which the near-optimal checks skip
(their cost is bounded in tests/test_planner_model.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from cannikin.optperf import optimal_split
from cannikin.perf import ClusterModel, CommModel, NodeModel
from cannikin.runtime.planner import Planner, PlannerConfig, StepReport, WorkerReport

COMM = CommModel(buckets=[(0.4, 0.004), (1.0, 0.006)])
B = 128
SPEEDS = (1.0, 2.0, 1.0, 1.0)
CAPS = (None, None, 40, None)
STEPS = 160
SEEDS = range(5)
NEAR_OPTIMAL = 1.05
"""A plan "follows" the cluster when its true step time is within 5% of the optimum."""
DRIFT_BOUND_STEPS = 20
"""Steps after a 2x slowdown by which the plan must be near-optimal for good."""
LONG_RUN_STEPS = 400
"""Long enough for the warm-up's even-split samples to leave every fitter's window."""

Corrupt = Callable[[int, list[StepReport]], list[StepReport]]


def truth(slowdowns: Sequence[float]) -> ClusterModel:
    return ClusterModel(nodes=[NodeModel(fwd=(0.003 * k, 0.0004 * k), bwd=(0.006 * k, 0.0008 * k),
                                         max_batch=cap)
                               for k, cap in zip(slowdowns, CAPS, strict=True)], comm=COMM)


def measure(cluster: ClusterModel, split: Sequence[int],
            rng: np.random.Generator) -> list[StepReport]:
    """Each rank's measurements of one step (5% multiplicative noise)."""
    step = cluster.step_time(list(split)) * (1 + 0.05 * rng.standard_normal())
    ready = [[n.forward_time(b) + rho * n.backward_time(b) for rho, _ in COMM.buckets]
             for n, b in zip(cluster.nodes, split, strict=True)]
    last = np.max(ready, axis=0)
    return [StepReport(batch=b, sqnorm=1.0 + 50.0 / max(b, 1),
                       fwd_s=n.forward_time(b) * (1 + 0.05 * rng.standard_normal()),
                       bwd_s=n.backward_time(b) * (1 + 0.05 * rng.standard_normal()),
                       step_s=step, ready_fractions=(0.4, 1.0),
                       allreduce_s=tuple(c + w for (_, c), w in
                                         zip(COMM.buckets, last - np.array(ready[i]),
                                             strict=True)))
            for i, (n, b) in enumerate(zip(cluster.nodes, split, strict=True))]


def drive(speeds_at: Callable[[int], Sequence[float]], seed: int,
          corrupt: Corrupt | None = None,
          inspect: Callable[[int, Planner], None] | None = None, steps: int = STEPS
          ) -> tuple[list[tuple[int, ...]], list[float]]:
    """Run the planner loop; return each step's split and its true time / optimum.
    ``inspect(step, planner)`` is called after each step's measurements are folded in."""
    planner = Planner(PlannerConfig(world_size=len(SPEEDS), init_batch=B, caps=CAPS),
                      log_plans=False)
    rng = np.random.default_rng(seed)
    previous: list[StepReport | None] = [None] * len(SPEEDS)
    previous_global: float | None = None
    splits, quality = [], []
    for step in range(steps):
        cluster = truth(speeds_at(step))
        split = planner.split_for(planner.total_batch)
        splits.append(split)
        quality.append(math.nan if planner.current.reason.startswith("probe") else
                       cluster.step_time(list(split)) / optimal_split(cluster, B).step_time)
        planner.observe(step, [WorkerReport(batch=b, previous=p)
                               for b, p in zip(split, previous, strict=True)], previous_global)
        measured = list(measure(cluster, split, rng))
        previous = list(corrupt(step, measured) if corrupt else measured)
        previous_global = 1.0 + 50.0 / sum(split)
        if not planner.measures(step):  # the runtime sends nothing of an unmeasured step
            previous, previous_global = [None] * len(SPEEDS), None
        if inspect is not None:
            inspect(step, planner)
        if planner.due(step):
            planner.replan(step)
    return splits, quality


def assert_valid(splits: Sequence[tuple[int, ...]], least: int = 1) -> None:
    for split in splits:
        assert sum(split) == B and min(split) >= least, split
        assert all(cap is None or b <= cap for b, cap in zip(split, CAPS, strict=True)), split


def settled_at(quality: Sequence[float], start: int) -> int:
    """Steps from ``start`` until every later plan is near-optimal."""
    late = [s for s in range(start, len(quality)) if quality[s] > NEAR_OPTIMAL]
    return late[-1] + 1 - start if late else 0


def steady(step: int) -> Sequence[float]:
    return SPEEDS


def clean_settle() -> list[int]:
    return [settled_at(drive(steady, seed)[1], 0) for seed in SEEDS]


def bad_timer(value: float) -> Corrupt:
    """Worker 1 (the slow one) reports ``value`` for every time on every third step."""
    def corrupt(step: int, reports: list[StepReport]) -> list[StepReport]:
        if step % 3:
            return reports
        reports[1] = dataclasses.replace(reports[1], fwd_s=value, bwd_s=value, step_s=value,
                                         allreduce_s=(value, value), sqnorm=value)
        return reports
    return corrupt


def phase_noise(seed: int) -> Corrupt:
    """Every forward and backward time off by its own factor exp(0.25 z): ~25% noise, as
    on real quota workers."""
    rng = np.random.default_rng(200 + seed)

    def corrupt(step: int, reports: list[StepReport]) -> list[StepReport]:
        factors = np.exp(0.25 * rng.standard_normal((len(reports), 2)))
        return [dataclasses.replace(r, fwd_s=r.fwd_s * kf, bwd_s=r.bwd_s * kb)
                for r, (kf, kb) in zip(reports, factors, strict=True)]
    return corrupt


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.01, -math.inf])
def test_non_finite_or_negative_times_are_ignored(value: float) -> None:
    for seed in SEEDS[:3]:
        splits, quality = drive(steady, seed, bad_timer(value))
        assert_valid(splits)
        assert settled_at(quality, 0) <= 30, (seed, quality)  # converges as with clean data
        assert np.nanmax(quality[30:]) <= NEAR_OPTIMAL


STRAGGLERS = (40, 41, 77, 120)
"""Steps on which worker ``step % 4`` is 10x slow (one step each)."""


def test_ten_x_straggler_steps_do_not_swing_the_plan() -> None:
    def straggle(step: int, reports: list[StepReport]) -> list[StepReport]:
        if step in STRAGGLERS:
            i = step % 4
            r = reports[i]
            reports[i] = dataclasses.replace(r, fwd_s=10 * r.fwd_s, bwd_s=10 * r.bwd_s)
            reports = [dataclasses.replace(t, step_s=10 * t.step_s) for t in reports]
        return reports

    def predictions(store: dict[int, float]) -> Callable[[int, Planner], None]:
        def inspect(step: int, planner: Planner) -> None:
            # the straggler's sample is in the window from step + 1 on: the worker's model
            # at its current batch, fitted now
            if step - 1 in STRAGGLERS:
                i = (step - 1) % 4
                model = planner.fitters[i].fit()
                assert model is not None
                b = planner.local_batches[i]
                store[step] = model.forward_time(b) + model.backward_time(b)
        return inspect

    worst = 0.0
    for seed in SEEDS:
        clean_fit: dict[int, float] = {}
        hit_fit: dict[int, float] = {}
        drive(steady, seed, inspect=predictions(clean_fit))
        splits, quality = drive(steady, seed, straggle, inspect=predictions(hit_fit))
        assert_valid(splits)
        assert np.nanmax(quality[30:]) <= NEAR_OPTIMAL, (seed, quality)
        worst = max(worst, *(abs(hit_fit[s] / clean_fit[s] - 1) for s in clean_fit))
    print(f"10x straggler: worst change of the straggler's fitted time {worst:.1%}")
    assert worst < 0.03


@pytest.mark.parametrize(("worker", "factor"), [(0, 2.0), (1, 0.5), (3, 2.0)])
def test_a_two_x_drift_is_followed_within_a_bounded_number_of_steps(
        worker: int, factor: float) -> None:
    drift_at = 70

    def speeds(step: int) -> Sequence[float]:
        if step < drift_at:
            return SPEEDS
        return tuple(k * factor if i == worker else k for i, k in enumerate(SPEEDS))

    followed = []
    for seed in SEEDS:
        splits, quality = drive(speeds, seed)
        assert_valid(splits)
        assert np.nanmax(quality[30:drift_at]) <= NEAR_OPTIMAL
        followed.append(settled_at(quality, drift_at))
    print(f"drift of worker {worker} x{factor}: followed after {followed} steps")
    assert max(followed) <= DRIFT_BOUND_STEPS, followed


def test_heavy_timing_noise_does_not_trigger_drift_replans() -> None:
    # a busy shared CPU (3 processes on 2 shared cores): compute times off by a factor
    # exp(0.4 z) step to step, and every 5th step a 5x hiccup (an evaluation, a checkpoint,
    # another job); no real change. The 30% rule on a median of 6 alone re-plans on it.
    def noisy(seed: int) -> Corrupt:
        rng = np.random.default_rng(100 + seed)

        def corrupt(step: int, reports: list[StepReport]) -> list[StepReport]:
            factors = np.exp(0.4 * rng.standard_normal(len(reports))) * (5 if step % 5 == 0 else 1)
            return [dataclasses.replace(r, fwd_s=r.fwd_s * k, bwd_s=r.bwd_s * k)
                    for r, k in zip(reports, factors, strict=True)]
        return corrupt

    planners: list[Planner] = []
    drift_replans = []
    for seed in SEEDS:
        splits, _ = drive(steady, seed, noisy(seed), inspect=lambda _, p: planners.append(p))
        assert_valid(splits, least=0)  # noise this heavy can start a measured trial at 0
        drift_replans.append(sum("drifted" in r.reason for r in planners[-1].history))
    print(f"drift re-plans in {STEPS} steps under heavy noise: {drift_replans}")
    assert max(drift_replans) <= 2, drift_replans


def test_a_held_plan_stays_near_optimal_under_heavy_noise_for_long() -> None:
    # once a plan holds, each worker's batch spans a few samples; under 25% timing noise the
    # least-squares slope of so narrow a range lands near 0 about as often as near the truth,
    # and the next plan then gives that worker most of the batch. Without the fitter's slope
    # prior (FitConfig.slope_prior_sd) the worst plans here were 1.15-1.32x the optimum
    # (up to 2.6x in 2000-step runs); with it, 1.03-1.06x.
    worst = []
    for seed in SEEDS:
        splits, quality = drive(steady, seed, phase_noise(seed), steps=LONG_RUN_STEPS)
        assert_valid(splits)
        worst.append(float(np.nanmax(quality[50:])))
    print(f"25% noise, {LONG_RUN_STEPS} steps: worst plan after step 50 / optimum "
          f"{[round(w, 3) for w in worst]}")
    assert max(worst) <= 1.15, worst


def test_a_plan_under_heavy_noise_settles() -> None:
    # real quota workers time their steps with ~25% noise: there the optimum the model
    # predicts moves by a few samples at every re-plan, and with a fixed 0.3% hold the split
    # changed 28-48 times in 500 steps, the cadence never lengthened (88-100% of steps
    # measured, 52-72 re-plans, each a refit on every rank). A gain within the model's own
    # standard error now keeps the split (PlannerConfig.hold_sigmas), and a probe hands the
    # cadence back to the split it interrupted: 12-18 changes, 66-81% measured, 32-42
    # re-plans, the same plan quality (mean 1.010-1.018 of the optimum, was 1.010-1.020).
    # With outliers told by relative deviation: 12-24 changes, 30-48 re-plans, mean
    # 1.007-1.024 (absolute: 13-23, 30-48, 1.016-1.026). A re-balance of a plan measured at
    # the stride keeping it: 9-15 changes, 21-37 re-plans, 28-61% measured, mean
    # 1.011-1.023 (12-18, 31-41, 59-80% and 1.012-1.019 before)
    def recorder(measured: list[bool], replans: list[bool]) -> Callable[[int, Planner], None]:
        def inspect(step: int, planner: Planner) -> None:
            measured.append(planner.measures(step))
            replans.append(planner.due(step))
        return inspect

    for seed in SEEDS:
        measured: list[bool] = []
        replans: list[bool] = []
        splits, quality = drive(steady, seed, phase_noise(seed),
                                inspect=recorder(measured, replans), steps=600)
        changes = sum(a != b for a, b in zip(splits[100:], splits[101:], strict=False))
        figures = (changes, sum(replans[100:]), sum(measured[100:]) / 500,
                   float(np.nanmean(quality[100:])))
        print(f"seed {seed}: changes, re-plans, measured fraction, mean quality {figures}")
        assert changes <= 24 and sum(replans[100:]) <= 48 and figures[2] <= 0.7, figures
        assert figures[3] <= 1.04, figures
