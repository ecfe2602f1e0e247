"""The performance model (DESIGN.md §1) and its online fitters."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest

from cannikin import rowfit
from cannikin.optperf import without_worker
from cannikin.perf import (
    ClusterModel,
    CommFitter,
    CommModel,
    CpuFitter,
    FitConfig,
    NodeFitter,
    NodeModel,
    PredictionTracker,
    expected_max,
    fit_nodes,
)
from references import change_point_of, robust_line_of


def timeline_step_time(cluster: ClusterModel, local_batches: list[int]) -> float:
    """Reference: replay the step as events (bucket ready times, one all-reduce at a time)."""
    ready_done = 0.0
    for rho, cost in cluster.comm.buckets:
        ready = max(n.forward_time(b) + rho * n.backward_time(b)
                    for n, b in zip(cluster.nodes, local_batches, strict=True))
        ready_done = max(ready, ready_done) + cost
    return ready_done


def test_node_model_times() -> None:
    node = NodeModel(fwd=(0.5, 0.25), bwd=(1.0, 0.5))
    assert node.forward_time(4) == pytest.approx(1.5)
    assert node.backward_time(4) == pytest.approx(3.0)
    assert node.min_batch == 1 and node.max_batch is None


@pytest.mark.parametrize("kwargs, match", [
    ({"fwd": (math.nan, 1.0), "bwd": (0.0, 1.0)}, "finite"),
    ({"fwd": (0.0, math.inf), "bwd": (0.0, 1.0)}, "finite"),
    ({"fwd": (0.0, -1.0), "bwd": (0.0, 1.0)}, "slope >= 0"),
    ({"fwd": (-0.1, 1.0), "bwd": (0.0, 1.0)}, "intercept >= 0"),
    ({"fwd": (0.0, 1.0, 2.0), "bwd": (0.0, 1.0)}, "intercept, slope"),
    ({"fwd": (0.0, 1.0), "bwd": (0.0, 1.0), "min_batch": -1}, "min_batch"),
    ({"fwd": (0.0, 1.0), "bwd": (0.0, 1.0), "min_batch": 4, "max_batch": 3}, "max_batch"),
    ({"fwd": (0.0, 1.0), "bwd": (0.0, 1.0), "max_batch": 2.5}, "max_batch"),
])
def test_node_model_rejects_bad_parameters(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        NodeModel(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("buckets, match", [
    ([], "at least one bucket"),
    ([(0.5, 1.0)], "rho_m must be 1.0"),
    ([(0.7, 1.0), (0.5, 1.0), (1.0, 1.0)], "non-decreasing"),
    ([(1.0, -1.0)], ">= 0"),
    ([(1.0, math.nan)], "finite"),
])
def test_comm_model_rejects_bad_buckets(buckets: list[tuple[float, float]], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CommModel(buckets=buckets)


def test_comm_model_remaining() -> None:
    comm = CommModel(buckets=[(0.2, 1.0), (0.6, 2.0), (1.0, 4.0)])
    assert comm.remaining.tolist() == [7.0, 6.0, 4.0]
    assert comm.total == 7.0


def test_binding_buckets_give_the_same_envelope() -> None:
    rng = np.random.default_rng(5)
    ks = np.concatenate([[0.0], np.geomspace(1e-4, 1e4, 400)])
    for _ in range(200):
        m = int(rng.integers(1, 40))
        rho = [*np.sort(rng.uniform(0, 1, m - 1)).round(int(rng.integers(1, 4))).tolist(), 1.0]
        comm = CommModel(buckets=[(r, float(rng.exponential(1.0))) for r in rho])
        keep = comm.binding()
        assert np.all(np.diff(keep) > 0) and comm.ready_fractions[keep[-1]] == 1.0
        lines = comm.remaining[:, None] + comm.ready_fractions[:, None] * ks[None, :]
        assert np.allclose(lines.max(axis=0), lines[keep].max(axis=0), rtol=1e-12, atol=0)


def test_cluster_rejects_empty_and_bad_splits() -> None:
    with pytest.raises(ValueError, match="at least one node"):
        ClusterModel(nodes=[])
    with pytest.raises(ValueError, match="node 1 must be a NodeModel, got NoneType"):
        ClusterModel(nodes=[NodeModel(fwd=(0, 1), bwd=(0, 1)), None])  # type: ignore[list-item]
    cluster = ClusterModel(nodes=[NodeModel(fwd=(0, 1), bwd=(0, 1))] * 2)
    with pytest.raises(ValueError, match="expected \\(2,\\)"):
        cluster.step_time([1, 2, 3])
    with pytest.raises(ValueError, match=">= 0"):
        cluster.step_time([1, -2])


def test_a_split_with_an_idle_worker_takes_the_idle_all_reduce() -> None:
    nodes = [NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), cpu_floor=(0.01, 0.004),
                       noise=0.2, cpu_noise=0.1),
             NodeModel(fwd=(0.03, 0.002), bwd=(0.04, 0.004), noise=0.1)]
    busy, idle = CommModel(buckets=[(0.5, 0.01), (1.0, 0.05)]), CommModel(buckets=[(1.0, 0.002)])
    cluster = ClusterModel(nodes=nodes, comm=busy, idle_comm=idle)
    plain, routed = ClusterModel(nodes=nodes, comm=busy), ClusterModel(nodes=nodes, comm=idle)
    for split in ([5, 3], [0, 8], [8, 0], [0, 0]):
        kind = routed if 0 in split else plain
        assert cluster.step_time(split) == kind.step_time(split)
        assert cluster.expected_step_time(split) == kind.expected_step_time(split)
    columns = np.array([[5, 0, 8], [3, 8, 0]])
    expected = np.stack([(routed if 0 in col else plain).node_times(col)
                         for col in columns.T], axis=1)
    np.testing.assert_array_equal(cluster.node_times(columns), expected)
    assert ClusterModel(nodes=nodes, comm=busy).with_idle.comm == busy
    assert without_worker(cluster, 1).comm == idle  # the others already reduce alone


def test_step_time_matches_event_timeline() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, m = int(rng.integers(1, 6)), int(rng.integers(1, 5))
        nodes = [NodeModel(fwd=tuple(rng.uniform(0, 1, 2)), bwd=tuple(rng.uniform(0, 2, 2)))
                 for _ in range(n)]
        rho = [*np.sort(rng.uniform(0, 1, m - 1)).tolist(), 1.0]
        comm = CommModel(buckets=[(r, float(rng.uniform(0, 3))) for r in rho])
        cluster = ClusterModel(nodes=nodes, comm=comm)
        batches = rng.integers(0, 20, n).tolist()
        assert cluster.step_time(batches) == pytest.approx(timeline_step_time(cluster, batches))


def test_two_regimes_of_section_1() -> None:
    """Compute-bound: max(F+K) + c_m. Communication-bound: max(F + rho_1 K) + C."""
    nodes = [NodeModel(fwd=(0.0, 1.0), bwd=(0.0, 2.0)), NodeModel(fwd=(0.0, 2.0), bwd=(0.0, 4.0))]
    compute = ClusterModel(nodes=nodes, comm=CommModel(buckets=[(0.5, 0.1), (1.0, 0.1)]))
    assert compute.step_time([2, 1]) == pytest.approx(6.0 + 0.1)
    comm = ClusterModel(nodes=nodes, comm=CommModel(buckets=[(0.5, 10.0), (1.0, 0.1)]))
    assert comm.step_time([2, 1]) == pytest.approx(4.0 + 10.1)


def samples(rng: np.random.Generator, count: int, noise: float = 0.05,
            speed: float = 1.0) -> list[tuple[int, float, float]]:
    out = []
    for _ in range(count):
        b = int(rng.choice([8, 16, 24, 32, 48]))
        jitter = 1 + noise * rng.standard_normal()
        out.append((b, speed * (0.01 + 0.001 * b) * jitter, speed * (0.02 + 0.002 * b) * jitter))
    return out


def test_fitter_recovers_exact_lines() -> None:
    fitter = NodeFitter()
    for b in (4, 8, 12, 4, 8):
        fitter.add(b, 0.5 + 0.1 * b, 1.0 + 0.3 * b)
    model = fitter.fit(name="w0", min_batch=2, max_batch=40)
    assert model is not None
    assert model.fwd == pytest.approx((0.5, 0.1)) and model.bwd == pytest.approx((1.0, 0.3))
    assert (model.name, model.min_batch, model.max_batch) == ("w0", 2, 40)


def test_fitter_empty_then_proportional_then_linear() -> None:
    fitter = NodeFitter()
    assert fitter.fit() is None
    fitter.add(10, 0.3, 0.6)
    fitter.add(10, 0.5, 0.6)
    model = fitter.fit()
    assert model is not None  # proportional to the median measurement at b=10
    assert model.fwd == pytest.approx((0.0, 0.04)) and model.bwd == pytest.approx((0.0, 0.06))
    fitter.add(20, 0.7, 1.1)
    model = fitter.fit()
    assert model is not None and model.fwd[0] > 0 and model.bwd[0] > 0


def test_fitter_single_size_after_a_fit_keeps_the_shape() -> None:
    """A stable plan fills the window with one batch size: rescale the last fit's shape."""
    fitter = NodeFitter(window=8)
    for b in (4, 8, 4, 8):
        fitter.add(b, 1.0 + 0.25 * b, 2.0 + 0.5 * b)
    fitter.fit()
    for _ in range(8):  # same worker, now 1.5x slower, always at b=8
        fitter.add(8, 1.5 * 3.0, 1.5 * 6.0)
    model = fitter.fit()
    assert model is not None
    assert model.fwd == pytest.approx((1.5, 0.375)) and model.bwd == pytest.approx((3.0, 0.75))


