"""A shortened `cannikin demo` end to end: 3 workers (speeds 1, 2, 4), one epoch of the digits
training split at batch 48, both runs, checked through the --json report and the --plot file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from test_demo_cli import parse

BATCH = 48
DIGITS_TRAIN_SIZE = 1437  # 1797 images, 20% held out (stratified)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict[str, Any], Path]:
    tmp = tmp_path_factory.mktemp("demo")
    args = parse(["--speeds", "1,2,4", "--epochs", "1", "--batch-size", str(BATCH),
                  "--json", str(tmp / "demo.json"), "--plot", str(tmp / "demo.png"),
                  "--out", str(tmp / "out"), "--no-progress", "--timeout", "100"])
    code = args.func(args)
    report = json.loads((tmp / "demo.json").read_text()) if code == 0 else {}
    return code, report, tmp


@pytest.mark.timeout(150)
def test_demo_trains_both_runs_and_reports_them(demo: tuple[int, dict[str, Any], Path]) -> None:
    code, report, tmp = demo
    assert code == 0, (tmp / "out" / "workers.log").read_text()[-3000:]
    for phase in ("even", "cannikin"):
        run = report[phase]
        assert run["throughput"] > 0 and run["mean_step_time_s"] > 0
        assert math.isfinite(run["final_loss"]) and run["final_loss"] < 2.3  # below chance
        assert 0.0 <= run["accuracy"] <= 1.0
        assert len(run["local_batches"]) == 3 and sum(run["local_batches"]) <= BATCH
        assert run["samples"] == DIGITS_TRAIN_SIZE
        err = run["prediction_error_median"]
        assert err is None or err >= 0
        assert run["slowdowns"] == [4.0, 2.0, 1.0] and run["num_threads"] == [1, 1, 1]
        # exactly once: the epoch saw every training sample, none twice
        assert run["samples_seen_per_epoch"] == [DIGITS_TRAIN_SIZE]
        assert run["repeated_samples_per_epoch"] == [0]
    assert report["samples_seen_per_epoch"] == [DIGITS_TRAIN_SIZE]
    assert report["train_size"] == DIGITS_TRAIN_SIZE
    even, can = report["even"]["local_batches"], report["cannikin"]["local_batches"]
    assert max(even) - min(even) <= 1
    assert can[2] > can[0], "the speed-4 worker should get a larger batch than the speed-1"
    assert report["ideal_throughput"] == pytest.approx(
        report["even"]["throughput"] * 7 / 3)
    assert (tmp / "demo.png").read_bytes()[:4] == b"\x89PNG"
