"""The demo's report, metrics files and figure, from synthetic worker output (no processes)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from cannikin.demo.config import DemoConfig
from cannikin.demo.files import read_json, write_json
from cannikin.demo.metrics import JsonlTail, read_jsonl
from cannikin.demo.report import build_report, epoch_coverage, render_table, table_rows
from cannikin.metrics import JsonlSink, json_safe

SPEEDS = (1.0, 2.0, 4.0)


def test_sink_and_tail_deliver_whole_records_only(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    tail = JsonlTail(path)
    assert tail.read_new() == []
    with JsonlSink(path, phase="even") as sink:
        sink.log({"local_batches": (1, 2), "x": float("nan"), "n": np.int64(3)}, step=1)
        with open(path, "a", encoding="utf-8") as raw:
            raw.write('{"half": ')
            raw.flush()
            assert tail.read_new() == [
                {"local_batches": [1, 2], "x": None, "n": 3, "phase": "even", "step": 1}
            ]
            raw.write('1}\n')
    assert tail.read_new() == [{"half": 1}]
    assert tail.read_new() == []
    assert len(read_jsonl(path)) == 2


def test_json_files_are_strict_json(tmp_path: Path) -> None:
    write_json(tmp_path / "r.json", {"e": math.inf, "t": (1, 2.5)})
    assert read_json(tmp_path / "r.json") == {"e": None, "t": [1, 2.5]}
    assert json_safe([np.float32(0.5)]) == [0.5]


def test_epoch_coverage_counts_distinct_and_repeated_samples() -> None:
    ranks = [[[0, 1], [4, 4]], [[2, 3], [0]], [[], []]]
    assert epoch_coverage(ranks) == ([4, 2], [0, 1])


def fake_phase(phase: str, step_s: float, batches: list[int], steps: int) -> tuple[
        dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    total = sum(batches)
    records: list[dict[str, Any]] = []
    for s in range(1, steps + 1):
        predicted = None if s <= 2 else step_s * 1.1
        records.append({"phase": phase, "kind": "plan", "step": s, "local_batches": batches,
                        "total_batch": total, "step_time_s": step_s,
                        "predicted_step_time_s": predicted})
        records.append({"phase": phase, "kind": "train", "step": s, "rank0_loss": 1 / s,
                        "rank0_batch": batches[0], "total_batch": total,
                        "samples": s * total, "wall_s": s * step_s})
    result = {"phase": phase, "steps": steps, "samples": steps * total,
              "wall_s": steps * step_s, "train_size": 30, "test_size": 8,
              "final_loss": 0.2, "test_loss": 0.3, "accuracy": 0.9,
              "local_batches": batches, "prediction_error_median": 0.1,
              "prediction_error_step_median": float("nan")}
    ranks = [{"slowdown": 4 / sp, "num_threads": 1, "epochs": [list(range(r, 30, 3))]}
             for r, sp in enumerate(SPEEDS)]
    return result, records, ranks


@pytest.fixture
def report() -> dict[str, Any]:
    config = DemoConfig(speeds=SPEEDS, steps=10, batch_size=21)
    phases = {"even": fake_phase("even", 0.4, [7, 7, 7], 10),
              "cannikin": fake_phase("cannikin", 0.2, [3, 6, 12], 10)}
    records = phases["even"][1] + phases["cannikin"][1]
    return build_report(config, {p: v[0] for p, v in phases.items()}, records,
                        {p: v[2] for p, v in phases.items()})


def test_report_figures_follow_their_definitions(report: dict[str, Any]) -> None:
    even, can = report["even"], report["cannikin"]
    assert even["throughput"] == pytest.approx(210 / 4.0)
    assert can["throughput"] == pytest.approx(210 / 2.0)
    assert report["speedup"] == pytest.approx(2.0)
    # sum of speeds 7, slowest speed 1, 3 workers: ideal = even * 7 / 3
    assert report["ideal_throughput"] == pytest.approx(even["throughput"] * 7 / 3)
    assert can["mean_step_time_s"] == pytest.approx(0.2)
    assert can["predicted_step_time_s"] == pytest.approx(0.22)
    assert can["measured_step_time_s"] == pytest.approx(0.2)
    assert can["local_batches"] == [3, 6, 12]
    assert report["samples_seen_per_epoch"] == [30]
    assert can["repeated_samples_per_epoch"] == [0]
    assert can["slowdowns"] == [4.0, 2.0, 1.0]
    assert can["prediction_error_step_median"] is None or math.isnan(
        can["prediction_error_step_median"])


def test_table_shows_both_runs_and_the_ideal(report: dict[str, Any]) -> None:
    from rich.console import Console

    rows = {row[0]: row[1:] for row in table_rows(report)}
    assert rows["throughput, samples/s"] == ("52", "105 (2.00x)", "ideal 122")
    assert rows["local batches"][:2] == ("7 7 7", "3 6 12")
    assert rows["predicted/measured ms"][1] == "220.0 / 200.0"
    assert rows["epochs, all samples"][1:] == ("1/1", "30 per epoch")
    assert rows["samples used twice"][:2] == ("0", "0")
    console = Console(record=True, width=140)
    console.print(render_table(report))
    assert "Cannikin" in console.export_text()


def target_report(reached: dict[str, float | None]) -> tuple[dict[str, Any],
                                                              list[dict[str, Any]]]:
    """A --target report of three fake runs, each reaching the target at ``reached``
    seconds (None: never), with its evaluation records."""
    config = DemoConfig(speeds=SPEEDS, steps=10, batch_size=21, target=0.8)
    phases = {"even": fake_phase("even", 0.4, [7, 7, 7], 10),
              "adaptdl": fake_phase("adaptdl", 0.35, [10, 10, 10], 10),
              "cannikin": fake_phase("cannikin", 0.2, [3, 6, 12], 10)}
    records = [r for _, rows, _ in phases.values() for r in rows]
    for phase, seconds in reached.items():
        result = phases[phase][0]
        result.update(mean_batch=result["samples"] / result["steps"],
                      final_batch=sum(result["local_batches"]), target=0.8,
                      time_to_target_s=seconds, steps_to_target=None if seconds is None else 4,
                      samples_to_target=None if seconds is None else 84)
        records += [{"phase": phase, "kind": "eval", "step": s, "accuracy": 0.2 * s,
                     "samples": 21 * s, "train_s": 0.5 * s} for s in range(1, 5)]
    report = build_report(config, {p: v[0] for p, v in phases.items()}, records,
                          {p: v[2] for p, v in phases.items()})
    return report, records


def test_a_target_report_compares_the_times_to_target() -> None:
    report, _ = target_report({"even": 4.0, "adaptdl": 2.5, "cannikin": 1.0})
    assert report["phases"] == ["even", "adaptdl", "cannikin"]
    assert report["time_to_target_vs"] == {"even": pytest.approx(0.25),
                                           "adaptdl": pytest.approx(0.4)}
    assert report["adaptdl"]["mean_batch"] == pytest.approx(30)
    rows = {row[0]: row[1:] for row in table_rows(report)}
    assert rows["time to 80.0%"] == ("4.0 s, 4 steps", "2.5 s, 4 steps", "1.0 s, 4 steps",
                                     "Cannikin: 0.25x DDP (even split), 0.40x AdaptDL-like")
    assert rows["throughput, samples/s"][:3] == ("52", "86 (1.63x)", "105 (2.00x)")
    missed, _ = target_report({"even": None, "adaptdl": 2.5, "cannikin": None})
    assert missed["time_to_target_vs"] == {"even": None, "adaptdl": None}
    assert {row[0]: row[1:] for row in table_rows(missed)}["time to 80.0%"][0] == (
        "not reached")


def test_a_target_plot_writes_a_png(tmp_path: Path) -> None:
    from cannikin.demo.plot import write_plot

    report, records = target_report({"even": 4.0, "adaptdl": None, "cannikin": 1.0})
    write_plot(report, records, tmp_path / "target.png")
    assert (tmp_path / "target.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_a_png(tmp_path: Path, report: dict[str, Any]) -> None:
    from cannikin.demo.plot import write_plot

    records = [*fake_phase("even", 0.4, [7, 7, 7], 30)[1],
               *fake_phase("cannikin", 0.2, [3, 6, 12], 30)[1]]
    write_plot(report, records, tmp_path / "demo.png")
    assert (tmp_path / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