def test_fitter_rejects_bad_samples_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    fitter = NodeFitter()
    with caplog.at_level(logging.WARNING, logger="cannikin.perf"):
        for bad in [(math.nan, 1.0, 1.0), (4, math.inf, 1.0), (4, 1.0, -0.5), (-1, 1.0, 1.0)]:
            assert fitter.add(*bad) is False
    assert fitter.num_samples == 0
    assert len([r for r in caplog.records if "rejected timing sample" in r.message]) == 4
    assert fitter.add(4, 1.0, 1.0) is True and fitter.num_samples == 1


def test_fitter_window_is_bounded() -> None:
    fitter = NodeFitter(window=16)
    for b, f, k in samples(np.random.default_rng(0), 100):
        fitter.add(b, f, k)
    assert fitter.num_samples <= 16
    with pytest.raises(ValueError, match="window"):
        NodeFitter(window=1)


def test_a_narrow_batch_range_under_heavy_noise_keeps_a_real_slope() -> None:
    """A held plan gives a worker a few neighbouring batch sizes; with 25% timing noise the
    least-squares slope of 37..39 was below a quarter of the truth in 31 of 100 seeds (the
    worker then looks free for extra samples). The prior toward the proportional slope
    (here 1.2x the truth) keeps every fit between half and 1.5x the truth."""
    slopes = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        fitter = NodeFitter()
        for _ in range(64):
            b = int(rng.choice([37, 38, 39]))
            noise = np.exp(0.25 * rng.standard_normal(2))
            fitter.add(b, (0.003 + 0.0004 * b) * noise[0], (0.006 + 0.0008 * b) * noise[1])
        model = fitter.fit()
        assert model is not None
        slopes += [model.fwd[1] / 0.0004, model.bwd[1] / 0.0008]
    print(f"fitted / true slope over 37..39 at 25% noise: min {min(slopes):.2f}, "
          f"max {max(slopes):.2f}")
    assert min(slopes) >= 0.5 and max(slopes) <= 1.5, slopes


@pytest.mark.parametrize("seed", range(5))
def test_stragglers_do_not_wreck_the_fit(seed: int) -> None:
    """15% of steps straggle 10x; a least-squares fit is ruined, the robust one is not."""
    rng = np.random.default_rng(seed)
    fitter = NodeFitter(window=64)
    data = samples(rng, 64, noise=0.03)
    for k, (b, f, bw) in enumerate(data):
        slow = 10.0 if k % 7 == 3 else 1.0
        fitter.add(b, f * slow, bw * slow)
    model = fitter.fit()
    assert model is not None
    for b in (8, 32, 48):
        assert model.forward_time(b) == pytest.approx(0.01 + 0.001 * b, rel=0.05)
        assert model.backward_time(b) == pytest.approx(0.02 + 0.002 * b, rel=0.05)
    arr = fitter.samples()
    ols = np.polyfit(arr[:, 0], arr[:, 2], 1)
    assert abs(np.polyval(ols, 32) / (0.02 + 0.002 * 32) - 1) > 0.5  # the test has teeth


def test_a_probe_among_idle_steps_carries_the_slope() -> None:
    """A worker idle at 0 samples (~1 ms phases, 40% of them throttled by up to 7.5 ms, as a
    quarter-core quota worker's are), probed at 160 for 5 steps (~9 and ~17 ms): a window of
    59 short steps and 5 long ones, a trial at 14 and the warm-up at 160 remembered. With
    an absolute outlier scale the short steps' spread made every probe step an outlier in
    one seed of these 40, and the slope through 0 and 14 alone put the backward at 160 at
    3.5x the truth (on real quota workers one such fit put it at 72 ms against 19-29
    measured, and the even split at 2.07x its measured step). The probe's noise is
    relative to its time, as the short steps' is to theirs."""
    def timed(rng: np.random.Generator, b: int) -> tuple[float, float]:
        fwd, bwd = (0.001 + 0.00005 * b, 0.0008 + 0.0001 * b) * np.exp(
            0.1 * rng.standard_normal(2))
        if rng.random() < 0.4:  # the quota's period ran out in one of the phases
            wait = rng.uniform(0, 0.0075)
            fwd, bwd = (fwd + wait, bwd) if rng.random() < 0.5 else (fwd, bwd + wait)
        return float(fwd), float(bwd)

    ratios = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        fitter = NodeFitter()
        for b, count in ((160, 3), (14, 5)):
            for _ in range(count):
                fitter.add(b, *timed(rng, b), remember=True)
        for b, count in ((0, 40), (160, 5), (0, 19)):
            for _ in range(count):
                fitter.add(b, *timed(rng, b), remember=b > 0)
        model = fitter.fit()
        assert model is not None
        ratios += [model.forward_time(160) / 0.009, model.backward_time(160) / 0.0168]
    print(f"fitted / true time at 160: {min(ratios):.2f}-{max(ratios):.2f}")
    assert min(ratios) >= 0.85 and max(ratios) <= 1.5, ratios


