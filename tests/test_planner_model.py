"""What the planner's model predicts away from the split in use (issue 13), in one process.

Ground truth: three workers at speeds 1, 1/2, 1/4 (as CPU quotas 100/50/25%) with a fixed
cost large enough that the optimal split gives the slowest worker 0-2 samples; every
phase is measured with 25% multiplicative noise, and the measured step is the slowest
worker's noisy time plus the communication (so a balanced step is the max of noisy times).
The planner sees only those reports, one step late, as the runtime feeds it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from cannikin.optperf import even_split, optimal_split, split_without, zero_split
from cannikin.perf import ClusterModel, CommModel, NodeModel
from cannikin.runtime.decision import Decision
from cannikin.runtime.planner import Planner, PlannerConfig, StepReport, WorkerReport

COMM = CommModel(buckets=[(0.4, 0.004), (1.0, 0.006)])
SPEEDS = (1.0, 0.5, 0.25)
B = 680
"""Optimum (511, 169, 0): the slowest worker's fixed time is about the others' whole step."""
NOISE = 0.25
SEEDS = range(5)


CORES = SPEEDS
"""The cores each worker may use (its quota), reported with its CPU per step."""


def truth(speeds: Sequence[float] = SPEEDS) -> ClusterModel:
    return ClusterModel(nodes=[NodeModel(fwd=(0.02 / s, 0.0001 / s), bwd=(0.03 / s, 0.0002 / s))
                               for s in speeds], comm=COMM)


@dataclasses.dataclass
class Run:
    planner: Planner
    quality: list[float]
    """True step time of each step's split over the true optimum (zeros allowed)."""
    predicted: list[float]
    measured: list[float]


def drive(seed: int, steps: int, config: PlannerConfig | None = None,
          cluster: ClusterModel | None = None, total: int = B,
          extra: Callable[[Sequence[int]], float] | None = None,
          pins: Sequence[tuple[int, Sequence[int] | None]] = (),
          share: Callable[[Callable[[], Decision]], Decision] | None = None,
          later: tuple[int, ClusterModel] | None = None) -> Run:
    """``extra(split)``: seconds the truth adds to the last all-reduce of a step with
    ``split`` (the model cannot express it: its all-reduce is the same for every split).
    ``pins``: (step, split) pinned from that step on, or released with None
    (:meth:`Planner.pin`). ``share``: how each re-plan's decision is made
    (:meth:`Planner.replan`). ``later``: (step, the truth from that step on)."""
    cluster = cluster or truth()
    n = cluster.size
    planner = Planner(config or PlannerConfig(world_size=n, init_batch=total), log_plans=False)
    rng = np.random.default_rng(seed)

    def best_of(cluster: ClusterModel) -> float:
        return min(zero_split(cluster, total).step_time,
                   *(cluster.step_time(list(p.local_batches)) + (extra(p.local_batches)
                                                                 if extra else 0.0)
                     for p in (zero_split(cluster, total),
                               split_without(cluster, total, {n - 1}))))

    best = best_of(cluster)
    run = Run(planner, [], [], [])
    quotas = [CORES[i] if nd.cpu_floor else 0.0 for i, nd in enumerate(cluster.nodes)]
    previous: list[StepReport | None] = [None] * n
    previous_global: float | None = None
    for step in range(steps):
        if later is not None and step == later[0]:
            cluster = later[1]
            best = best_of(cluster)
        for at, pinned in pins:
            if step == at:
                planner.pin(step, pinned)
        split = planner.split_for(planner.total_batch)
        run.quality.append((cluster.step_time(list(split))
                            + (extra(split) if extra else 0.0)) / best)
        predicted = planner.predicted(split)
        planner.observe(step, [WorkerReport(batch=b, previous=p)
                               for b, p in zip(split, previous, strict=True)], previous_global)
        added = 0.0 if extra is None else extra(split)
        fwd, bwd, floors, measured = simulate_step(cluster, split, rng, added)
        if predicted is not None:
            run.predicted.append(predicted)
            run.measured.append(measured)
        previous = [StepReport(batch=b, sqnorm=1.0 + 50.0 / max(b, 1), fwd_s=f, bwd_s=k,
                               step_s=measured, ready_fractions=(0.4, 1.0),
                               allreduce_s=(COMM.buckets[0][1], COMM.buckets[1][1] + added),
                               cpu_s=floor * cores, cpu_cores=cores)
                    for b, f, k, floor, cores in zip(split, fwd, bwd, floors, quotas,
                                                     strict=True)]
        previous_global = 1.0 + 50.0 / sum(split)
        if not planner.measures(step):  # the runtime sends nothing of an unmeasured step
            previous, previous_global = [None] * n, None
        if planner.due(step):
            planner.replan(step, share=share)
    return run


