"""An Accelerate loop with ``CannikinAccelerator``: one torchrun launch (2 gloo workers)
runs tests/workers/accelerate_worker.py; each test asserts on what it reported."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from dist_utils import WORKERS, run_torchrun

pytest.importorskip("accelerate", reason="the accelerate extra is not installed")


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("accelerate")
    out = folder / "figures.json"
    run_torchrun(WORKERS / "accelerate_worker.py", nproc=2, script_args=[str(out), str(folder)],
                 timeout_s=180.0, env={"CANNIKIN_SLOWDOWN": ""}).check()
    result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


def test_prepare_gives_heterodataparallel_and_the_exact_mean_gradient(
        figures: dict[str, Any]) -> None:
    assert figures["is_hdp"] and figures["unwrapped_is_net"]
    assert figures["splits"] == [[5, 27]] * 6  # rank 0 capped at 5 of 32
    assert figures["rel_err"] < 1e-5


def test_what_assumes_even_batches_follows_the_uneven_split(figures: dict[str, Any]) -> None:
    # gather_for_metrics: every rank's rows of the 5/27 step in rank order (Accelerate's own
    # gather aborted in gloo); reduce(mean) of the local mean losses: the step's mean loss
    assert figures["gathered_in_order"]
    assert figures["loss_err"] < 1e-6
    # a rank with no samples (its mean loss NaN) weighs nothing: the step's mean is rank 1's
    # (it was NaN, NaN times a weight of 0)
    idle = figures["idle"]
    assert math.isnan(idle["losses"][0])
    assert idle["reduced"] == pytest.approx(idle["losses"][1], rel=1e-6)
    assert idle["gathered"] == 32  # gather_for_metrics: rank 1's rows, none from rank 0
    # a prepared scheduler steps once per optimizer step (Accelerate's default: once per
    # process, which ended a schedule sized by len(loader) after half of it on 2 ranks)
    assert figures["schedule_steps"] == 6


def test_the_split_follows_the_speeds_and_every_sample_is_used_once(
        figures: dict[str, Any]) -> None:
    speeds = figures["speeds"]  # rank 0 emulated 3x slower than rank 1
    assert all(epoch == list(range(320)) for epoch in speeds["epoch_samples"])
    late = speeds["splits"][-5:]
    assert all(sum(split) == 48 and split[1] > split[0] for split in late), speeds["splits"]


def test_an_out_of_memory_in_backward_redoes_the_step(figures: dict[str, Any]) -> None:
    # rank 1 fails above 15 samples: at 35 of 40 (beside rank 0's cap of 5), 28, 22 and 17;
    # the steps then hold what the caps do
    oom = figures["oom"]
    assert oom["cap"] <= 15 and oom["samples"] == list(range(160))


def test_save_and_load_state_bring_cannikins_state_back(figures: dict[str, Any]) -> None:
    assert figures["saved_step"] == 6 and figures["step_before_load"] == 8
    assert figures["step_after_load"] == 6


def test_what_it_cannot_do_is_refused_by_name(figures: dict[str, Any]) -> None:
    refused = figures["refused"]
    assert "gradient_accumulation_steps=2" in refused["accumulation"]
    assert "0 HeteroDataLoader(s)" in refused["no_loader"]


def test_hook_free_and_allow_idle_reach_the_model(figures: dict[str, Any]) -> None:
    # at the even split a step not measured needs nothing of the comm hook: it runs through
    # the hook-free twin unless hook_free=False; allow_idle decides whether a worker may be
    # planned 0
    options = figures["options"]
    assert options["hook_free=True"]["allow_zero"] is False
    assert options["hook_free=False"]["allow_zero"] is True
    assert sum(options["hook_free=True"]["twin"]) >= 2  # measured steps use the hook
    assert not any(options["hook_free=False"]["twin"])
    assert len(options["hook_free=False"]["twin"]) == 40  # 4 epochs of 320 in steps of 32
