"""bench_speed_change's report: how soon the split follows the swap, and the steps after it
against the settled steps before."""

from __future__ import annotations

import pytest

from benchmark_modules import load_benchmark


def _result(back_at: int | None) -> dict[str, object]:
    """400 steps at 40 ms and (350, 130, 0), the swap at 200; after it 60 ms at (0, 420, 60)
    until ``back_at`` (None: never), where the split turns to (0, 130, 350) at 42 ms."""
    periods, splits = [], []
    for step in range(400):
        after = step >= 200
        back = back_at is not None and step >= back_at
        periods.append(0.042 if back else 0.060 if after else 0.040)
        splits.append([0, 130, 350] if back else [0, 420, 60] if after else [350, 130, 0])
    return {"periods": periods, "splits": splits, "before": [350, 130, 0],
            "now": splits[-1], "cores": [0.25, 0.5, 1.0],
            "predicted_s": {"now": 0.041, "mirrored": None},
            "plans": [[0, "start", [160, 160, 160]], [40, "cadence", [350, 130, 0]],
                      [205, "worker 2 drifted from its model", [0, 420, 60]]],
            "blocks": {"Cannikin": [0.042, 0.044], "DDP at its split now": [0.040, 0.040],
                       "DDP at its split before, mirrored": [0.042, 0.042],
                       "DDP even": [0.084, 0.084]}}


@pytest.mark.parametrize("back_at", [230, None])
def test_the_report_says_when_the_split_followed_and_how_close_it_came(
        back_at: int | None, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("bench_speed_change")
    bench._report("default", _result(back_at), change_at=200, window=25)
    out = capsys.readouterr().out
    if back_at is None:
        assert "half its share or more: never" in out
        assert "(the same cluster, ranks reversed): 1.500 (60.0 against 40.0 ms)" in out
    else:
        assert "half its share or more: 30 steps after the swap" in out
        assert "(the same cluster, ranks reversed): 1.050 (42.0 against 40.0 ms)" in out
    assert "205 worker 2 drifted from its model [0, 420, 60]" in out
    assert "40 cadence" not in out  # the cadence's re-plans are not listed
    assert "predicts its split 41.0 ms, the split before mirrored -" in out
    assert "DDP at its split now                    40.0  1.075" in out
    assert "200-224" in out and "<- the quotas swap" in out


def test_a_swap_without_room_for_its_windows_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("bench_speed_change")
    monkeypatch.setattr("sys.argv", ["bench_speed_change.py", "--steps", "300",
                                     "--change-at", "200"])
    with pytest.raises(SystemExit):
        bench.main()
    assert ("--change-at 200 must leave 4 windows (200 steps) before it and after it in "
            "--steps 300") in capsys.readouterr().err