def test_drift_is_followed_within_bounded_samples() -> None:
    """A 2x slowdown mid-run: count new samples until the fit is within 10% everywhere,
    first and for good (every later fit within 10% too).

    Measured over these 20 seeds (10% noise, window 64): first 3-34 samples, median 6; for
    good 3-47, median 11. Without the change detection the rolling window alone needs 46-63
    for either (median 53). Both counts are fragile: a fit hovering at 10% error crosses it
    on a 2% change (seed 6 took 6 samples before the slope prior, 34 with it; seed 1 is
    within 10% from sample 8 on but for one fit at 10.1%, at 46). Over 100 seeds, outliers
    told by relative deviation (now) against absolute: for good median 12 against 13, 90th
    percentile 30 against 34, worst 65 against 60.
    """
    first, settled = [], []
    for seed in range(20):
        rng = np.random.default_rng(seed)
        fitter = NodeFitter(window=64)
        for b, f, k in samples(rng, 64, noise=0.1):
            fitter.add(b, f, k)
        fitter.fit()
        within = []
        for b, f, k in samples(rng, 64, noise=0.1, speed=2.0):
            fitter.add(b, f, k)
            model = fitter.fit()
            assert model is not None
            within.append(all(abs(model.forward_time(x) / (2 * (0.01 + 0.001 * x)) - 1) < 0.1
                              and abs(model.backward_time(x) / (2 * (0.02 + 0.002 * x)) - 1) < 0.1
                              for x in (8, 32, 48)))
        first.append(within.index(True) + 1 if any(within) else 10**6)
        settled.append(len(within) - within[::-1].index(False) + 1 if not all(within) else 1)
    print(f"2x drift followed after {first} samples, for good after {settled}")
    assert np.median(first) <= 8 and np.median(settled) <= 13, (first, settled)
    assert sum(count > 36 for count in settled) <= 1, settled


def test_fitting_many_at_once_is_fitting_each() -> None:
    # fit_nodes stacks the windows of every worker; each row must come out as its own fit
    # (different sample counts, anchors, a worker at one batch size, one with a speed change)
    rng = np.random.default_rng(7)
    together, alone = [NodeFitter() for _ in range(6)], [NodeFitter() for _ in range(6)]
    for i, (a, b) in enumerate(zip(together, alone, strict=True)):
        for step, (x, f, k) in enumerate(samples(rng, 10 + 15 * i, noise=0.1)):
            size = 16 if i == 3 else x  # worker 3: one batch size
            slow = 2.0 if i == 5 and step > 40 else 1.0
            for fitter in (a, b):
                fitter.add(size, slow * f, slow * k, remember=step < 4)
    names = [f"w{i}" for i in range(6)]
    models = fit_nodes(together, names, [1] * 6, [None] * 6)
    for i, (model, fitter) in enumerate(zip(models, alone, strict=True)):
        single = fitter.fit(name=names[i])
        assert model is not None and single is not None
        assert model.fwd == pytest.approx(single.fwd, rel=1e-12, abs=1e-15), i
        assert model.bwd == pytest.approx(single.bwd, rel=1e-12, abs=1e-15), i
        assert model.noise == pytest.approx(single.noise, rel=1e-12, abs=1e-15), i
        assert together[i].num_samples == fitter.num_samples, i
    assert together[5].num_samples < 64  # worker 5's speed change was found


def test_no_false_drift_on_noisy_stationary_timings() -> None:
    rng = np.random.default_rng(3)
    fitter = NodeFitter(window=64)
    drops = 0
    for step in range(1500):
        b = int(rng.choice([16, 24, 32, 48]))
        jitter = math.exp(0.5 * rng.standard_normal()) * (10.0 if rng.random() < 0.05 else 1.0)
        fitter.add(b, (0.01 + 0.001 * b) * jitter, (0.02 + 0.002 * b) * jitter)
        if step % 8 == 0 and step >= 64:
            before = fitter.num_samples
            fitter.fit()
            drops += fitter.num_samples < before
    assert drops <= 2


def test_fitted_slopes_stay_positive() -> None:
    fitter = NodeFitter()
    for b in (8, 16, 8, 16):
        fitter.add(b, 0.05, 0.1 - 0.001 * b)  # constant forward, slightly falling backward
    model = fitter.fit()
    assert model is not None and model.fwd[1] > 0 and model.bwd[1] > 0


def test_comm_fitter_medians_and_layout_change(caplog: pytest.LogCaptureFixture) -> None:
    fitter = CommFitter()
    assert fitter.fit() is None
    fitter.add([0.5, 1.0], [0.1, 0.2])  # first step: DDP's initial buckets
    for rho, c1 in [(0.3, 0.01), (0.4, 0.02), (0.35, 5.0), (0.38, 0.03)]:
        fitter.add([rho, 0.7, 0.97], [c1, 0.02, 0.04])
    model = fitter.fit()
    assert model is not None and fitter.num_samples == 4
    assert np.allclose(model.buckets, [(0.365, 0.025), (0.7, 0.02), (1.0, 0.04)])
    with caplog.at_level(logging.WARNING, logger="cannikin.perf"):
        assert fitter.add([0.5], [0.1, 0.2]) is False
        assert fitter.add([1.5], [0.1]) is False
        assert fitter.add([1.0], [math.nan]) is False
    assert fitter.num_samples == 4


def test_comm_fitter_keeps_ready_order_monotone() -> None:
    fitter = CommFitter()
    fitter.add([0.6, 0.5, 1.0], [0.1, 0.1, 0.1])
    model = fitter.fit()
    assert model is not None
    assert [r for r, _ in model.buckets] == [0.6, 0.6, 1.0]


def test_prediction_tracker() -> None:
    tracker = PredictionTracker()
    assert math.isnan(tracker.median_step_error()) and math.isnan(tracker.median_window_error())
    for pred, meas in [(1.0, 2.0), (3.0, 2.0)]:
        tracker.record(pred, meas)
    tracker.end_window()
    tracker.end_window()  # empty window: ignored
    tracker.record(1.0, 1.25)
    assert tracker.record(1.0, 0.0) is False and tracker.record(math.nan, 1.0) is False
    tracker.end_window()
    assert tracker.step_errors() == pytest.approx([0.5, 0.5, 0.2])
    assert tracker.window_errors() == pytest.approx([0.0, 0.2])
    assert tracker.signed_window_errors() == pytest.approx([0.0, -0.2])
    assert tracker.median_step_error() == pytest.approx(0.5)
    assert tracker.median_window_error() == pytest.approx(0.1)


def test_fit_predicts_later_steps() -> None:
    """End to end: fit on noisy samples, predict the next window's steps, track the error."""
    rng = np.random.default_rng(1)
    fitters = [NodeFitter(), NodeFitter()]
    speeds = [1.0, 2.5]
    comm = CommModel(buckets=[(0.4, 0.01), (1.0, 0.02)])
    tracker = PredictionTracker()
    for window in range(5):
        models = [f.fit(name=str(i)) for i, f in enumerate(fitters)]
        for _ in range(16):
            batches = [int(v) for v in rng.integers(8, 48, 2)]
            truth = ClusterModel(nodes=[
                NodeModel(fwd=(0.01 * s, 0.001 * s), bwd=(0.02 * s, 0.002 * s)) for s in speeds
            ], comm=comm)
            measured = truth.step_time(batches) * (1 + 0.05 * rng.standard_normal())
            if all(m is not None for m in models):
                cluster = ClusterModel(nodes=[m for m in models if m is not None], comm=comm)
                tracker.record(cluster.step_time(batches), measured)
            for f, s, b in zip(fitters, speeds, batches, strict=True):
                f.add(b, s * (0.01 + 0.001 * b), s * (0.02 + 0.002 * b))
        tracker.end_window()
        assert window == 0 or len(tracker.window_errors()) == window
    assert tracker.median_window_error() < 0.03
    assert tracker.median_step_error() < 0.08


