"""bench_prediction's reading of a run: each plan's window and the model away from its split."""

from __future__ import annotations

import itertools

import pytest

from benchmark_modules import load_benchmark


def _ends(durations: list[float]) -> list[float]:
    return list(itertools.accumulate(durations, initial=0.0))[1:]


def test_a_window_is_the_steps_its_plan_held_without_the_replans_two() -> None:
    # 40 steps: warm-up to step 4, a plan at step 4 (60 ms), a probe at 14, a plan at 24
    # held from step 30 on; a re-plan adds 30 ms to its own step and 20 to the next
    durations = [0.100] * 5 + [0.060] * 10 + [0.090] * 10 + [0.050] * 15
    for replan in (4, 14, 24):
        durations[replan] += 0.030
        durations[replan + 1] += 0.020
    run = {"ends": _ends(durations), "held": [k >= 30 for k in range(40)],
           "history": [[0, "start", [160, 160, 160], None, False],
                       [4, "cadence", [300, 180, 0], 0.054, False],
                       [14, "probe", [160, 240, 80], 0.090, True],
                       [24, "cadence", [310, 170, 0], 0.055, False]]}
    found = load_benchmark("bench_prediction").windows(run)
    assert [w["step"] for w in found] == [4, 14, 24]
    assert [w["kind"] for w in found] == ["chosen", "explore", "chosen"]
    assert [w["steps"] for w in found] == [8, 8, 14]  # steps 6-13, 16-23, 26-39
    assert [w["measured_s"] for w in found] == pytest.approx([0.060, 0.090, 0.050])
    assert [w["error"] for w in found] == pytest.approx([-0.1, 0.0, 0.1])
    assert [w["settled"] for w in found] == [False, False, False]  # held from step 30


def test_a_window_settles_once_a_plan_held_and_is_also_predicted_by_the_last_at_its_split(
) -> None:
    durations = [0.050] * 30 + [0.040] * 30  # the machine speeds up at step 30
    run = {"ends": _ends(durations), "held": [k >= 10 for k in range(60)],
           "history": [[0, "start", [2, 1], None, False], [4, "cadence", [2, 1], 0.05, False],
                       [20, "probe", [1, 2], 0.05, True], [26, "cadence", [2, 1], 0.05, False],
                       [58, "cadence", [2, 1], 0.05, False]]}
    found = load_benchmark("bench_prediction").windows(run)
    assert [(w["step"], w["settled"]) for w in found] == [(4, False), (20, True), (26, True)]
    assert [w["persistence"] for w in found[:2]] == [None, None]  # none before; a probe
    assert found[2]["measured_s"] == pytest.approx((2 * 0.050 + 28 * 0.040) / 30)  # 28-57
    assert found[2]["persistence"] == pytest.approx(0.050 / found[2]["measured_s"] - 1)


def test_a_window_knows_its_own_noise_and_whether_its_move_ran_faster() -> None:
    durations = [0.050] * 20 + [0.040, 0.060] * 5 + [0.055] * 20
    run = {"ends": _ends(durations), "held": [True] * 50,
           "history": [[0, "start", [2, 1], None, False], [4, "cadence", [2, 1], 0.05, False],
                       [16, "cadence", [3, 0], 0.05, False], [28, "probe", [1, 2], 0.05, True],
                       [34, "cadence", [3, 0], 0.05, False]]}
    found = load_benchmark("bench_prediction").windows(run)
    assert [(w["step"], w["moved"]) for w in found] == [
        (4, None), (16, True), (28, None), (34, False)]  # first; 2/1 -> 3/0; a probe; 3/0 again
    assert found[0]["noise"] == pytest.approx(0.0)  # steps 6-15 all 50 ms
    timed = [0.050] * 2 + [0.040, 0.060] * 4  # steps 18-27
    mean = sum(timed) / len(timed)
    spread = (sum((t - mean) ** 2 for t in timed) / (len(timed) - 1)) ** 0.5
    assert found[1]["noise"] == pytest.approx(spread / len(timed) ** 0.5 / mean)
    assert found[1]["change"] == pytest.approx(mean / 0.050 - 1)
    assert found[3]["change"] is None


def test_the_model_away_from_its_split_is_judged_absolutely_and_relatively() -> None:
    pinned = {"its split": {"predicted": 0.050, "blocks": [0.055, 0.050, 0.045]},
              "even": {"predicted": 0.120, "blocks": [0.100, 0.110, 0.090]},
              "2x away": {"predicted": None, "blocks": [0.08]}}
    errors = load_benchmark("bench_prediction").away_errors(pinned)
    assert set(errors) == {"its split", "even"}
    assert errors["its split"] == pytest.approx((0.0, 0.0))
    assert errors["even"] == pytest.approx((0.2, 0.2))


def test_the_report_prints_the_windows_and_the_model_away_from_its_split(
        capsys: pytest.CaptureFixture[str]) -> None:
    durations = [0.050] * 60
    parts = {"path": [40.0, 45.0, 50.0], "floor": [20.0, 30.0, 55.0]}
    run = {"ends": _ends(durations), "held": [k >= 10 for k in range(60)],
           "history": [[0, "start", [2, 1, 0], None, False],
                       [4, "cadence", [2, 1, 0], 0.045, False],
                       [20, "cadence", [2, 1, 0], 0.055, False]],
           "pinned": {"its split": {"split": [2, 1, 0], "predicted": 0.05, "blocks": [0.05],
                                    "parts": None},
                      "even": {"split": [1, 1, 1], "predicted": 0.11, "blocks": [0.1],
                               "parts": parts}},
           "cpu_levels": [[[0.0, 0.01], [1.0, 0.02]], [], []], "tracked": [-0.1, 0.05, 0.03]}
    load_benchmark("bench_prediction")._report([run], steps=60, block_steps=8, period_ms=10,
                                               model="mlp")
    out = capsys.readouterr().out
    assert "CPU quotas 1, 0.5, 0.25 (10 ms period)" in out
    assert "window error once settled: median |error| 10.0% over 1 windows" in out
    assert "the window before's measured mean 0.0%" in out  # 20 follows 4 at 2/1/0
    assert "a window's own mean is known to 0.0%" in out
    assert "1 windows at the split of the window before: median |error| 10.0%" in out
    assert "after a move" not in out
    assert "error +10.0%, relative to its split +10.0%" in out
    assert "path 40.0, 45.0, 50.0; CPU floor 20.0, 30.0, 55.0" in out
    assert "rank 0 0: 10.0, 1: 20.0" in out
    assert ("Cannikin's own tracker, chosen splits: median |error| 5.0% over 3 windows, "
            "signed median +3.0%") in out
