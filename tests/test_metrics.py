"""The shipped metrics sinks: JSON lines and TensorBoard scalars."""

import importlib.util
import json
import math
from pathlib import Path
from typing import Any

import pytest

from cannikin.metrics import JsonlSink, TensorBoardSink

STEP = {"step": 3, "local_batches": [5, 20, 39], "total_batch": 64, "step_time_s": 0.12,
        "predicted_step_time_s": None, "lr_factor": 1.0, "noise_scale": math.nan,
        "measured": False, "fwd_s": None, "bwd_s": None}


def test_jsonl_sink_writes_one_safe_object_per_step(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    with JsonlSink(path, run="cannikin") as sink:
        sink.log(STEP, 3)
        sink.log({**STEP, "step": 4, "local_batches": (6, 20, 38)}, 4)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [3, 4]
    assert records[0]["noise_scale"] is None and records[1]["local_batches"] == [6, 20, 38]
    assert {r["run"] for r in records} == {"cannikin"}


class Writer:
    def __init__(self) -> None:
        self.scalars: dict[str, list[tuple[int, float]]] = {}
        self.flushes = 0

    def add_scalar(self, tag: str, scalar_value: float, global_step: int) -> Any:
        self.scalars.setdefault(tag, []).append((global_step, scalar_value))

    def flush(self) -> None:
        self.flushes += 1


def test_tensorboard_sink_writes_the_step_figures_and_leaves_out_missing_ones() -> None:
    writer = Writer()
    sink = TensorBoardSink(writer, flush_every=2)
    sink.log(STEP, 3)
    sink.log({**STEP, "predicted_step_time_s": 0.11, "noise_scale": 420.0}, 4)
    assert writer.scalars["cannikin/step_time_s"] == [(3, 0.12), (4, 0.12)]
    assert writer.scalars["cannikin/predicted_step_time_s"] == [(4, 0.11)]
    assert writer.scalars["cannikin/noise_scale"] == [(4, 420.0)]
    assert writer.scalars["cannikin/local_batch/rank2"] == [(3, 39.0), (4, 39.0)]
    assert "cannikin/fwd_s" not in writer.scalars and "cannikin/measured" not in writer.scalars
    assert writer.flushes == 1


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is not None,
                    reason="tensorboard is installed here")
def test_tensorboard_sink_names_the_missing_package(tmp_path: Path) -> None:
    with pytest.raises(ImportError, match="pip install tensorboard"):
        TensorBoardSink(tmp_path / "runs")