@pytest.mark.parametrize(("medians", "scales", "sigmas"), [
    ([0.1, 0.1, 0.1], [0.1, 0.1, 0.1], [0.25, 0.25, 0.25]),  # balanced, 25% noise
    ([0.10, 0.09, 0.12, 0.05], [0.1, 0.09, 0.1, 0.05], [0.3, 0.01, 0.02, 0.4]),  # mixed
    ([0.2, 0.1], [0.0, 0.1], [0.0, 0.5]),  # a deterministic worker as the floor
    ([1.0, 1.0], [1.0, 1.0], [1e-3, 1.0]),  # sigmas 1000x apart
    ([0.04, 0.036], [0.01, 0.03], [0.85, 0.15]),  # a small part with a long tail
    (np.linspace(0.09, 0.1, 64).tolist(), [0.1] * 64, [0.2] * 64),  # many contenders
    (np.linspace(0.09, 0.1, 1024).tolist(), [0.1] * 1024, [0.2] * 1024),  # thinned grid
])
def test_expected_max_matches_a_monte_carlo(medians: list[float], scales: list[float],
                                            sigmas: list[float]) -> None:
    rng = np.random.default_rng(0)
    draws = rng.standard_normal((400_000 if len(medians) < 100 else 20_000, len(medians)))
    draws = (np.array(medians) + np.array(scales) * np.expm1(np.array(sigmas) * draws)).max(axis=1)
    se = float(draws.std()) / math.sqrt(draws.size)
    got = expected_max(medians, scales, sigmas)
    assert abs(got - float(draws.mean())) < 4 * se + 1e-12, (got, float(draws.mean()), se)


def test_expected_max_of_noise_free_workers_is_the_max() -> None:
    assert expected_max([0.1, 0.3, 0.2], [0.1, 0.3, 0.2], [0.0, 0.0, 0.0]) == 0.3
    assert expected_max([0.1, 0.3], [0.0, 0.0], [0.5, 0.5]) == 0.3  # no noisy part
    # a noisy worker far below a deterministic one cannot be the max
    assert expected_max([0.3, 0.1], [0.3, 0.1], [0.0, 0.01]) == pytest.approx(0.3, rel=1e-12)


def test_a_log_normal_time_s_mean_is_above_its_median() -> None:
    """One noisy time: its mean, ``median + scale (exp(sigma^2 / 2) - 1)``, in closed form."""
    for sigma in (0.05, 0.3, 0.85):
        assert expected_max([0.05], [0.04], [sigma]) == pytest.approx(
            0.05 + 0.04 * math.expm1(sigma**2 / 2), rel=1e-4)


def test_expected_step_time_matches_a_monte_carlo_of_noisy_compute() -> None:
    # each worker's compute (forward + its binding share of the backward) is noisy; the
    # communication left after its binding bucket is not. Two regimes: compute-bound and
    # communication-bound (the first bucket binds for the fast worker).
    rng = np.random.default_rng(1)
    comm = CommModel(buckets=[(0.3, 0.05), (1.0, 0.01)])
    nodes = [NodeModel(fwd=(0.01 * k, 0.001 * k), bwd=(0.02 * k, 0.002 * k), noise=noise)
             for k, noise in ((1.0, 0.25), (2.0, 0.1), (3.0, 0.3))]
    cluster = ClusterModel(nodes=nodes, comm=comm)
    for split in ([30, 12, 6], [10, 10, 10], [40, 4, 1]):
        arr = cluster.arrays
        lines = arr.offsets + arr.slopes * np.array(split, dtype=float)[:, None]
        j = np.argmax(lines, axis=1)
        left = arr.comm_left[j]
        compute = lines[np.arange(3), j] - left
        noise = np.array([n.noise for n in nodes])
        draws = (left + compute * np.exp(noise * rng.standard_normal((400_000, 3)))).max(axis=1)
        se = float(draws.std()) / math.sqrt(draws.size)
        got = cluster.expected_step_time(split)
        assert abs(got - float(draws.mean())) < 4 * se, (split, got, float(draws.mean()))
        assert got >= cluster.step_time(split)
    quiet = ClusterModel(nodes=[NodeModel(fwd=n.fwd, bwd=n.bwd) for n in nodes], comm=comm)
    assert quiet.expected_step_time([30, 12, 6]) == quiet.step_time([30, 12, 6])


def test_a_spread_measured_at_one_batch_holds_at_every_batch() -> None:
    """``noise_batch``: the worker's disturbances are log-normal of ``noise`` on its
    compute at that batch, wherever it runs (the worker at 0 samples measured 60% of a
    small time is not 60% noisy at 40). Reference: a Monte Carlo of those disturbances,
    the compute at each batch from the lines directly."""
    rng = np.random.default_rng(4)
    comm = CommModel(buckets=[(0.3, 0.05), (1.0, 0.01)])
    spec = ((1.0, 0.25, None), (2.0, 0.1, 12.0), (3.0, 0.6, 0.0))
    nodes = [NodeModel(fwd=(0.01 * k, 0.001 * k), bwd=(0.02 * k, 0.002 * k), noise=noise,
                       noise_batch=at) for k, noise, at in spec]
    cluster = ClusterModel(nodes=nodes, comm=comm)
    arr = cluster.arrays

    def compute(batches: list[float]) -> tuple[np.ndarray, np.ndarray]:
        lines = arr.offsets + arr.slopes * np.array(batches)[:, None]
        j = np.argmax(lines, axis=1)
        return lines[np.arange(3), j], lines[np.arange(3), j] - arr.comm_left[j]

    split = [30, 12, 40]
    path, _ = compute([float(b) for b in split])
    _, at = compute([float(b) if a is None else a for b, (_, _, a) in zip(split, spec,
                                                                          strict=True)])
    noise_of = np.array([noise for _, noise, _ in spec])
    draws = (path + at * np.expm1(noise_of * rng.standard_normal((400_000, 3)))).max(axis=1)
    se = float(draws.std()) / math.sqrt(draws.size)
    got = cluster.expected_step_time(split)
    assert abs(got - float(draws.mean())) < 4 * se, (got, float(draws.mean()))
    relative = ClusterModel(nodes=[dataclasses.replace(nd, noise_batch=None) for nd in nodes],
                            comm=comm)
    assert relative.expected_step_time(split) > got + 0.01  # 60% of its time at 40: more
    with pytest.raises(ValueError, match="noise_batch=-1.0 must be None or finite and >= 0"):
        NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), noise=0.1, noise_batch=-1.0)


def test_expected_step_time_with_cpu_floors_matches_a_monte_carlo() -> None:
    """Reference: a Monte Carlo of each worker's time as the larger of its compute path
    (its compute part noisy) and its CPU floor (noisy by ``cpu_noise``), the step the
    largest of them. Worker 0 has no floor, worker 1's floor is under its compute path
    (exact, then noisy), worker 2's is far above it."""
    rng = np.random.default_rng(3)
    comm = CommModel(buckets=[(0.3, 0.05), (1.0, 0.01)])
    plain = [NodeModel(fwd=(0.01 * k, 0.001 * k), bwd=(0.02 * k, 0.002 * k), noise=0.25)
             for k in (1.0, 2.0, 3.0)]
    floors = [None, (0.08, 0.002), (0.18, 0.001)]
    split = [30, 12, 6]
    without = ClusterModel(nodes=plain, comm=comm)
    arr = without.arrays
    lines = arr.offsets + arr.slopes * np.array(split, dtype=float)[:, None]
    j = np.argmax(lines, axis=1)
    path = lines[np.arange(3), j]
    compute = path - arr.comm_left[j]
    floor = np.array([0.0 if f is None else f[0] + f[1] * b for f, b in zip(floors, split,
                                                                           strict=True)])
    assert floor[1] < path[1] and floor[2] > path[2] + 0.03
    for cpu_noise in ([0.0, 0.0, 0.0], [0.0, 0.1, 0.2]):
        nodes = [dataclasses.replace(nd, cpu_floor=f, cpu_noise=c)
                 for nd, f, c in zip(plain, floors, cpu_noise, strict=True)]
        cluster = ClusterModel(nodes=nodes, comm=comm)
        draws_path = path + compute * np.expm1(0.25 * rng.standard_normal((400_000, 3)))
        draws_floor = floor * np.exp(np.array(cpu_noise) * rng.standard_normal((400_000, 3)))
        draws = np.maximum(draws_path, draws_floor).max(axis=1)
        se = float(draws.std()) / math.sqrt(draws.size)
        got = cluster.expected_step_time(split)
        assert abs(got - float(draws.mean())) < 4 * se, (cpu_noise, got, float(draws.mean()))
        np.testing.assert_allclose(cluster.node_times(split), np.maximum(path, floor),
                                   rtol=1e-12)
    with pytest.raises(ValueError, match="cpu_noise=0.1 must be finite and >= 0, and 0 "
                                         "without a cpu_floor"):
        NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), cpu_noise=0.1)
    with pytest.raises(ValueError, match="cpu_noise=-0.1"):
        NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), cpu_floor=(0.1, 0.0), cpu_noise=-0.1)


