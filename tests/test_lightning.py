"""``Trainer(strategy=CannikinStrategy())``: one torchrun launch (2 gloo workers) runs
tests/workers/lightning_worker.py; each test asserts on what it reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader, Dataset, WeightedRandomSampler

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


def test_the_even_splits_hook_free_steps_give_the_mean_gradient(figures: dict[str, Any]) -> None:
    got = figures["hook_free"]
    assert got["splits"] == [[16, 16]] * 6
    assert sum(got["hook_free"]) >= 2, got["hook_free"]  # Lightning's backward through the twin
    assert got["rel_err"] < 1e-5 and got["logged_loss_err"] < 1e-5


def test_accumulate_grad_batches_is_a_step_of_all_its_samples(figures: dict[str, Any]) -> None:
    got = figures["accumulation"]  # accumulate_grad_batches=3, batch_size=7, 2 ranks, 250
    # DDP's step of 3 x 7 x 2 = 42 samples, split 12/30 by rank 0's cap of 4 per pass
    assert got["splits"] == [[12, 30]] * 5 + [[12, 28]]
    assert got["steps"] == got["global_step"] == 6 and got["batches"] == 18
    rank0, rank1 = got["passes"]
    assert rank0 == [4] * 18 and rank1 == [10] * 15 + [10, 9, 9]
    # the gradient is the mean over each step's 42 (last: 40) samples, Lightning's division
    # of each micro-batch's loss by 3 undone; each micro-batch's logged loss is its mean
    assert got["rel_err"] < 1e-5 and got["logged_loss_err"] < 1e-5
    assert got["samples"] == got["distinct"] == 250


def test_the_trainer_follows_a_total_batch_that_grows(figures: dict[str, Any]) -> None:
    got = figures["growing"]  # 32 -> 64 at the third step: 3 + 3 steps, not 8
    first = [c for c in got["counts"]][:6]
    assert [c["trainer"] for c in first] == [8, 8, 6, 6, 6, 6]
    for count in got["counts"]:
        # Lightning's count, the progress bar's and the loader's for the epoch in progress
        assert count["trainer"] == count["bar"] == count["epoch"], got["counts"]
        if not count["last"]:
            assert count["loader"] == count["trainer"], got["counts"]
    assert [c["last"] for c in got["counts"]] == [False] * 5 + [True] + [False] * 3 + [True]
    # each epoch uses every sample once, and both ended as such: the epoch-interval
    # scheduler halved the LR twice (once: the first epoch ended at a StopIteration)
    assert got["epochs"] == {"0": list(range(240)), "1": list(range(240))}
    assert got["lr"] == pytest.approx(0.1 * 0.25)
    # limit_train_batches=0.5: half the epoch's 6 steps once it has 6, not half of 8
    assert got["limited_steps"] == 3
    assert [c["trainer"] for c in got["limited_counts"]] == [4, 4, 3]


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
    # whatever total batch goodput chose, Lightning counted the loader's steps
    assert all(c["trainer"] == c["epoch"] for c in got["counts"]), got["counts"]


def test_a_checkpoint_carries_cannikins_state_and_resumes(figures: dict[str, Any]) -> None:
    got = figures["resume"]
    assert got["saved_step"] == 5 and got["saved_position"] == 5 * 32
    assert got["steps_after"] == 2 and got["step_at_end"] == 7


def test_unsupported_lightning_features_are_refused_by_name(figures: dict[str, Any]) -> None:
    refused = figures["refused"]
    assert "automatic optimization only" in refused["manual"]
    assert "manual optimization" in refused["two_optimizers"]  # Lightning's own refusal
    assert "accumulate_grad_batches changed from 1 to 2" in refused["accumulation_scheduler"]
    said = refused["max_micro_batches"]
    assert "max_micro_batches=4" in said and "accumulate_grad_batches=k" in said


def test_mixed_precision_trains_and_measures(figures: dict[str, Any]) -> None:
    got = figures["bf16"]  # Lightning's MixedPrecision plugin, bf16 autocast on CPU
    assert got["steps"] == 8 and got["finite"]
    assert got["bwd_s"] and all(b > 0 for b in got["bwd_s"])


def test_an_idle_workers_loss_logged_as_the_readme_says_keeps_the_epoch_mean(
        figures: dict[str, Any]) -> None:
    """Rank 0 pinned at 0 samples, ``self.log(loss.nan_to_num(), on_epoch=True,
    sync_dist=True)``: the epoch's value is the mean over its samples (with the NaN loss
    itself, Lightning's epoch value was NaN on both ranks)."""
    idle = figures["idle"]
    assert idle["idle"] == 7  # every full step of 32 (the last 16 samples are planned anew)
    assert idle["logged"] == pytest.approx(idle["want"], rel=1e-6)


class _Marked(Dataset[int]):
    """Each sample is the number its loading process's worker_init_fn was given."""

    number = -1

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> int:
        return _Marked.number


def _mark(number: int) -> None:
    _Marked.number = number


def test_the_dataloader_becomes_a_hetero_loader_or_is_refused_by_name() -> None:
    """The training DataLoader's worker_init_fn is kept; a sampler the HeteroDataLoader
    cannot keep (weights: Lightning wraps it in a DistributedSampler, which read as a plain
    shuffle, every sample drawn alike, without a word) is refused, naming it."""
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    from cannikin.integrations.lightning import _hetero_loader

    loader = _hetero_loader(DataLoader(_Marked(), batch_size=4, num_workers=2,
                                       worker_init_fn=_mark), replicas=2)
    marks = {int(m) for batch in loader for m in batch}
    loader.close()
    assert marks and marks <= {0, 1}
    weighted = WeightedRandomSampler([1.0] * 16, 16)
    for sampler in (weighted, DistributedSamplerWrapper(weighted, num_replicas=2, rank=0)):
        with pytest.raises(ValueError, match="DataLoader's WeightedRandomSampler"):
            _hetero_loader(DataLoader(_Marked(), batch_size=4, sampler=sampler), replicas=2)
