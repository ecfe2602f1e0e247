"""HeteroDataLoader's DataLoader-style options in one process: shuffle=False, a len() that
stays put through an epoch, an epoch that ends without its StopIteration, and loading in
worker processes (num_workers) with the next step prefetched, checked against loading in
this process on the same steps."""

from __future__ import annotations

import logging
import random
from collections import UserDict, namedtuple
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from cannikin.runtime.fetch import concat_batches, make_fetcher, pinned
from cannikin.runtime.loader import HeteroDataLoader, OnePass
from cannikin.runtime.sampler import UnevenSampler

Sample = namedtuple("Sample", ["x", "label", "name"])


class Records(Dataset[dict[str, Any]]):
    """Dict samples with a string, and with ``seq`` a variable-length field (for a padding
    collate)."""

    def __init__(self, seq: bool = False) -> None:
        self.seq = seq

    def __len__(self) -> int:
        return 61

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample: dict[str, Any] = {"x": torch.full((3,), float(i)), "id": i, "name": f"s{i}"}
        if self.seq:
            sample["seq"] = torch.arange(i % 5 + 1)
        return sample


def padded(batch: list[dict[str, Any]]) -> dict[str, Any]:
    """A collate that pads ``seq`` to the batch's longest (chunks would not pad alike)."""
    out = default_collate([{k: v for k, v in s.items() if k != "seq"} for s in batch])
    out["seq"] = torch.nn.utils.rnn.pad_sequence([s["seq"] for s in batch], batch_first=True)
    return out


