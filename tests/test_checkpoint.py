"""Checkpoints: round trip, corrupt files, unsafe payloads refused, previous good kept."""

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from cannikin.runtime.checkpoint import (
    CheckpointError,
    CheckpointManager,
    load_checkpoint,
    save_checkpoint,
)


def sample_state() -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
            "sampler": {"version": 1, "epoch": 2, "position": 17},
            "fits": [(0.5, 1e-3), (0.25, 2e-3)], "noise": np.float64(3.5),
            "history": np.arange(4), "name": "run", "none": None}


def test_round_trip_preserves_values_and_converts_numpy(tmp_path: Path) -> None:
    state = sample_state()
    loaded = load_checkpoint(save_checkpoint(tmp_path / "a.pt", state))
    for key, value in state["model"].items():
        assert torch.equal(loaded["model"][key], value)
    assert loaded["optimizer"]["state"][0]["step"] == state["optimizer"]["state"][0]["step"]
    assert loaded["sampler"] == state["sampler"]
    assert loaded["fits"] == [(0.5, 1e-3), (0.25, 2e-3)]
    assert loaded["noise"] == 3.5 and type(loaded["noise"]) is float
    assert torch.equal(loaded["history"], torch.arange(4))
    assert loaded["name"] == "run" and loaded["none"] is None
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]  # no temp file left behind


def test_objects_are_refused_when_saving(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"state\['opt'\] is a torch.optim.sgd.SGD"):
        save_checkpoint(tmp_path / "a.pt", {"opt": torch.optim.SGD([torch.zeros(1)], lr=0.1)})
    assert not (tmp_path / "a.pt").exists()


@pytest.mark.parametrize("damage", ["truncate", "garbage", "empty"])
def test_damaged_file_gives_error_naming_it(tmp_path: Path, damage: str) -> None:
    path = save_checkpoint(tmp_path / "a.pt", sample_state())
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2], "empty": b"",
                      "garbage": np.random.default_rng(0).bytes(len(data))}[damage])
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is unreadable"):
        load_checkpoint(path)


def test_missing_file_and_foreign_payloads(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint file at"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="is not a Cannikin checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")
    torch.save({"format": "cannikin-checkpoint", "version": 99, "state": {}}, tmp_path / "v.pt")
    with pytest.raises(CheckpointError, match="has version 99; this code reads version 1"):
        load_checkpoint(tmp_path / "v.pt")


class _Exploit:
    """Unpickling this would create a file: the marker proves whether code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (str(self.marker),))


def test_pickled_object_payload_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    path = tmp_path / "evil.pt"
    payload = {"format": "cannikin-checkpoint", "version": 1, "state": {"x": _Exploit(marker)}}
    torch.save(payload, path)
    with pytest.raises(CheckpointError, match=rf"checkpoint {path} is unreadable"):
        load_checkpoint(path)
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is live: an unsafe load runs it
    assert marker.exists()


def test_manager_keeps_last_k_and_falls_back_past_corrupt_newest(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(tmp_path / "run", keep=2)
    assert manager.load_latest() is None
    for step in (10, 20, 30):
        manager.save(step, {"step": step, "w": torch.full((2,), float(step))})
    assert [step for step, _ in manager.checkpoints()] == [20, 30]
    step, state = manager.load_latest()
    assert step == 30 and state["step"] == 30
    newest = manager.path_for(30)
    newest.write_bytes(newest.read_bytes()[:100])  # torn write from outside the atomic path
    with caplog.at_level(logging.WARNING, logger="cannikin.runtime.checkpoint"):
        step, state = manager.load_latest()
    assert step == 20 and torch.equal(state["w"], torch.full((2,), 20.0))
    assert "skipping checkpoint of step 30" in caplog.text and str(newest) in caplog.text
    manager.path_for(20).write_bytes(b"junk")
    assert manager.load_latest() is None


def test_manager_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keep must be >= 1"):
        CheckpointManager(tmp_path, keep=0)
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        CheckpointManager(tmp_path).path_for(-1)
