"""save_training / resume_training in one process (a world of 1, real HeteroDataParallel):
everything a job needs survives the round trip, a damaged newest checkpoint falls back to
the previous good one, and bad checkpoints give errors naming the file and the rank."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.runtime.checkpoint import (
    CheckpointError,
    CheckpointManager,
    resume_training,
    save_training,
)
from cannikin.runtime.distributed import destroy_distributed, init_distributed
from cannikin.runtime.loader import HeteroDataLoader
from cannikin.runtime.parallel import HeteroDataParallel


@pytest.fixture(scope="module", autouse=True)
def process_group() -> Iterator[None]:
    init_distributed(env={})
    yield
    destroy_distributed()


def make(seed: int = 0, samples: int = 50) -> tuple[HeteroDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(samples, 4, generator=gen),
                         torch.randint(0, 2, (samples,), generator=gen))
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    loader = HeteroDataLoader(data, batch_size=8, seed=5)
    return HeteroDataParallel(net, optimizer, loader, replan_every=2, warmup_steps=2), optimizer


def train(model: HeteroDataParallel, optimizer: torch.optim.Optimizer, steps: int,
          manager: CheckpointManager | None = None) -> None:
    """``steps`` optimizer steps across epoch ends, checkpointing every 3."""
    while steps:
        for x, y in model.loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if manager is not None and model.step % 3 == 0:
                save_training(manager, model, extra={"note": f"step {model.step}"})
            steps -= 1
            if not steps:
                return


def params(model: HeteroDataParallel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def test_round_trip_restores_everything_and_continues_identically(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep=2)
    model, optimizer = make()
    train(model, optimizer, 9, manager)  # 7 steps per epoch: the checkpoint is mid-epoch 1
    saved = model.training_state_dict()
    rng_after_save = torch.get_rng_state()
    train(model, optimizer, 5)
    reference = params(model)

    fresh, fresh_optimizer = make(seed=1)  # other initial weights: all must be overwritten
    resumed = resume_training(manager, fresh)
    assert resumed is not None and resumed.step == 9 and resumed.world_size == 1
    assert resumed.extra == {"note": "step 9"}
    assert torch.equal(torch.get_rng_state(), rng_after_save)
    state = fresh.training_state_dict()
    assert state["loader"] == saved["loader"] == {**saved["loader"], "epoch": 1, "position": 16}
    assert state["runtime"] == saved["runtime"]  # step, planner models, noise scale, LR scaler
    assert state["runtime"]["planner"]["noise"]["num_updates"] == 0  # world of 1: no estimate
    assert state["runtime"]["planner"]["models"]  # the fitted device models are kept
    assert fresh_optimizer.state_dict()["state"][0]["step"] == 9
    train(fresh, fresh_optimizer, 5)
    assert all(torch.equal(reference[k], v) for k, v in params(fresh).items())
    assert [s for s, _ in manager.checkpoints()] == [6, 9]  # keep=2


def test_damaged_newest_falls_back_to_previous_good_one(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    manager = CheckpointManager(tmp_path, keep=3)
    model, optimizer = make()
    train(model, optimizer, 6, manager)
    newest = manager.path_for(6)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated (e.g. a disk fault)
    fresh, _ = make()
    resumed = resume_training(manager, fresh)
    assert resumed is not None and resumed.step == 3 and fresh.step == 3
    assert "skipping checkpoint of step 6" in caplog.text and str(newest) in caplog.text
    assert manager.path_for(3).is_file() and newest.is_file()  # nothing good was deleted


def test_no_checkpoint_means_a_fresh_start(tmp_path: Path) -> None:
    model, _ = make()
    assert resume_training(CheckpointManager(tmp_path / "none"), model) is None
    assert model.step == 0


def test_a_foreign_checkpoint_is_refused_naming_file_and_rank(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    manager.save(4, {"weights": torch.zeros(2)})
    model, _ = make()
    with pytest.raises(CheckpointError, match=r"failed on rank 0: .*checkpoint-000000004\.pt "
                                              r"is not a training checkpoint"):
        resume_training(manager, model)


def test_a_checkpoint_of_another_dataset_is_refused(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    model, optimizer = make()
    train(model, optimizer, 3, manager)
    other, _ = make(samples=60)
    with pytest.raises(CheckpointError, match="num_samples is 50 but this sampler's is 60"):
        resume_training(manager, other)


def test_failed_write_raises_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path)
    model, optimizer = make()
    train(model, optimizer, 3, manager)
    manager.path_for(6).mkdir()  # the target cannot be replaced by a file
    with pytest.raises(CheckpointError, match="saving checkpoint .*checkpoint-000000006.pt "
                                              "failed on rank 0: could not write"):
        train(model, optimizer, 3, manager)
    fresh, _ = make()
    resumed = resume_training(manager, fresh)
    assert resumed is not None and resumed.step == 3