class Replanning(OnePass):
    """A controller whose split changes between steps (after the loader has prefetched
    the next step with the old one), as a re-plan in the optimizer step does."""

    step = None

    def __init__(self, total: int, world: int) -> None:
        self.total, self.world, self.plans = total, world, 0

    @property
    def total_batch(self) -> int:
        return self.total

    def split_for(self, total: int) -> tuple[int, ...]:
        shares = [1 + (self.plans + r) % 3 for r in range(self.world)]
        split = [total * s // sum(shares) for s in shares]
        split[-1] += total - sum(split)
        return tuple(split)

    def begin_step(self, split: tuple[int, ...]) -> None:
        """Nothing to prepare."""

    def abandon_step(self) -> bool:
        return False

    def end_epoch(self) -> None:
        """Nothing to check."""

    def replan(self, step: int) -> None:
        if step % 2:  # every other step: half the prefetches miss
            self.plans += 1


class ReplanningInPasses(Replanning):
    """:class:`Replanning` whose workers run their shares in passes of at most 3."""

    @property
    def accumulates(self) -> bool:
        return True

    def micro_sizes(self, batch: int) -> tuple[int, ...]:
        count = max(1, -(-batch // 3))
        return tuple(batch // count + (j < batch % count) for j in range(count))


def run_epochs(dataset: Dataset[Any], epochs: int, passes: bool = False,
               **kwargs: Any) -> list[list[Any]]:
    """Every rank's batches of ``epochs`` epochs, with a re-plan between steps."""
    world, per_rank = 2, []
    for rank in range(world):
        loader = HeteroDataLoader(dataset, batch_size=14, seed=3, rank=rank, world_size=world,
                                  **kwargs)
        controller = (ReplanningInPasses if passes else Replanning)(14, world)
        loader.attach(controller, rank, world)
        batches = []
        for _ in range(epochs):
            steps = loader.steps() if passes else ([batch] for batch in loader)
            for step, micro in enumerate(steps):
                batches += list(micro)
                controller.replan(step)
        loader.close()
        per_rank.append(batches)
    return per_rank


@pytest.mark.parametrize("passes", [False, True])
def test_worker_processes_load_the_same_batches_as_this_process(passes: bool) -> None:
    # in passes, each micro-batch is prefetched while the one before it trains
    for dataset, kwargs in ((Records(), {}), (Records(seq=True), {"collate_fn": padded})):
        here = run_epochs(dataset, 2, passes, **kwargs)
        workers = run_epochs(dataset, 2, passes, num_workers=3, **kwargs)
        for rank_here, rank_workers in zip(here, workers, strict=True):
            assert len(rank_here) == len(rank_workers)
            for mine, theirs in zip(rank_here, rank_workers, strict=True):
                assert mine.keys() == theirs.keys() and mine["name"] == theirs["name"]
                for key in mine.keys() - {"name"}:  # seq: padded once, to the batch's longest
                    assert torch.equal(mine[key], theirs[key]), key
        ids = [i for rank in workers for batch in rank for i in batch["id"].tolist()]
        assert sorted(ids) == sorted(list(range(61)) * 2)  # every sample once per epoch


class Augmented(Dataset[dict[str, Any]]):
    """Each sample with a random "augmentation" from torch's, numpy's and Python's RNGs, as
    a transform draws them in ``__getitem__``."""

    def __len__(self) -> int:
        return 240

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "torch": torch.rand(()), "numpy": float(np.random.rand()),  # noqa: NPY002
                "python": random.random()}


def test_worker_processes_draw_different_augmentations() -> None:
    """Each loading process seeds torch's, numpy's and Python's RNGs of its own, as
    DataLoader's workers do (base seed from this process's torch RNG, plus the worker's
    number): forked with this process's states, every process drew the same values, so
    half the samples of an epoch were augmented as others."""
    def draws(seed: int) -> dict[str, list[float]]:
        torch.manual_seed(seed)
        loader = HeteroDataLoader(Augmented(), batch_size=60, seed=0, num_workers=3)
        batches = list(loader)
        loader.close()
        return {rng: [float(v) for b in batches for v in b[rng]]
                for rng in ("torch", "numpy", "python")}
    first, other = draws(0), draws(1)
    for rng, values in first.items():
        assert len(set(values)) == len(values) == 240, rng  # no two samples alike
        assert not set(values) & set(other[rng]), rng  # another seed: other draws


def test_a_chunk_draws_its_augmentations_whichever_process_loads_it() -> None:
    """A chunk goes to whichever loading process is free first. Loaded again in the same
    epoch (a resumed run, a rewound step), the same samples draw the same augmentations,
    though each process's generators moved on in between and another may take them; in
    another epoch, other ones. Reference: the first load."""
    torch.manual_seed(0)
    fetcher = make_fetcher(Augmented(), default_collate, num_workers=3, pin_memory=False)
    indices = np.arange(40, 100)
    try:
        first = fetcher.fetch(indices, epoch=2)
        fetcher.fetch(np.arange(0, 40), epoch=2)  # the processes draw on
        again = fetcher.fetch(indices, epoch=2)
        later = fetcher.fetch(indices, epoch=3)
    finally:
        fetcher.close()
    assert first["id"].tolist() == again["id"].tolist() == list(range(40, 100))
    for rng in ("torch", "numpy", "python"):
        assert torch.equal(torch.as_tensor(first[rng]), torch.as_tensor(again[rng])), rng
        assert not set(torch.as_tensor(first[rng]).tolist()) & set(
            torch.as_tensor(later[rng]).tolist()), rng


def test_the_same_seed_loads_the_same_augmented_epochs() -> None:
    """Two runs of a loader with loading processes, the same torch seed: the same samples
    with the same augmentations, step by step, over two epochs (a DataLoader's workers
    draw alike in every run too)."""
    def run() -> list[dict[str, Any]]:
        torch.manual_seed(5)
        loader = HeteroDataLoader(Augmented(), batch_size=60, seed=0, num_workers=3)
        try:
            return [batch for _ in range(2) for batch in loader]
        finally:
            loader.close()
    first, second = run(), run()
    assert len(first) == len(second) == 8
    for one, other in zip(first, second, strict=True):
        for key in ("id", "torch", "numpy", "python"):
            assert torch.equal(torch.as_tensor(one[key]), torch.as_tensor(other[key])), key


class Marked(Dataset[dict[str, Any]]):
    """Each sample with the number its loading process's ``worker_init_fn`` was given."""

    number = -1

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"id": i, "worker": Marked.number}


def _mark(number: int) -> None:
    Marked.number = number


def test_worker_init_fn_runs_in_each_loading_process_with_its_number() -> None:
    loader = HeteroDataLoader(Marked(), batch_size=30, num_workers=3, worker_init_fn=_mark)
    marks = {int(w) for batch in loader for w in batch["worker"]}
    loader.close()
    assert marks and marks <= {0, 1, 2}  # every sample loaded after its process's call
    assert Marked.number == -1  # in those processes, not this one


class Informed(Dataset[dict[str, Any]]):
    """Each sample with what ``get_worker_info()`` says where it was loaded (-1: None)."""

    def __len__(self) -> int:
        return 60

    def __getitem__(self, i: int) -> dict[str, Any]:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return {"id": i, "worker": -1, "workers": -1, "base": -1, "same": False}
        return {"id": i, "worker": info.id, "workers": info.num_workers,
                "base": info.seed - info.id, "same": type(info.dataset) is Informed}


def _seed_numpy(number: int) -> None:
    """The PyTorch documentation's recipe: each process seeds numpy from its worker info."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == number
    np.random.seed(info.seed % 2**32)  # noqa: NPY002


def test_get_worker_info_describes_each_loading_process_as_dataloader_does() -> None:
    """Reference: torch's DataLoader with the same dataset and num_workers, whose worker
    seeds are a base seed plus the worker's number."""
    reference = torch.utils.data.DataLoader(Informed(), batch_size=10, num_workers=2)
    loader = HeteroDataLoader(Informed(), batch_size=30, num_workers=2,
                              worker_init_fn=_seed_numpy)
    for rows in (list(reference), list(loader)):
        workers = {int(w) for batch in rows for w in batch["worker"]}
        assert workers and workers <= {0, 1}
        assert {int(n) for batch in rows for n in batch["workers"]} == {2}
        assert len({int(b) for batch in rows for b in batch["base"]}) == 1
        assert all(bool(same) for batch in rows for same in batch["same"])
    loader.close()
    assert torch.utils.data.get_worker_info() is None  # in those processes, not this one


def test_a_tensor_dataset_says_its_worker_init_fn_is_not_called(
        caplog: pytest.LogCaptureFixture) -> None:
    """A TensorDataset is indexed in this process: the processes DataLoader would start,
    and their worker_init_fn, never run, which the loader says rather than skip silently."""
    data = TensorDataset(torch.arange(12.0))
    with caplog.at_level(logging.WARNING, logger="cannikin.runtime.fetch"):
        make_fetcher(data, default_collate, num_workers=2, pin_memory=False,
                     worker_init_fn=_mark).close()
        make_fetcher(data, default_collate, num_workers=2, pin_memory=False).close()
    said = [r.getMessage() for r in caplog.records]
    assert said == ["worker_init_fn is not called: a TensorDataset is indexed in this "
                    "process, with no loading processes (num_workers=2 is not used)"]
    assert Marked.number == -1


class Encoding(UserDict[str, Any]):
    """A mapping that is not a dict, as a tokenizer's BatchEncoding."""


def encoded(samples: list[dict[str, Any]]) -> Encoding:
    return Encoding(default_collate([{k: s[k] for k in ("x", "id")} for s in samples]))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_empty_local_batch_keeps_its_mapping_type_and_no_sample(num_workers: int) -> None:
    """A worker with no samples gets an empty batch of the collate's type: a BatchEncoding
    (not a dict) came back whole, one sample of the dataset, and the worker trained on it."""
    fetcher = make_fetcher(Records(), encoded, num_workers=num_workers, pin_memory=False)
    empty = fetcher.fetch(np.array([], dtype=np.int64))
    fetcher.close()
    assert type(empty) is Encoding
    assert empty["x"].shape == (0, 3) and empty["id"].shape == (0,)


def as_samples(samples: list[dict[str, Any]]) -> Sample:
    return default_collate([Sample(s["x"], s["id"], s["name"]) for s in samples])


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_empty_local_batch_keeps_its_named_tuple(num_workers: int) -> None:
    """A collate that gives a named tuple: the idle worker's empty batch is one too (it
    raised, the named tuple built from one iterable)."""
    fetcher = make_fetcher(Records(), as_samples, num_workers=num_workers, pin_memory=False)
    empty = fetcher.fetch(np.array([], dtype=np.int64))
    fetcher.close()
    assert type(empty) is Sample
    assert empty.x.shape == (0, 3) and empty.label.shape == (0,)


def test_chunks_join_into_what_one_collate_gives() -> None:
    samples = [Sample(torch.randn(2, 3), i, f"n{i}") for i in range(7)]
    whole = default_collate(samples)
    joined = concat_batches([default_collate(samples[:3]), default_collate(samples[3:])])
    assert type(joined) is Sample and joined.name == whole.name
    assert torch.equal(joined.x, whole.x) and torch.equal(joined.label, whole.label)


def test_num_workers_is_validated_and_a_tensor_dataset_stays_in_this_process() -> None:
    with pytest.raises(ValueError, match="num_workers must be an integer"):
        HeteroDataLoader(Records(), batch_size=4, num_workers=-1)
    data = TensorDataset(torch.arange(10))
    assert not make_fetcher(data, default_collate, num_workers=2, pin_memory=False).prefetches


def test_a_closed_loader_says_so() -> None:
    loader = HeteroDataLoader(Records(), batch_size=4, num_workers=1)
    next(iter(loader))
    loader.close()
    with pytest.raises(RuntimeError, match="was closed"):
        next(iter(loader))


def test_shuffle_false_keeps_the_dataset_order() -> None:
    data = TensorDataset(torch.arange(23))
    loader = HeteroDataLoader(data, batch_size=5, shuffle=False)
    assert [int(i) for (batch,) in loader for i in batch] == list(range(23))
    state = loader.state_dict()
    with pytest.raises(ValueError, match="shuffle=False but this sampler has shuffle=True"):
        HeteroDataLoader(data, batch_size=5).load_state_dict(state)


def test_peek_is_take_without_advancing() -> None:
    sampler = UnevenSampler(20, seed=1)
    peeked = sampler.peek([3, 4], 1)
    assert sampler.position == 0 and np.array_equal(peeked, sampler.take([3, 4], 1))
    assert sampler.peek([30, 4], 0).size == 0  # more than is left: what take refuses


@pytest.mark.parametrize("drop_last", [False, True])
def test_len_stays_put_through_an_epoch(drop_last: bool) -> None:
    data = TensorDataset(torch.arange(23))
    loader = HeteroDataLoader(data, batch_size=5, drop_last=drop_last)
    expected = 4 if drop_last else 5
    for _ in range(2):
        lengths = [len(loader)]
        for _ in loader:
            lengths.append(len(loader))
        assert lengths == [expected] * (expected + 1)


def test_an_epoch_stopped_after_len_steps_ends_there() -> None:
    # Lightning's fit loop takes len(loader) batches and never asks for the StopIteration:
    # the next iteration must start the next epoch, not yield nothing
    data = TensorDataset(torch.arange(23))
    loader = HeteroDataLoader(data, batch_size=5)
    for epoch in range(3):
        it = iter(loader)
        seen = [int(i) for _ in range(len(loader)) for i in next(it)[0]]
        assert sorted(seen) == list(range(23)) and loader.epoch == epoch


def test_pinned_reaches_every_tensor_that_dataloader_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference: the same walk as torch's DataLoader pin_memory, with page-locking faked
    (this machine has no accelerator): a UserDict (a Hugging Face BatchEncoding), a
    read-only mapping, one that cannot be rebuilt (a dict then, as DataLoader gives), a
    named tuple and a batch with its own ``pin_memory()``."""
    marked: list[torch.Tensor] = []

    def fake_pin(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = self.clone()
        marked.append(out)
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)

    class Custom:
        def __init__(self) -> None:
            self.pinned = False

        def pin_memory(self) -> Custom:
            self.pinned = True
            return self

    class Fixed(Mapping[str, torch.Tensor]):
        def __init__(self, data: dict[str, torch.Tensor], note: str) -> None:
            self.data, self.note = data, note

        def __getitem__(self, key: str) -> torch.Tensor:
            return self.data[key]

        def __iter__(self) -> Iterator[str]:
            return iter(self.data)

        def __len__(self) -> int:
            return len(self.data)

    Pair = namedtuple("Pair", ["x", "y"])
    encoding = UserDict({"input_ids": torch.ones(2, 3), "labels": torch.zeros(2)})
    batch = [encoding, MappingProxyType({"mask": torch.ones(2)}),
             Fixed({"w": torch.ones(3)}, "note"), Pair(torch.ones(1), "tag"), Custom()]
    out = pinned(batch)
    assert type(out[0]) is UserDict and set(out[0]) == {"input_ids", "labels"}
    assert type(out[1]) is MappingProxyType and out[1]["mask"] is marked[2]
    assert type(out[2]) is dict and out[2]["w"] is marked[3]
    assert type(out[3]) is Pair and out[3].y == "tag"
    assert out[4].pinned
    assert len(marked) == 5 and all(any(t is m for m in marked) for t in
                                     (out[0]["input_ids"], out[0]["labels"], out[3].x))
    assert encoding["input_ids"] is not out[0]["input_ids"]  # the batch handed in is kept
