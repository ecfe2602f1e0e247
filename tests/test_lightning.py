"""``Trainer(strategy=CannikinStrategy())``: one torchrun launch (2 gloo workers) runs
tests/workers/lightning_worker.py; each test asserts on what it reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dist_utils import WORKERS, run_torchrun

pytest.importorskip("lightning", reason="the lightning extra is not installed")


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("lightning")
    out = folder / "figures.json"
    run_torchrun(WORKERS / "lightning_worker.py", nproc=2, script_args=[str(out), str(folder)],
                 timeout_s=240.0, env={"CANNIKIN_SLOWDOWN": ""}).check()
    result: dict[str, Any] = json.loads(Path(out).read_text())
    return result


def test_the_gradient_is_the_mean_over_the_uneven_split(figures: dict[str, Any]) -> None:
    got = figures["gradient"]
    assert got["splits"] == [[5, 27]] * 6  # rank 0 capped at 5 of 32
    assert got["rel_err"] < 1e-5 and got["steps"] == 6
    assert got["samples"] == got["distinct"] == 6 * 32
    # self.log(loss, on_step=True, sync_dist=True): the step's mean loss, not the ranks'
    # unweighted average of their means
    assert got["logged_loss_err"] < 1e-5


def test_steps_are_measured_after_the_closure(figures: dict[str, Any]) -> None:
    # Lightning runs the backward inside optimizer.step(closure); the strategy runs the
    # closure first, so the measured backward is the real one (it read 0 s before)
    timings = figures["gradient"]["timings"]
    assert timings
    for step_s, fwd_s, bwd_s in timings:
        assert fwd_s > 0 and bwd_s > 0 and fwd_s + bwd_s <= step_s, timings


def test_the_planned_split_follows_the_speeds(figures: dict[str, Any]) -> None:
    got = figures["optimal"]  # emulated slowdowns 3 and 1, total batch 48 up to 96
    assert got["max_batch"] == 96
    assert all(48 <= sum(s) <= 96 for s in got["splits"])
    # every plan the model chose (not the start, nor a probe or trial of a worker) gives
    # the fast worker more; a probe may take an interval of the 16 steps off that
    chosen = [split for _, reason, split in got["plans"] if reason == "cadence"]
    assert chosen and all(b1 > b0 for b0, b1 in chosen), got["plans"]
    assert [s for s in got["splits"] if s[1] > s[0]], got["splits"]


def test_a_checkpoint_carries_cannikins_state_and_resumes(figures: dict[str, Any]) -> None:
    got = figures["resume"]
    assert got["saved_step"] == 5 and got["saved_position"] == 5 * 32
    assert got["steps_after"] == 2 and got["step_at_end"] == 7


def test_unsupported_lightning_features_are_refused_by_name(figures: dict[str, Any]) -> None:
    refused = figures["refused"]
    assert "automatic optimization only" in refused["manual"]
    assert "accumulate_grad_batches=2" in refused["accumulate"]
    assert "manual optimization" in refused["two_optimizers"]  # Lightning's own refusal


def test_mixed_precision_trains_and_measures(figures: dict[str, Any]) -> None:
    got = figures["bf16"]  # Lightning's MixedPrecision plugin, bf16 autocast on CPU
    assert got["steps"] == 8 and got["finite"]
    assert got["bwd_s"] and all(b > 0 for b in got["bwd_s"])