def test_a_worker_at_0_samples_rests_on_its_idle_floor() -> None:
    """Reference: each worker's compute time from its own lines (max over the buckets) and
    its floor, ``cpu_idle`` at 0 samples and the line elsewhere, in one direct formula."""
    comm = CommModel(buckets=[(0.3, 0.05), (1.0, 0.01)])
    plain = [NodeModel(fwd=(0.01 * k, 0.001 * k), bwd=(0.02 * k, 0.002 * k), noise=0.25)
             for k in (1.0, 2.0, 3.0)]
    floors = [(None, None), ((0.08, 0.002), None), ((0.30, 0.001), 0.16)]
    nodes = [dataclasses.replace(nd, cpu_floor=f, cpu_idle=i)
             for nd, (f, i) in zip(plain, floors, strict=True)]
    cluster = ClusterModel(nodes=nodes, comm=comm)

    def reference(split: list[int]) -> list[float]:
        times = []
        for node, (floor, idle), b in zip(plain, floors, split, strict=True):
            compute = max(r * node.backward_time(b) + node.forward_time(b) + left
                          for (r, _), left in zip(comm.buckets, comm.remaining, strict=True))
            at_floor = 0.0 if floor is None else (
                idle if b == 0 and idle is not None else floor[0] + floor[1] * b)
            times.append(max(compute, at_floor))
        return times

    for split in ([40, 8, 0], [40, 8, 1], [48, 0, 0], [0, 0, 0]):
        np.testing.assert_allclose(cluster.node_times(split), reference(split), rtol=1e-12)
    batches = np.array([[40, 40], [8, 8], [0, 1]])  # several splits at once: the same
    np.testing.assert_allclose(cluster.node_times(batches)[:, 0], reference([40, 8, 0]))
    # worker 2 on its idle floor sets the step (worker 1's noisy path reaches past it in a
    # few steps in a hundred)
    assert cluster.step_time([20, 8, 0]) == pytest.approx(0.16, rel=1e-12)
    assert 0.16 <= cluster.expected_step_time([20, 8, 0]) < 0.162
    assert cluster.step_time([40, 8, 1]) > 0.30  # one sample puts it back on its line
    with pytest.raises(ValueError, match="cpu_idle=-0.1 must be finite and >= 0, with a "
                                         "cpu_floor"):
        NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), cpu_floor=(0.1, 0.0), cpu_idle=-0.1)
    with pytest.raises(ValueError, match="with a cpu_floor"):
        NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), cpu_idle=0.1)


def test_a_worker_at_0_samples_takes_its_idle_times() -> None:
    """Reference: at 0 samples a worker's path is ``max_j(fwd + rho_j*bwd + R_j)`` of its
    ``idle_times``, its lines' elsewhere, in one direct formula; its noise is relative to
    that compute (a Monte Carlo of 400 000 steps)."""
    comm = CommModel(buckets=[(0.3, 0.05), (1.0, 0.01)])
    idle = [None, (0.001, 0.004), (0.002, 0.001)]
    nodes = [NodeModel(fwd=(0.01 * k, 0.001 * k), bwd=(0.02 * k, 0.002 * k), noise=0.25,
                       idle_times=times) for k, times in zip((1.0, 2.0, 3.0), idle, strict=True)]
    cluster = ClusterModel(nodes=nodes, comm=comm)

    def reference(split: list[int]) -> tuple[np.ndarray, np.ndarray]:
        paths, computes = [], []
        for node, times, b in zip(nodes, idle, split, strict=True):
            fwd, bwd = times if b == 0 and times is not None else (
                node.fwd[0] + node.fwd[1] * b, node.bwd[0] + node.bwd[1] * b)
            lines = [fwd + r * bwd + left
                     for (r, _), left in zip(comm.buckets, comm.remaining, strict=True)]
            j = int(np.argmax(lines))
            paths.append(lines[j])
            computes.append(lines[j] - float(comm.remaining[j]))
        return np.array(paths), np.array(computes)

    for split in ([40, 8, 0], [40, 0, 0], [0, 0, 0], [40, 8, 1]):
        np.testing.assert_allclose(cluster.node_times(split), reference(split)[0], rtol=1e-12)
    batches = np.array([[40, 40], [0, 8], [0, 1]])  # several splits at once: the same
    np.testing.assert_allclose(cluster.node_times(batches)[:, 0], reference([40, 0, 0])[0])
    np.testing.assert_allclose(cluster.node_times(batches)[:, 1], reference([40, 8, 1])[0])
    assert nodes[1].forward_time(0) + nodes[1].backward_time(0) == pytest.approx(0.005)
    assert nodes[0].forward_time(0) == 0.01  # no idle times: the line's intercept
    rng = np.random.default_rng(5)
    split = [4, 3, 0]
    path, compute = reference(split)
    draws = (path + compute * np.expm1(0.25 * rng.standard_normal((400_000, 3)))).max(axis=1)
    se = float(draws.std()) / math.sqrt(draws.size)
    assert abs(cluster.expected_step_time(split) - float(draws.mean())) < 4 * se
    with pytest.raises(ValueError, match=r"idle_times=\(-0.1, 0.0\) must have fwd >= 0"):
        NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), idle_times=(-0.1, 0.0))
    with pytest.raises(ValueError, match=r"idle_times must be \(fwd, bwd\)"):
        NodeModel(fwd=(0.01, 0.001), bwd=(0.02, 0.002), idle_times=(0.1,))  # type: ignore[arg-type]


def test_fitted_noise_is_the_relative_timing_noise() -> None:
    rng = np.random.default_rng(2)
    fitter = NodeFitter()
    for _ in range(64):
        b = int(rng.integers(8, 64))
        k = math.exp(0.2 * rng.standard_normal())
        fitter.add(b, (0.01 + 0.001 * b) * k, (0.02 + 0.002 * b) * k)
    model = fitter.fit()
    assert model is not None and model.noise == pytest.approx(0.2, rel=0.25)
    exact = NodeFitter()
    for b in (8, 16, 32, 8, 16, 32, 8, 16, 32):
        exact.add(b, 0.01 + 0.001 * b, 0.02 + 0.002 * b)
    model = exact.fit()
    assert model is not None and model.noise == pytest.approx(0.0, abs=1e-9)


def test_the_fit_keeps_batch_sizes_the_window_has_forgotten() -> None:
    # a plan holds at 1-2 samples after a warm-up at 160: with the window alone the slope
    # comes from 1 vs 2 samples under 25% noise; the warm-up's median anchors it (the
    # plan's own batch sizes are not remembered: it chose them by the measurements)
    rng = np.random.default_rng(3)
    slopes = []
    for _ in range(20):
        fitter = NodeFitter()
        for step, b in enumerate([160] * 3 + [int(v) for v in rng.integers(1, 3, 200)]):
            k = np.exp(0.25 * rng.standard_normal(2))
            fitter.add(b, (0.02 + 0.0001 * b) * k[0], (0.03 + 0.0002 * b) * k[1],
                       remember=step < 3)  # the warm-up, chosen regardless of the times
        assert fitter.batch_sizes() == [1.0, 2.0, 160.0]
        model = fitter.fit()
        assert model is not None
        slopes.append(model.fwd[1] + model.bwd[1])
    print(f"slope with the anchor: median {np.median(slopes) * 1e3:.2f} ms/sample "
          f"(true 0.30), range {min(slopes) * 1e3:.2f}-{max(slopes) * 1e3:.2f}")
    assert np.median(slopes) == pytest.approx(0.0003, rel=0.2)


