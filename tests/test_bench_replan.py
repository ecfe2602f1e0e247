"""bench_replan's reading of a run: a re-plan's cost is counted over its step and the next."""

from __future__ import annotations

import itertools

import pytest

from benchmark_modules import load_benchmark


def test_a_replans_cost_is_its_step_and_the_next_over_the_quiet_steps() -> None:
    # 200 steps of 50 ms; the re-plan after step 40 adds 4 ms to it and 16 to step 41, the
    # one after step 100 6 and 14; one in the skipped start (step 10) is left out
    durations = {k: 0.050 for k in range(1, 200)}
    for step, own, next_ in ((10, 0.030, 0.030), (40, 0.004, 0.016), (100, 0.006, 0.014)):
        durations[step] += own
        durations[step + 1] += next_
    ends = [0.0, *itertools.accumulate(durations[k] for k in range(1, 200))]
    run = {"ends": ends, "replans": [[10, 0.05], [40, 0.012], [100, 0.018]]}
    got = load_benchmark("bench_replan")._summary(run, skip=30)
    assert got["quiet_ms"] == pytest.approx(50.0)
    assert got["replans"] == 2
    assert got["excess_ms"] == pytest.approx(20.0)  # both cost 20 ms over two steps
    assert got["plan_ms"] == pytest.approx(15.0)  # median of 12 and 18
    counted = [durations[k] for k in range(30, 200)]
    assert got["mean_ms"] == pytest.approx(1e3 * sum(counted) / len(counted))
    assert got["share"] == pytest.approx(0.040 / sum(counted))
