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


@pytest.mark.timeout(150)
def test_a_target_run_stops_each_phase_at_the_target(tmp_path: Path) -> None:
    """``--target``: three runs on the same samples, each ending at its first evaluation at
    or above the target (the evaluations every ``eval_every`` samples)."""
    args = parse(["--speeds", "1,4", "--epochs", "2", "--batch-size", "32", "--target", "0.5",
                  "--json", str(tmp_path / "t.json"), "--out", str(tmp_path / "out"),
                  "--no-progress", "--timeout", "120"])
    code = args.func(args)
    assert code == 0, (tmp_path / "out" / "workers.log").read_text()[-3000:]
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["phases"] == ["even", "adaptdl", "cannikin"] and report["target"] == 0.5
    evals = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()
             if '"eval"' in line]
    for phase in report["phases"]:
        run = report[phase]
        assert run["time_to_target_s"] is not None, f"{phase} never reached 50%"
        assert 0 < run["time_to_target_s"] <= run["wall_s"]
        assert run["samples_to_target"] == run["samples"] < 2 * DIGITS_TRAIN_SIZE
        assert run["steps_to_target"] == run["steps"]
        mine = [e for e in evals if e["phase"] == phase]
        assert mine[-1]["accuracy"] >= 0.5 > max((e["accuracy"] for e in mine[:-1]),
                                                 default=0.0)
        due = [e["samples"] // 256 for e in mine]  # eval_every: one evaluation each
        assert due[0] >= 1 and all(a < b for a, b in zip(due, due[1:], strict=False))
        assert run["mean_batch"] == pytest.approx(run["samples"] / run["steps"])
    assert report["time_to_target_vs"]["even"] == pytest.approx(
        report["cannikin"]["time_to_target_s"] / report["even"]["time_to_target_s"])


@pytest.mark.timeout(150)
def test_on_the_teacher_task_the_goodput_batch_grows(tmp_path: Path) -> None:
    """``--task teacher``: the noise scale grows as the student trains, and Cannikin's batch
    with it. Beside a process that kept a core busy it first grew at steps 50-79 (six runs
    of 120 steps; 11 of 12 runs of 80 steps grew before their end), once the cautious
    noise scale had passed 320-370, where a larger batch's predicted goodput first beat
    the current one's by 5%."""
    args = parse(["--task", "teacher", "--adaptive-batch", "--steps", "120",
                  "--json", str(tmp_path / "t.json"), "--out", str(tmp_path / "out"),
                  "--no-progress", "--timeout", "120"])
    code = args.func(args)
    assert code == 0, (tmp_path / "out" / "workers.log").read_text()[-3000:]
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["task"] == "teacher" and report["train_size"] == 8192
    plans = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()
             if '"plan"' in line and '"cannikin"' in line]
    batches = [p["total_batch"] for p in plans]
    assert batches[0] == 64 and max(batches) >= 96, batches
    assert report["even"]["mean_batch"] == 64
    assert report["even"]["samples"] == 120 * 64 <= report["cannikin"]["samples"]