def test_a_speed_change_forgets_the_anchors() -> None:
    fitter = NodeFitter()
    for b in [160] * 5 + [2] * 64:
        fitter.add(b, 0.02 + 0.0001 * b, 0.03 + 0.0002 * b, remember=b == 160)
    assert fitter.batch_sizes() == [2.0, 160.0]  # 160 only as an anchor now
    for _ in range(20):
        fitter.add(2, 2 * (0.02 + 0.0002), 2 * (0.03 + 0.0004))  # 2x slower from now on
    model = fitter.fit()
    assert model is not None and fitter.batch_sizes() == [2.0]
    assert model.forward_time(2) + model.backward_time(2) == pytest.approx(2 * 0.0506, rel=0.01)


def test_steps_at_0_samples_are_the_idle_times_not_a_point_of_the_line() -> None:
    fitter = NodeFitter()
    for b in (40, 80, 40, 80):
        fitter.add(b, 0.02 + 0.0001 * b, 0.03 + 0.0002 * b)
    for fwd in (0.001, 0.003):
        fitter.add(0, fwd, 0.002)
    assert fitter.idle_times() is None and fitter.num_samples == 4  # 2 < anchor_min_samples
    fitter.add(0, 0.002, 0.004)
    assert fitter.idle_times() == (0.002, 0.002) and fitter.num_samples == 4
    model = fitter.fit()
    assert model is not None and model.idle_times == (0.002, 0.002)
    assert model.fwd == pytest.approx((0.02, 0.0001)) and model.bwd == pytest.approx((0.03, 0.0002))
    assert model.forward_time(0) + model.backward_time(0) == pytest.approx(0.004)
    with pytest.raises(ValueError, match="anchor_min_samples=3 exceeds idle_samples=2"):
        NodeFitter(idle_samples=2)
    with pytest.raises(ValueError, match="idle_samples=0 must be an integer >= 1"):
        NodeFitter(idle_samples=0)


def test_a_change_seen_at_0_samples_is_followed_there_and_keeps_the_line() -> None:
    """An idle worker's time at 0 samples (on a quota worker mostly throttle waits, which
    come and go) is kept apart from its lines: a shift there is followed, and says
    nothing of the time per sample."""
    fitter = NodeFitter()
    for b in [160] * 5 + [0] * 64:
        fitter.add(b, 0.02 + 0.0001 * b, 0.03 + 0.0002 * b, remember=b == 160)
    for _ in range(20):
        fitter.add(0, 1.5 * 0.02, 1.5 * 0.03)  # its fixed time 1.5x
    model = fitter.fit()
    assert model is not None and fitter.num_samples == 5  # the window holds the busy steps
    assert fitter.batch_sizes() == [160.0] and model.idle_times == fitter.idle_times()
    assert model.forward_time(0) + model.backward_time(0) == pytest.approx(0.075, rel=0.01)
    assert model.forward_time(160) + model.backward_time(160) == pytest.approx(0.098, rel=0.01)


def test_only_remembered_batch_sizes_anchor_the_fit() -> None:
    fitter = NodeFitter()
    for b in [160] * 5 + [2] * 64:
        fitter.add(b, 0.02 + 0.0001 * b, 0.03 + 0.0002 * b)
    assert fitter.batch_sizes() == [2.0] and fitter.level_count(160) == 0
    assert fitter.slope_error() == math.inf


def test_remembered_batch_sizes_keep_the_spread() -> None:
    # past ``levels`` batch sizes, the one nearest its neighbours goes, never the extremes
    fitter = NodeFitter(levels=4)
    for b in (1, 160, 80, 81, 82, 3):
        for _ in range(3):
            fitter.add(b, 0.02 + 0.0001 * b, 0.03 + 0.0002 * b, remember=True)
    # 82 came: 80, 81, 82 are 1 apart and 80 is the oldest; 3 came: 81 and 82, 81 older
    assert [b for b in (1, 3, 80, 81, 82, 160) if fitter.level_count(b)] == [1, 3, 82, 160]
    assert fitter.nearest_level(150) == 160.0 and fitter.level_count(160) == 3


def test_a_refit_without_new_samples_is_the_last_fit() -> None:
    """Only workers with new samples are refitted: asking again returns the same model
    (also across a speed change, where a fit forgets the older samples), and the
    trajectory is that of a fitter asked once per step."""
    rng = np.random.default_rng(21)
    twice, once = NodeFitter(), NodeFitter()
    for step in range(120):
        batch = int(rng.integers(4, 40))
        slow = 2.0 if step > 70 else 1.0
        noise = float(rng.lognormal(0, 0.1))
        values = (batch, slow * noise * (0.01 + 1e-3 * batch), slow * noise * (0.02 + 2e-3 * batch))
        twice.add(*values, remember=step < 6)
        once.add(*values, remember=step < 6)
        first = twice.fit(name="w")
        again = twice.fit(name="w")
        assert again == first and again == once.fit(name="w")
        assert twice.fit(name="v", max_batch=50) == dataclasses.replace(first, name="v",
                                                                         max_batch=50)
    assert twice.num_samples < 64  # the speed change was found and the window cut


def test_fitted_models_are_what_the_constructor_builds() -> None:
    """fit_nodes builds most models from a checked one (no checks per model): each must
    equal NodeModel's own construction, and bounds NodeModel refuses are still refused,
    whichever worker first carries them."""
    rng = np.random.default_rng(5)
    fitters = [NodeFitter() for _ in range(8)]
    for fitter in fitters:
        for b, f, k in samples(rng, 20, noise=0.1):
            fitter.add(b, f, k)
    names = [f"w{i}" for i in range(8)]
    lows, highs = [1, 2, 1, 1, 2, 1, 1, 1], [None, 64, None, 64, 64, None, 80, None]
    models = fit_nodes(fitters, names, lows, highs)
    for model, name, low, high in zip(models, names, lows, highs, strict=True):
        assert model is not None
        assert model == NodeModel(fwd=model.fwd, bwd=model.bwd, name=name, min_batch=low,
                                  max_batch=high, noise=model.noise,
                                  noise_batch=model.noise_batch)
        # the noise was measured at the window's batches: their mean
        assert model.noise > 0 and model.noise_batch == pytest.approx(
            float(np.mean(fitters[names.index(name)].samples()[:, 0])))
        assert type(model.min_batch) is int and model.micro_batch is None
    for bad_low in (1.0, True):
        for fitter, b in zip(fitters, (8, 16), strict=False):
            fitter.add(b, 0.02, 0.04)  # a new sample: refitted
        with pytest.raises(ValueError, match=f"node 'w1': min_batch={bad_low}"):
            fit_nodes(fitters[:2], names[:2], [1, bad_low], [None, None])  # type: ignore[list-item]