def simulate_step(cluster: ClusterModel, split: Sequence[int], rng: np.random.Generator,
                  added: float = 0.0) -> tuple[list[float], list[float], list[float], float]:
    """One step of ``cluster`` at ``split``: each worker's noisy forward and backward, its
    noisy CPU floor (0.0 without one), and the step's time (the last all-reduce ``added``
    seconds longer)."""
    factors = np.exp(NOISE * rng.standard_normal((cluster.size, 2)))
    fwd = [nd.forward_time(b) * k[0] for nd, b, k in zip(cluster.nodes, split, factors,
                                                           strict=True)]
    bwd = [nd.backward_time(b) * k[1] for nd, b, k in zip(cluster.nodes, split, factors,
                                                            strict=True)]
    floors = [0.0] * cluster.size
    if any(nd.cpu_floor for nd in cluster.nodes):  # a floor's noise: CPU varies less
        floors = [(nd.cpu_idle if b == 0 and nd.cpu_idle is not None else
                   nd.cpu_floor[0] + nd.cpu_floor[1] * b) * float(np.exp(0.05 * z))
                  if nd.cpu_floor else 0.0 for nd, b, z in
                  zip(cluster.nodes, split, rng.standard_normal(cluster.size), strict=True)]
    measured = max(max(f + k for f, k in zip(fwd, bwd, strict=True)) + COMM.buckets[-1][1]
                   + added, *floors)
    return fwd, bwd, floors, measured


def refit(planner: Planner) -> ClusterModel:
    nodes = [f.fit(name=str(i)) for i, f in enumerate(planner.fitters)]
    assert all(nd is not None for nd in nodes)
    return ClusterModel(nodes=[nd for nd in nodes if nd is not None], comm=COMM)


def test_the_model_predicts_splits_away_from_the_one_in_use() -> None:
    # before: with the window alone the slowest worker's slope came from 1 vs 2 samples,
    # 10-28 ms/sample against 1.2; the even split was predicted at 2.5-6.5 s (0.48 s true)
    cluster = truth()
    errors = []
    for seed in SEEDS:
        run = drive(seed, 1000)
        model = refit(run.planner)
        held = run.planner.local_batches
        other = (B - 2 * max(held[2], 1) - held[1] // 2, held[1] // 2, 2 * max(held[2], 1))
        for split in (even_split(cluster, B).local_batches, other):
            errors.append(model.step_time(list(split)) / cluster.step_time(list(split)) - 1)
            for i, (fitted, node) in enumerate(zip(model.nodes, cluster.nodes, strict=True)):
                b = split[i]
                want = node.forward_time(b) + node.backward_time(b)
                got = fitted.forward_time(b) + fitted.backward_time(b)
                # over 20 seeds the worst worker of a run was 5-21% off (median 10%; 3-30%
                # before a re-balance kept the measuring stride); without the anchors, 5-20x
                assert got == pytest.approx(want, rel=0.2), (seed, split, i)
    print(f"step time predicted away from the held split: errors "
          f"{[f'{e:+.1%}' for e in errors]}")
    # over 20 seeds: median 4%, 90% within 10%, the worst 21% (3%, 9% and 30% before a
    # re-balance kept the measuring stride)
    assert float(np.median(np.abs(errors))) <= 0.08 and max(abs(e) for e in errors) <= 0.2


def test_a_worker_held_at_0_samples_is_fitted_from_its_steps_there() -> None:
    # the warm-up's even split, the slowest worker pinned at 20 samples, then at 0 (no
    # probe, no trial): its steps at 0 are the one measure of its time there, which is
    # below its line's intercept (no forward and backward: on real quota workers 8 ms at 0
    # samples, 19 at 4, 59 at 160). Taken into the line they gave a slope through 0 and 20:
    # +16-19% at 0 samples, -50% at 20, and at 4x its share there (440, 160, 80) the
    # step 21-27% fast
    cluster = ClusterModel(nodes=[dataclasses.replace(nd, idle_times=(0.3 * nd.fwd[0],
                                                                      0.3 * nd.bwd[0]))
                                  for nd in truth().nodes], comm=COMM)
    node = cluster.nodes[2]
    errors = []
    for seed in SEEDS:
        run = drive(seed, 300, cluster=cluster, pins=[(8, (560, 100, 20)), (40, (510, 170, 0))])
        model = refit(run.planner)
        fitted = model.nodes[2]
        assert fitted.idle_times is not None and 0.0 not in run.planner.fitters[2].batch_sizes()
        want = node.forward_time(0) + node.backward_time(0)
        assert fitted.forward_time(0) + fitted.backward_time(0) == pytest.approx(
            want, rel=0.1), seed
        errors += [model.step_time(list(split)) / cluster.step_time(list(split)) - 1
                   for split in (even_split(cluster, B).local_batches, (440, 160, 80))]
    print(f"held at 0 after 20: step time errors at the even split and at (440, 160, 80): "
          f"{[f'{e:+.1%}' for e in errors]}")
    assert float(np.median(np.abs(errors))) <= 0.1


def test_a_balanced_step_is_predicted_as_the_expected_slowest() -> None:
    # 4 equal workers: the mean step is the expected max of 4 noisy times; the max of the
    # means was 15% low here
    cluster = truth((1.0, 1.0, 1.0, 1.0))
    bias = []
    for seed in SEEDS[:3]:
        run = drive(seed, 300, cluster=cluster, total=128,
                    config=PlannerConfig(world_size=4, init_batch=128))
        pred, meas = np.array(run.predicted[40:]), np.array(run.measured[40:])
        bias.append(float(pred.mean() / meas.mean() - 1))
    print(f"balanced 4 workers, 25% noise: mean predicted / measured - 1 = "
          f"{[f'{b:+.1%}' for b in bias]}")
    assert max(abs(b) for b in bias) <= 0.04


def test_probes_cost_little() -> None:
    # a probe runs one re-plan interval off the optimum; they stop once the fits are known
    costs, probes = [], []
    for seed in SEEDS:
        run = drive(seed, 1000)
        costs.append(float(np.mean(run.quality[50:])))
        probes.append(sum(r.reason.startswith("probe") for r in run.planner.history))
    print(f"mean true step / optimum over steps 50-1000: {[round(c, 3) for c in costs]}; "
          f"probes {probes}")
    assert max(costs) <= 1.05 and max(probes) <= 8


def _probe_share(run: Run) -> float:
    """The probes' true extra time (each probe step's over the step before the probe) as
    a fraction of the run's."""
    history, quality = run.planner.history, run.quality
    extra = 0.0
    for i, record in enumerate(history):
        if record.reason.startswith("probe"):
            end = history[i + 1].step if i + 1 < len(history) else len(quality)
            extra += sum(quality[s] - quality[record.step - 1] for s in range(record.step, end))
    return extra / sum(quality)


def test_probes_keep_to_their_budget() -> None:
    """``probe_budget``: a probe waits until its predicted extra time is that share of the
    time since the one before. Measured against the truth, 0.19-0.59% of the run with a
    budget of 0.5% (the model's error makes up the rest), and 0.51-1.8% with none."""
    kept, free = [], []
    for seed in SEEDS:
        for cluster in (truth(), quota_truth()):
            for budget, shares in ((0.005, kept), (1.0, free)):
                run = drive(seed, 1000, cluster=cluster, config=PlannerConfig(
                    world_size=3, init_batch=B, probe_budget=budget))
                shares.append(_probe_share(run))
    print(f"probes' share of the run, budget 0.5%: {[f'{c:.2%}' for c in kept]}; none: "
          f"{[f'{c:.2%}' for c in free]}")
    assert max(kept) <= 1.5 * 0.005 and np.mean(kept) < 0.5 * np.mean(free)
    with pytest.raises(ValueError, match="probe_budget must be > 0, got 0"):
        PlannerConfig(world_size=3, init_batch=B, probe_budget=0)


def test_a_worker_at_0_that_became_faster_is_given_work_again() -> None:
    """``refresh_after``: a worker planned 0 samples is measured at work again, its even
    share for one probe, once its latest step at work is that old (and the probe within
    its budget). Here it is 4x slower than the others until step 100, then as fast, and
    its steps at 0 take the same time at either speed (no forward, no backward: a GPU's),
    so nothing else shows the change; no other probe or trial runs."""
    def idle_flat(cluster: ClusterModel) -> ClusterModel:
        return ClusterModel(nodes=[dataclasses.replace(nd, idle_times=(0.002, 0.002))
                                   for nd in cluster.nodes], comm=cluster.comm)

    slow, fast = idle_flat(truth((1.0, 1.0, 0.25))), idle_flat(truth((1.0, 1.0, 1.0)))
    assert zero_split(slow, B).local_batches[2] == 0 < even_split(fast, B).local_batches[2]
    refreshed, never = [], []
    for seed in SEEDS:
        for refresh, late in ((500, refreshed), (None, never)):
            run = drive(seed, 900, cluster=slow, later=(100, fast), config=PlannerConfig(
                world_size=3, init_batch=B, refresh_after=refresh, probe_error=None,
                trial_margin=0))
            history = run.planner.history
            assert all(r.local_batches[2] == 0 for r in history if 50 <= r.step < 100), seed
            probes = [r for r in history if r.reason.startswith("probe")]
            if refresh is not None:
                assert probes and probes[0].reason == "probe worker 2 at local batch 226", seed
                assert 500 <= probes[0].step < 600, (seed, probes[0].step)
                assert history[-1].local_batches[2] > 0.8 * B / 3, seed
            else:
                assert not probes and history[-1].local_batches[2] == 0, seed
            late.append(float(np.mean(run.quality[-300:])))
    print(f"mean true step / optimum over the last 300 steps: refreshed "
          f"{[f'{q:.3f}' for q in refreshed]}, never {[f'{q:.3f}' for q in never]}")
    assert max(refreshed) <= 1.05 and min(never) > 1.2
    with pytest.raises(ValueError, match="refresh_after must be None or >= 1, got 0"):
        PlannerConfig(world_size=3, init_batch=B, refresh_after=0)


def test_no_probes_when_disabled_and_the_same_plans_on_every_rank() -> None:
    off = drive(0, 600, config=PlannerConfig(world_size=3, init_batch=B, probe_error=None,
                                             refresh_after=None))
    assert not any(r.reason.startswith("probe") for r in off.planner.history)
    a, b = drive(1, 300), drive(1, 300)
    assert [r.local_batches for r in a.planner.history] == [
        r.local_batches for r in b.planner.history]


def test_a_worker_that_slows_the_step_even_at_zero_is_reported_once(
        caplog: pytest.LogCaptureFixture) -> None:
    # the slowest worker's fixed time (0.2 s) is above the others' whole step: it is
    # planned 0 samples and still sets the pace
    planner_run = drive(2, 200)
    record = planner_run.planner.current
    assert record.local_batches[2] == 0
    assert [w.rank for w in record.costly] == [2]
    worker = record.costly[0]
    assert worker.cost_s > 0 and worker.speedup > 1
    # the same what-if computed here from the plan's own models
    model = ClusterModel(nodes=list(record.nodes or ()), comm=record.comm or CommModel())
    n = model.size
    ring = ((n - 2) / (n - 1)) / ((n - 1) / n)
    rest = ClusterModel(nodes=model.nodes[:2], comm=CommModel(
        buckets=[(r, c * ring) for r, c in model.comm.buckets]))
    best = min(range(B + 1), key=lambda b: rest.step_time([b, B - b]))  # brute force
    alone = rest.expected_step_time([best, B - best])
    assert worker.without_step_time == pytest.approx(alone, rel=1e-9)
    assert worker.step_time == pytest.approx(
        model.expected_step_time(list(record.local_batches)), rel=1e-12)
    # logged once, however many re-plans confirm it
    planner = Planner(PlannerConfig(world_size=3, init_batch=B))
    with caplog.at_level(logging.WARNING, logger="cannikin.runtime.planner"):
        for step in range(3):
            planner.current = dataclasses.replace(record, step=step)
            planner._log(planner.current, model, changed=False)
    said = [r for r in caplog.records if "slows the step even with 0 samples" in r.message]
    assert len(said) == 1 and "worker 2" in said[0].message


def test_zeros_are_not_planned_when_disallowed() -> None:
    run = drive(2, 120, config=PlannerConfig(world_size=3, init_batch=B, allow_zero=False))
    assert all(min(r.local_batches) >= 1 for r in run.planner.history)
    assert run.planner.current.costly == ()
    assert not math.isnan(run.quality[-1])


# the slowest worker's fixed time is small enough that the model's optimum gives it ~20
# samples, and giving it none is predicted 6% slower
SATURATED = ClusterModel(nodes=[NodeModel(fwd=(0.005 / s, 0.0001 / s), bwd=(0.005 / s, 0.0002 / s))
                                for s in SPEEDS], comm=COMM)
SATURATED_B = 273


def _slowest_busy(split: Sequence[int]) -> float:
    """A busy slowest worker slows the all-reduce by 15 ms (on real quota workers its
    saturated CPU did): with it at 0 the step is 14% faster than the model's optimum."""
    return 0.015 if split[-1] > 0 else 0.0


def test_a_measured_trial_finds_a_worker_faster_at_zero() -> None:
    with_trials, without = [], []
    late: list[int] = []  # the slowest worker's batch in each plan after step 100
    for seed in range(10):
        run = drive(seed, 600, cluster=SATURATED, total=SATURATED_B, extra=_slowest_busy,
                    config=PlannerConfig(world_size=3, init_batch=SATURATED_B))
        history = run.planner.history
        assert any(r.reason == "try worker 2 at 0 samples" for r in history), seed
        late += [r.local_batches[2] for r in history if r.step >= 100]
        with_trials.append(float(np.mean(run.quality[100:])))
        off = drive(seed, 600, cluster=SATURATED, total=SATURATED_B, extra=_slowest_busy,
                    config=PlannerConfig(world_size=3, init_batch=SATURATED_B, trial_margin=0))
        without.append(float(np.mean(off.quality[100:])))
    print(f"mean step / optimum, hidden cost of a busy slowest worker: with trials "
          f"{[f'{c:.3f}' for c in with_trials]}, without {[f'{c:.3f}' for c in without]}")
    # over the seeds, not each: under 25% timing noise a trial's 10 steps show too little
    # gain to keep the worker at 0 in 13-14% of the trials (seeds 12-51), and it is tried
    # again only 200 steps later, at ~20 samples meanwhile (1.13-1.20 for such a seed).
    # The rest is the fits' error under that noise on a small, fast cluster.
    assert sum(b == 0 for b in late) >= 0.7 * len(late), late
    assert float(np.median(with_trials)) <= 1.11
    # the trials' gain, seed by seed (the same timing noise either way): 0.04-0.17
    gains = [off - on for on, off in zip(with_trials, without, strict=True)]
    assert min(gains) > 0 and float(np.median(gains)) >= 0.12


def test_the_all_reduce_with_a_worker_at_0_is_fitted_apart() -> None:
    """A CPU-only job's step with a worker at 0 reduces over the busy ones only, here 15 ms
    faster than one where the slowest worker is busy. Fitted apart (``idle_route``), the
    model itself prefers 0 for that worker once it has seen such a step, where one model of
    both all-reduces leaves it to the trials (each kept ``trial_every`` steps): after step
    100 the worker is at 0 in 85-90% of the plans (82-86% with one model; 62-89% before
    probes had a budget, whose steps moved it off 0), and the mean step is 1.093 of the
    optimum (1.096)."""
    share: dict[bool, list[float]] = {True: [], False: []}
    quality: dict[bool, list[float]] = {True: [], False: []}
    for route in (True, False):
        for seed in SEEDS:
            run = drive(seed, 600, cluster=SATURATED, total=SATURATED_B, extra=_slowest_busy,
                        config=PlannerConfig(world_size=3, init_batch=SATURATED_B,
                                             idle_route=route))
            late = [r.local_batches[2] for r in run.planner.history if r.step >= 100]
            share[route].append(sum(b == 0 for b in late) / len(late))
            quality[route].append(float(np.mean(run.quality[100:])))
    print(f"the slowest worker at 0 after step 100, its all-reduce fitted apart "
          f"{[f'{z:.2f}' for z in share[True]]}, not {[f'{z:.2f}' for z in share[False]]}; "
          f"mean step / optimum {np.mean(quality[True]):.3f} against "
          f"{np.mean(quality[False]):.3f}")
    assert min(share[True]) >= 0.8 and np.mean(share[True]) > np.mean(share[False])
    assert np.mean(quality[True]) < np.mean(quality[False])


def test_a_worker_the_model_gives_a_few_samples_gets_0_where_its_all_reduce_says_so() -> (
    None
):
    """The model's optimum gives the slowest worker ~20 samples, not its minimum, and a
    step with it at 0 reduces 15 ms faster. Once such steps are measured (pinned here,
    with no trials), the planner must compare the split at 0 with its own fitted idle
    all-reduce, not only where the optimum reaches the minimum: after the pin the worker
    is at 0 in every plan but a probe's, and the mean step is 1.11-1.15x the optimum.
    When only a worker at its minimum was considered for 0, the first probe (of another
    worker) moved it to 18-21 samples for good: 1.20-1.23x."""
    idle = split_without(SATURATED, SATURATED_B, {2}).local_batches
    for seed in SEEDS:
        run = drive(seed, 200, cluster=SATURATED, total=SATURATED_B, extra=_slowest_busy,
                    config=PlannerConfig(world_size=3, init_batch=SATURATED_B,
                                         idle_route=True, trial_margin=0),
                    pins=[(30, idle), (60, None)])
        late = [r.local_batches[2] for r in run.planner.history
                if r.step > 60 and not r.reason.startswith("probe")]
        assert late and all(b == 0 for b in late), (seed, late)
        assert float(np.mean(run.quality[100:])) <= 1.17, seed


# a smaller fixed time: the model's optimum gives the slowest worker ~31 samples, a third
# of its even share (above trial_share), where with it at 0 the step is 13% faster
LIGHT = ClusterModel(nodes=[NodeModel(fwd=(0.002 / s, 0.0001 / s), bwd=(0.002 / s, 0.0002 / s))
                            for s in SPEEDS], comm=COMM)


def test_a_step_with_an_idle_worker_is_tried_once_whatever_its_share() -> None:
    """With ``idle_route`` the model cannot know a step with an idle worker before one is
    measured: the least-loaded worker is tried at 0 whatever its share, and once measured
    faster, kept there by the trial and then by the model: after step 150 it is at 0 in
    94-100% of the plans, the mean step 1.12-1.15x the optimum. Tried only within its
    share, it was never tried in 2 seeds of 5, and stayed at ~30 samples: 1.28-1.31x."""
    assert optimal_split(LIGHT, SATURATED_B).local_batches[2] > 0.25 * SATURATED_B / 3
    for seed in SEEDS:
        run = drive(seed, 400, cluster=LIGHT, total=SATURATED_B, extra=_slowest_busy,
                    config=PlannerConfig(world_size=3, init_batch=SATURATED_B,
                                         idle_route=True))
        history = run.planner.history
        assert any(r.reason == "try worker 2 at 0 samples" for r in history), seed
        late = [r.local_batches[2] for r in history if r.step >= 150]
        assert sum(b == 0 for b in late) >= 0.8 * len(late), (seed, late)
        assert float(np.mean(run.quality[150:])) <= 1.2, seed


def test_a_trial_that_measures_slower_gives_the_worker_back_its_samples() -> None:
    # no hidden cost: 0 samples is 6% slower, and the trials (10 steps in 200) cost little
    with_trials, without = [], []
    for seed in SEEDS:
        config = PlannerConfig(world_size=3, init_batch=SATURATED_B)
        run = drive(seed, 1000, cluster=SATURATED, total=SATURATED_B, config=config)
        with_trials.append(float(np.mean(run.quality[100:])))
        off = drive(seed, 1000, cluster=SATURATED, total=SATURATED_B,
                    config=dataclasses.replace(config, trial_margin=0))
        without.append(float(np.mean(off.quality[100:])))
    print(f"mean step / optimum, no hidden cost: with trials {[f'{c:.3f}' for c in with_trials]}"
          f", without {[f'{c:.3f}' for c in without]}")
    assert float(np.mean(with_trials)) <= float(np.mean(without)) + 0.02


def quota_truth() -> ClusterModel:
    """truth() on CPU quotas: each worker's step is at least its CPU over its share, and its
    CPU per step is its compute at full speed plus 20 ms of its own (the optimizer, its part
    of the all-reduce, the runtime), as on real quota workers: the quarter-core worker's
    floor is 17% above its compute at the even split, and 0.28 s at 0 samples."""
    return ClusterModel(nodes=[dataclasses.replace(nd, cpu_floor=(
        nd.fwd[0] + nd.bwd[0] + 0.02 / s, nd.fwd[1] + nd.bwd[1]))
        for nd, s in zip(truth().nodes, CORES, strict=True)], comm=COMM)


def test_a_worker_whose_cpu_makes_no_floor_is_probed_once() -> None:
    """quota_truth(): the half-core worker's busy sizes, its plan's 145-191 samples and the
    warm-up's 227, are too close for a CPU floor, and with every fit taken as known well
    enough (``probe_error`` 10) no other probe moves it: without the floor's probe it had
    none in 4 seeds of 5. It is probed once, at about twice its batch, and every worker
    then has a floor; the probe costs under 1% of the run."""
    for seed in SEEDS:
        run = drive(seed, 400, cluster=quota_truth(), config=PlannerConfig(
            world_size=3, init_batch=B, probe_error=10.0, refresh_after=None))
        probes = [r.reason for r in run.planner.history if r.reason.startswith("probe")]
        assert len(probes) == 1 and probes[0].startswith("probe worker 1 at"), (seed, probes)
        assert all(cpu.floor_line() is not None for cpu in run.planner.cpu_fitters), seed
        assert float(np.mean(run.quality[100:])) <= 1.01, seed


def test_a_worker_at_0_samples_is_modelled_at_its_own_cpu() -> None:
    """The quarter-core worker's CPU per step at 0 samples falls below where the line
    through its busy sizes starts (no forward, no backward): 0.21 s against 0.28. The
    fitted model holds it apart (:attr:`NodeModel.cpu_idle`) and predicts that worker's
    time at 0 samples, where the line alone was 33% high."""
    quota = quota_truth()
    idle = 0.21
    cluster = ClusterModel(nodes=[dataclasses.replace(nd, cpu_idle=idle if i == 2 else None)
                                  for i, nd in enumerate(quota.nodes)], comm=quota.comm)
    line_c0 = quota.nodes[2].cpu_floor[0] if quota.nodes[2].cpu_floor else math.nan
    assert line_c0 > 1.3 * idle
    for seed in range(2):
        run = drive(seed, 300, cluster=cluster)
        model = run.planner.cluster_model
        assert model is not None and model.nodes[2].cpu_idle == pytest.approx(idle, rel=0.05)
        # each floor's noise is the one the simulated steps' CPU is drawn with
        assert [nd.cpu_noise for nd in model.nodes] == pytest.approx([0.05] * 3, rel=0.3)
        split = zero_split(cluster, B).local_batches
        assert split[2] == 0
        assert model.node_times(list(split))[2] == pytest.approx(idle, rel=0.05)
        assert float(np.mean(run.quality[150:])) <= 1.1, seed


def test_cpu_floors_predict_the_even_split_and_one_2x_away_on_quota_workers() -> None:
    """The fit of each worker's CPU per step (its warm-up batch remembered, the plan's 0
    samples in the window) predicts splits away from the one in use within 10% (issue 13);
    without it, the compute model alone misses the even split by more."""
    cluster = quota_truth()
    errors: dict[bool, list[float]] = {True: [], False: []}
    for seed in SEEDS:
        for floor in (True, False):
            run = drive(seed, 400, cluster=cluster,
                        config=PlannerConfig(world_size=3, init_batch=B, cpu_floor=floor))
            model = run.planner.cluster_model
            assert model is not None
            held = run.planner.local_batches
            away = (held[0] // 2, held[1] + held[0] - held[0] // 2, held[2])
            for split in (even_split(cluster, B).local_batches, away):
                rng = np.random.default_rng(seed)  # the true mean step, as the steps ran
                mean = float(np.mean([simulate_step(cluster, split, rng)[3]
                                      for _ in range(2000)]))
                errors[floor].append(model.expected_step_time(list(split)) / mean - 1)
            if floor:
                assert float(np.mean(run.quality[200:])) <= 1.1, seed
    print(f"quota workers, predicted / true - 1 at the even split and 2x away: with CPU floors "
          f"{[f'{e:+.1%}' for e in errors[True]]}, without {[f'{e:+.1%}' for e in errors[False]]}")
    assert max(abs(e) for e in errors[True]) <= 0.10
    assert max(abs(e) for e in errors[False][::2]) > 0.10  # the even splits


def _sent_as_a_vector(decide: Callable[[], Decision]) -> Decision:
    """What a rank that does not decide gets: the decider's choice, through its vector."""
    return Decision.from_vector(decide().to_vector())


_DECISION_STATE = ("_interval", "_next_replan", "_earliest_replan", "_idle_until",
                   "_last_trial", "_trial", "_last_probe", "_before_probe", "_chosen_noise",
                   "_held_since")


@pytest.mark.parametrize("case", ["probes and zeros", "trials"])
def test_a_decision_sent_as_a_vector_plans_as_deciding_alone(case: str) -> None:
    # one rank decides and the others adopt its vector: step by step the same plans, and
    # the same state behind them, as a planner that decides for itself
    kwargs: dict[str, object] = ({} if case == "probes and zeros" else dict(
        cluster=SATURATED, total=SATURATED_B, extra=_slowest_busy,
        config=PlannerConfig(world_size=3, init_batch=SATURATED_B)))
    for seed in range(2):
        alone = drive(seed, 400, **kwargs).planner  # type: ignore[arg-type]
        shared = drive(seed, 400, share=_sent_as_a_vector, **kwargs).planner  # type: ignore[arg-type]
        assert shared.history == alone.history
        assert all(getattr(shared, key) == getattr(alone, key) for key in _DECISION_STATE)
    reasons = {r.reason.split()[0] for r in alone.history}
    assert ("probe" if case == "probes and zeros" else "try") in reasons, reasons
    if case == "probes and zeros":
        assert any(r.costly for r in alone.history)


def test_a_rank_that_does_not_decide_adopts_what_it_is_sent() -> None:
    planner = drive(0, 40).planner  # past the warm-up, with a model
    decided: list[int] = []

    def sent(decide: Callable[[], Decision]) -> Decision:
        decided.append(1)
        return Decision(local_batches=(300, 300, 80), predicted_s=0.5, kind="probe", rank=2,
                        target=80, idle_until={1: 90})

    record = planner.replan(40, share=sent)
    assert decided == [1]  # asked once, and it never ran the decision itself
    assert (record.local_batches, record.reason, record.predicted_step_s) == (
        (300, 300, 80), "probe worker 2 at local batch 80", 0.5)
    assert planner._last_probe == 40 and planner._idle_until == {1: 90}
    assert planner._before_probe is not None
    with pytest.raises(RuntimeError, match=r"step 41: the re-plan failed on rank 0"):
        planner.replan(41, share=lambda decide: Decision.failed(3))