def random_windows(rng: np.random.Generator, rows: int, width: int = 64) -> tuple[
        np.ndarray, np.ndarray, np.ndarray]:
    """Windows as the fitters hold them (batch, fwd, bwd; zeros past each row's count):
    few or many batch sizes, zero batches, 10x stragglers, a speed change in some rows."""
    b, y = np.zeros((rows, width)), np.zeros((2, rows, width))
    valid = np.arange(width) < rng.integers(2, width + 1, rows)[:, None]
    for row in range(rows):
        count = int(valid[row].sum())
        sizes = np.array([[16, 17], [8, 24, 32, 48], list(range(65))][row % 3], dtype=float)
        batch = rng.choice(sizes, count)
        batch[:2] = sizes[:2]  # two sizes at least
        speed = np.where(np.arange(count) < rng.integers(count // 2, count + 1), 1.0,
                         rng.choice([0.5, 2.0]))
        noise = rng.lognormal(0.0, rng.choice([0.0, 0.05, 0.25]), count)
        noise *= np.where(rng.random(count) < 0.1, 10.0, 1.0)
        b[row, :count] = batch
        y[0, row, :count] = speed * noise * (0.01 + 0.001 * batch)
        y[1, row, :count] = speed * noise * (0.02 + 0.002 * batch)
    return b, y, valid


@pytest.mark.parametrize("block_values", [rowfit._BLOCK_VALUES, 700])
def test_vectorised_line_fits_match_the_per_row_reference(
        block_values: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """rowfit.robust_lines over many rows (fitted in blocks) against the one-row-at-a-time
    reference, and change_points against a loop over the splits: random windows with
    stragglers, speed changes, zero batches, missing samples and anchors."""
    monkeypatch.setattr(rowfit, "_BLOCK_VALUES", block_values)
    rng = np.random.default_rng(11)
    cfg = FitConfig()
    b, y, valid = random_windows(rng, 90)
    anchor_count = rng.integers(0, 4, len(b))
    a_valid = np.arange(3) < anchor_count[:, None]
    a_b = np.where(a_valid, rng.choice([4.0, 64.0, 96.0], (len(b), 3)), 0.0)
    a_y = np.where(a_valid, np.stack([0.01 + 0.001 * a_b, 0.02 + 0.002 * a_b]), 0.0)
    a_w = np.where(a_valid, rng.uniform(1, 6, (len(b), 3)), 0.0)
    intercept, slope = rowfit.robust_lines(cfg, b, y, valid, a_b, a_y, a_w, a_valid)
    for row in range(len(b)):
        for series in range(2):
            anchors = np.stack([a_b[row], a_y[series, row], a_w[row]], axis=1)[a_valid[row]]
            expected = robust_line_of(cfg, b[row, valid[row]], y[series, row, valid[row]],
                                      anchors)
            assert (intercept[series, row], slope[series, row]) == pytest.approx(
                expected, rel=1e-9, abs=1e-15), (row, series)
    log_ratio = np.log(y[0] / (0.01 + 0.001 * b), out=np.zeros_like(b), where=valid)
    found = rowfit.change_points(log_ratio, valid, cfg, rowfit.robust_spread(log_ratio, valid))
    expected_points = [change_point_of(cfg, log_ratio[row, valid[row]]) for row in range(len(b))]
    assert found.tolist() == expected_points
    assert sum(p > 0 for p in expected_points) >= 10  # the test has speed changes to find


def test_the_cpu_floor_is_the_chord_under_a_concave_cpu_curve() -> None:
    """Reference: the median CPU at each measured batch size (the quarter-core worker of
    bench_real: per-sample CPU falls with the batch). The chord from the smallest to the
    largest busy size passes through both medians and stays under the ones between; the
    median at 0 samples is the idle floor, below where the chord starts."""
    rng = np.random.default_rng(4)
    truth = {0: 0.0166, 28: 0.0225, 80: 0.0272, 160: 0.0304}
    fitter = CpuFitter()
    for _ in range(3):  # the warm-up's batch, remembered
        fitter.add(160, truth[160] * float(np.exp(0.1 * rng.standard_normal())), remember=True)
    idle: list[float] = []
    for batch, count in ((28, 5), (80, 5), (0, 51)):
        for _ in range(count):
            cpu = truth[batch] * float(np.exp(0.1 * rng.standard_normal()))
            fitter.add(batch, cpu)
            idle += [cpu] if batch == 0 else []
    medians = fitter.level_medians()
    assert sorted(medians) == [0, 28, 80, 160]
    c0, c1 = fitter.floor_line() or (math.nan, math.nan)
    assert c0 + 28 * c1 == pytest.approx(medians[28], rel=1e-12)
    assert c0 + 160 * c1 == pytest.approx(medians[160], rel=1e-12)
    assert c0 + c1 * 80 <= medians[80]
    assert fitter.idle() == medians[0] < c0  # 0 samples: no forward, no backward
    for batch in (28, 80, 160):  # within the noise of each median
        assert c0 + c1 * batch == pytest.approx(truth[batch], rel=0.25)
    for _ in range(64):  # the plan moves on: the window forgets 0 samples, the fitter keeps
        fitter.add(80, truth[80])  # the latest level_samples of them
    assert fitter.idle() == pytest.approx(float(np.median(idle[-fitter.level_samples:])))


def test_where_the_cpu_per_sample_grows_the_floor_touches_the_level_in_use() -> None:
    """A small transformer's CPU per step on one core grows faster than its batch (4.4,
    10.7, 15.5 and 32.1 ms at 24, 106, 165 and 330 samples), and a probe's few steps at 330
    read 30% higher still; the plan is at 165. The chord from 24 to 330 runs 39% over the
    level in use. Reference, by brute force over the level medians: the slopes a line
    through the level in use can take and stay under every level (from the steepest chord
    to a smaller size to the shallowest to a larger one) and start at 0 or above (at most
    the level over its size); the floor's is the chord's slope held within them."""
    rng = np.random.default_rng(7)
    truth = {24: 0.0044, 106: 0.0107, 165: 0.0155, 330: 0.0321 * 1.3}
    fitter = CpuFitter()
    for batch, count in ((24, 5), (106, 5), (330, 3), (165, 40)):
        for _ in range(count):
            fitter.add(batch, truth[batch] * float(np.exp(0.05 * rng.standard_normal())),
                       remember=batch != 165)
    medians = fitter.level_medians()
    assert fitter.in_use() == (165, 40)
    chord = (medians[330] - medians[24]) / (330 - 24)
    assert medians[24] + chord * (165 - 24) > 1.3 * medians[165]
    at = medians[165]
    low = max((at - medians[b]) / (165 - b) for b in (24, 106))
    high = min((medians[330] - at) / (330 - 165), at / 165)
    assert low <= high
    c0, c1 = fitter.floor_line() or (math.nan, math.nan)
    assert c1 == pytest.approx(min(max(chord, low), high), rel=1e-12)
    assert c0 + 165 * c1 == pytest.approx(at, rel=1e-12)
    assert c0 >= 0
    assert all(c0 + c1 * batch <= median * (1 + 1e-12) for batch, median in medians.items())


def test_batch_sizes_close_together_make_no_cpu_floor() -> None:
    """A bench_real run: the half-core worker's warm-up at 160 samples and its plan's 159,
    medians 20.4 and 19.2 ms, made a chord of 1.2 ms per sample. Two sizes so close make
    none; with its CPU at 0 samples the line runs from there with the chord's slope
    (reference: the line through the two medians), lowered to the level in use (159,
    measured 30 times, which the chord ran 6% over), and sizes a factor of 2 apart make
    one."""
    fitter = CpuFitter()
    for value in (0.0204, 0.0199, 0.0215):
        fitter.add(160, value, remember=True)
    for step in range(30):
        fitter.add(159, 0.0192 * (1.0 + 0.01 * (step % 3 - 1)))
    assert sorted(fitter.level_medians()) == [159, 160]
    assert fitter.floor_line() is None
    for step in range(5):
        fitter.add(0, 0.0058 + 0.0001 * step)
    medians = fitter.level_medians()
    c0, c1 = fitter.floor_line() or (math.nan, math.nan)
    assert c1 == pytest.approx((medians[160] - medians[0]) / 160, rel=1e-12)
    assert c0 + 159 * c1 == pytest.approx(medians[159], rel=1e-12)
    assert all(c0 + c1 * batch <= median * (1 + 1e-12) for batch, median in medians.items())
    assert c1 < 0.0001
    apart = CpuFitter()
    for batch, value in ((80, 0.012), (160, 0.020)):
        for _ in range(3):
            apart.add(batch, value)
    assert apart.floor_line() == pytest.approx((0.004, 0.0001), rel=1e-9)


def test_sizes_closer_than_2x_make_a_floor_where_their_medians_resolve_its_slope() -> None:
    """160 and 240 samples, 9 steps each: with a 2% spread the chord's slope is resolved
    (reference: the chord through the two medians), with a 30% spread it is not (its error
    carried to 240 samples is ~45% of the floor there)."""
    rng = np.random.default_rng(5)
    for spread, resolved in ((0.02, True), (0.3, False)):
        fitter = CpuFitter()
        for _ in range(9):
            for batch in (160, 240):
                fitter.add(batch, (0.004 + 0.0001 * batch) * float(np.exp(spread
                                                                          * rng.normal())))
        line = fitter.floor_line()
        assert (line is not None) is resolved, (spread, line)
        if line is not None:
            medians = fitter.level_medians()
            slope = (medians[240] - medians[160]) / 80
            assert line == pytest.approx((medians[160] - 160 * slope, slope), rel=1e-9)


def test_a_few_early_steps_reading_high_do_not_lift_the_cpu_floor() -> None:
    """Reference: scikit-learn's weighted isotonic regression of the level medians. The
    warm-up's 3 steps at 160 samples read above the later 9 at 162 and 177 (as in a run of
    bench_real); the chord's low end is their pooled level, not the warm-up's."""
    from sklearn.isotonic import IsotonicRegression

    rng = np.random.default_rng(5)
    fitter = CpuFitter()
    measured: dict[float, list[float]] = {0.0: [], 160.0: [0.0233] * 3, 162.0: [], 177.0: [],
                                          388.0: []}
    for value in measured[160.0]:
        fitter.add(160, value, remember=True)
    for batch, centre, count in ((0, 0.0108, 9), (162, 0.0214, 9), (177, 0.0208, 9),
                                 (388, 0.0445, 5)):
        for _ in range(count):
            value = centre * float(np.exp(0.02 * rng.standard_normal()))
            fitter.add(batch, value)
            measured[float(batch)].append(value)  # 35 steps: the window holds them all
    sizes = sorted(measured)
    medians = [float(np.median(measured[b])) for b in sizes]
    reference = IsotonicRegression(increasing=True).fit(
        sizes, medians, sample_weight=[len(measured[b]) for b in sizes]).predict(sizes)
    assert medians[1] > medians[2]  # the warm-up's level reads high: it is pooled
    c0, c1 = fitter.floor_line() or (math.nan, math.nan)
    # the chord's slope, through the pooled level at the size in use (177: 9 steps, the
    # latest), which the chord from 160 ran over by its slope times 17
    assert c1 == pytest.approx((reference[-1] - reference[1]) / (388 - 160), rel=1e-9)
    assert c0 + 177 * c1 == pytest.approx(reference[3], rel=1e-9)
    assert all(c0 + c1 * b <= level + 1e-12 for b, level in zip(sizes[1:], reference[1:],
                                                                 strict=True))
    assert c0 + 160 * c1 < medians[1] - 0.001
    assert fitter.idle() == pytest.approx(reference[0], rel=1e-9)


def test_the_cpu_floors_noise_is_the_spread_of_the_cpu_around_each_level() -> None:
    """Reference: numpy's median of the pooled absolute deviations of the log ratio, and
    the lognormal noise the steps were drawn with (sigma 0.1, 0.2): one stalled step in
    ten does not move it much."""
    for sigma in (0.1, 0.2):
        rng = np.random.default_rng(6)
        fitter = CpuFitter()
        assert fitter.noise() == 0.0
        levels: dict[int, list[float]] = {0: [], 80: []}
        for step in range(60):
            batch = 0 if step % 3 else 80
            centre = 0.0108 if batch == 0 else 0.0272
            cpu = centre * float(np.exp(sigma * rng.standard_normal()))
            cpu *= 3.0 if step % 10 == 9 else 1.0  # a stalled step
            fitter.add(batch, cpu)
            levels[batch].append(cpu)
        deviations = np.concatenate([np.abs(np.log(np.array(v) / np.median(v)))
                                     for v in levels.values()])
        assert fitter.noise() == pytest.approx(1.4826 * float(np.median(deviations)), rel=1e-9)
        assert fitter.noise() == pytest.approx(sigma, rel=0.3)


def test_the_cpu_floor_follows_a_creep_measured_every_16th_step() -> None:
    """A held plan measured every 16th step: the quarter-core worker's CPU at 0 samples
    creeps from 7.0 to 9.0 ms over its last 200 steps (as in a 900-step run of
    bench_prediction). Reference: numpy's median of the measurements of the last 256
    steps. The whole window of 64 measurements (1000 steps) lags behind by 12%."""
    rng = np.random.default_rng(8)
    fitter = CpuFitter()
    steps = np.arange(0, 1024, 16)
    truth = np.where(steps < 824, 0.0070, 0.0070 + 0.0020 * (steps - 824) / 200)
    measured = truth * np.exp(0.05 * rng.standard_normal(steps.size))
    for step, cpu in zip(steps.tolist(), measured.tolist(), strict=True):
        fitter.add(0, cpu, step=step)
    recent = measured[steps > steps[-1] - fitter.span]
    assert recent.size == 16
    assert fitter.idle() == pytest.approx(float(np.median(recent)), rel=1e-12)
    assert fitter.idle() == pytest.approx(0.0083, rel=0.05)
    assert float(np.median(measured)) < 0.0073  # what the window alone made of it
    with pytest.raises(ValueError, match="span=0"):
        CpuFitter(span=0)


def test_cpu_fitter_levels_need_samples_and_keep_their_ends() -> None:
    fitter = CpuFitter(window=8, levels=3, min_samples=2)
    assert fitter.floor_line() is None and not fitter.add(4, math.nan)
    for _ in range(2):
        fitter.add(0, 0.01, remember=True)
    fitter.add(50, 0.02)  # one measurement: not a level yet
    assert fitter.floor_line() is None
    fitter.add(50, 0.02)
    assert fitter.floor_line() == pytest.approx((0.01, 0.0002))
    for batch in (10, 20, 100):  # a fourth remembered size evicts a middle one, not an end
        for _ in range(2):
            fitter.add(batch, 0.01 + 0.0002 * batch, remember=True)
    for _ in range(8):  # the window turns over: the remembered ends still make the chord
        fitter.add(20, 0.014)
    assert sorted(fitter.level_medians()) == [0, 20, 100]
    assert fitter.floor_line() == pytest.approx((0.01, 0.0002))  # over 20 and 100 now
    assert fitter.idle() == pytest.approx(0.01)
    with pytest.raises(ValueError, match="levels=1"):
        CpuFitter(levels=1)


def test_what_a_cpu_fitter_reads_follows_every_measurement() -> None:
    # its levels are read once per measurement and kept: each read after a new one must
    # equal a fresh fitter's, fed the same measurements, read only then
    rng = np.random.default_rng(4)
    fitter, added = CpuFitter(window=16, min_samples=2), []
    for step in range(60):
        batch = (0, 40, 80, 160)[step % 4] if step < 30 else 80
        sample = (float(batch), 0.01 + 0.0001 * batch * float(np.exp(0.1 * rng.normal())))
        fitter.add(*sample, remember=step < 8)
        added.append((*sample, step < 8))
        fresh = CpuFitter(window=16, min_samples=2)
        for batch_s, cpu_s, remember in added:
            fresh.add(batch_s, cpu_s, remember=remember)
        for name in ("floor_line", "level_medians", "idle", "noise", "in_use"):
            assert getattr(fitter, name)() == getattr(fresh, name)(), (step, name)
