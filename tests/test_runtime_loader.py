"""HeteroDataLoader in one process: every rank's view is built with the same controller,
so exactly-once coverage is checked without spawning ranks."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset, TensorDataset

from cannikin.runtime.loader import HeteroDataLoader, OnePass


class Scripted(OnePass):
    """A controller that changes the split every step (as re-planning does)."""

    def __init__(self, totals: list[int], world: int) -> None:
        self.totals, self.world = totals, world
        self.begun: list[tuple[int, ...]] = []
        self.peeked = False  # the last step handed out never reached an optimizer step
        self.step = 0  # optimizer steps: a test that trains counts them

    @property
    def total_batch(self) -> int:
        return self.totals[len(self.begun) % len(self.totals)]

    def split_for(self, total: int) -> tuple[int, ...]:
        # skewed, with an empty worker every third step
        shares = [(len(self.begun) + r) % 3 for r in range(self.world)]
        if sum(shares) == 0:
            shares[0] = 1
        split = [total * s // sum(shares) for s in shares]
        split[-1] += total - sum(split)
        return tuple(split)

    def begin_step(self, split: tuple[int, ...]) -> None:
        self.begun.append(split)

    def abandon_step(self) -> bool:
        peeked, self.peeked = self.peeked, False
        return peeked

    def end_epoch(self) -> None:
        """Nothing to check."""


class Pairs(Dataset[tuple[torch.Tensor, int]]):
    """A map-style dataset without batched access (the generic collate path)."""

    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(i)), i


def epoch_indices(dataset: Dataset, world: int, totals: list[int], **kw: object) -> list[int]:
    seen: list[int] = []
    for rank in range(world):
        loader = HeteroDataLoader(dataset, batch_size=totals[0], seed=5, rank=rank,
                                  world_size=world, **kw)  # type: ignore[arg-type]
        loader.attach(Scripted(totals, world), rank, world)
        for batch in loader:
            ids = batch[2] if len(batch) == 3 else batch[1]
            seen += [int(i) for i in ids]
        assert loader.epoch == 1
    return seen


def test_every_index_once_per_epoch_under_changing_splits() -> None:
    data = TensorDataset(torch.randn(103, 3), torch.zeros(103), torch.arange(103))
    seen = epoch_indices(data, 3, [10, 17, 4])
    assert sorted(seen) == list(range(103))  # the final partial batch is split too
    assert sorted(epoch_indices(Pairs(), 4, [9, 2])) == list(range(50))


def test_drop_last_skips_only_the_final_partial_batch() -> None:
    data = TensorDataset(torch.randn(103, 3), torch.zeros(103), torch.arange(103))
    seen = epoch_indices(data, 2, [10], drop_last=True)
    assert len(seen) == 100 and len(set(seen)) == 100


def test_empty_local_batch_keeps_the_structure() -> None:
    loader = HeteroDataLoader(Pairs(), batch_size=8, rank=0, world_size=2)
    loader.attach(Scripted([8], 2), 0, 2)  # step 0 gives rank 0 a share of 0
    x, ids = next(iter(loader))
    assert x.shape == (0, 2) and ids.shape == (0,)


def test_rewind_gives_the_same_samples_again_and_state_resumes() -> None:
    data = TensorDataset(torch.arange(40).float(), torch.arange(40))
    loader = HeteroDataLoader(data, batch_size=8)
    it = iter(loader)
    first = next(it)[1].tolist()
    loader.rewind()
    assert next(it)[1].tolist() == first
    state = loader.state_dict()
    rest = [b[1].tolist() for b in it]
    again = HeteroDataLoader(data, batch_size=8)
    again.load_state_dict(state)
    assert [b[1].tolist() for b in again] == rest


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"batch_size": 0}, "batch_size must be an integer >= 1"),
    ({"batch_size": 64, "drop_last": True}, "smaller than one batch"),
])
def test_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HeteroDataLoader(Pairs(), **kwargs)  # type: ignore[arg-type]


def test_autoscale_bounds_are_validated() -> None:
    loader = HeteroDataLoader(Pairs(), batch_size=8)
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= batch_size"):
        loader.autoscale_batch_size(4)
    with pytest.raises(ValueError, match="local_bsz_bounds"):
        loader.autoscale_batch_size(32, local_bsz_bounds=(5, 2))
    loader.autoscale_batch_size(32, local_bsz_bounds=(2, 16))
    assert loader.autoscale is not None and loader.autoscale.max_batch_size == 32



def test_an_iterable_dataset_is_refused_by_name() -> None:
    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield from range(10)

    with pytest.raises(TypeError, match="map-style dataset.*IterableDataset Stream"):
        HeteroDataLoader(Stream(), batch_size=4)


def test_a_peeked_batch_comes_again() -> None:
    data = TensorDataset(torch.arange(30))
    loader = HeteroDataLoader(data, batch_size=7, rank=0, world_size=1)
    controller = Scripted([7], 1)
    loader.attach(controller, 0, 1)
    peek = next(iter(loader))[0].tolist()
    controller.peeked = True  # the peek's step never reached an optimizer step
    seen = [i for (batch,) in loader for i in batch.tolist()]
    assert sorted(seen) == list(range(30)) and seen[:len(peek)] == peek


def _loop_with_an_inner_loop(loader: HeteroDataLoader, controller: Scripted | None,
                             inner_steps: int, trains: bool) -> list[int]:
    """An epoch over ``loader`` (each step trained: the controller counts it) with another
    loop over the same loader after its second step, of up to ``inner_steps`` steps (an
    evaluation, or a loop that ``trains`` too); the samples the outer loop got."""
    seen: list[int] = []
    for step, (batch,) in enumerate(loader):
        seen += batch.tolist()
        if controller is not None:
            controller.step += 1
        if step == 1:
            for inner, _ in enumerate(loader):
                if trains and controller is not None:
                    controller.step += 1
                if inner + 1 == inner_steps:
                    break
    return seen


@pytest.mark.parametrize("inner_steps", [1, 2, 100])
def test_an_evaluation_inside_the_loop_takes_no_sample_of_its_epoch(inner_steps: int) -> None:
    """As with a DataLoader, whose iterators are independent: the training loop's epoch
    keeps all of its samples, also where the evaluation ran to the epoch's end."""
    loader = HeteroDataLoader(TensorDataset(torch.arange(30)), batch_size=7, rank=0,
                              world_size=1)
    controller = Scripted([7], 1)
    loader.attach(controller, 0, 1)
    for epoch in range(2):
        seen = _loop_with_an_inner_loop(loader, controller, inner_steps, trains=False)
        assert sorted(seen) == list(range(30)), (epoch, seen)
        assert loader.epoch == epoch + 1


def test_a_loop_inside_the_loop_that_trains_or_is_not_watched_is_refused() -> None:
    loader = HeteroDataLoader(TensorDataset(torch.arange(30)), batch_size=7, rank=0,
                              world_size=1)
    loader.attach(Scripted([7], 1), 0, 1)
    controller = loader.controller
    assert isinstance(controller, Scripted)
    with pytest.raises(RuntimeError, match="trained 2 steps on this epoch's samples"):
        _loop_with_an_inner_loop(loader, controller, 2, trains=True)
    plain = HeteroDataLoader(TensorDataset(torch.arange(30)), batch_size=7, rank=0,
                             world_size=1)
    with pytest.raises(RuntimeError, match="without HeteroDataParallel watching its steps"):
        _loop_with_an_inner_loop(plain, None, 1, trains=False)


class InPasses(Scripted):
    """A controller whose workers run their shares in passes of at most ``cap``."""

    def __init__(self, totals: list[int], world: int, cap: int) -> None:
        super().__init__(totals, world)
        self.cap = cap
        self.passes: list[int] = []

    @property
    def accumulates(self) -> bool:
        return True

    def micro_sizes(self, batch: int) -> tuple[int, ...]:
        count = max(1, -(-batch // self.cap))
        return tuple(batch // count + (j < batch % count) for j in range(count))

    def begin_pass(self, index: int) -> None:
        self.passes.append(index)


def test_steps_yield_each_ranks_passes_and_refuse_the_one_pass_loop() -> None:
    data = TensorDataset(torch.arange(103))
    for rank in range(3):
        loader = HeteroDataLoader(data, batch_size=17, seed=1, rank=rank, world_size=3)
        controller = InPasses([17, 10], 3, cap=4)
        loader.attach(controller, rank, 3)
        with pytest.raises(RuntimeError, match=r"loader\.steps\(\)"):
            next(iter(loader))
        steps = 0
        for step in loader.steps():
            sizes = [len(batch) for (batch,) in step]
            local = controller.begun[-1][rank]
            assert sizes == list(controller.micro_sizes(local)) and max(sizes) <= 4
            assert controller.passes[-len(sizes):] == list(range(len(sizes)))
            steps += 1
        assert steps == len(controller.begun) and loader.epoch == 1


def test_steps_use_every_index_once() -> None:
    data = TensorDataset(torch.arange(103))
    seen: list[int] = []
    for rank in range(3):
        loader = HeteroDataLoader(data, batch_size=17, seed=1, rank=rank, world_size=3)
        loader.attach(InPasses([17, 10], 3, cap=4), rank, 3)
        seen += [int(i) for step in loader.steps() for (batch,) in step for i in batch]
    assert sorted(seen) == list(range(103))


class Settable(OnePass):
    """A controller whose total batch the test sets (as a goodput re-plan does), split
    evenly."""

    step = None

    def __init__(self, total: int, world: int) -> None:
        self.total, self.world = total, world

    @property
    def total_batch(self) -> int:
        return self.total

    def split_for(self, total: int) -> tuple[int, ...]:
        return tuple(total // self.world + (r < total % self.world) for r in range(self.world))

    def begin_step(self, split: tuple[int, ...]) -> None:
        """Nothing to prepare."""

    def abandon_step(self) -> bool:
        return False

    def end_epoch(self) -> None:
        """Nothing to check."""


def test_len_counts_the_steps_taken_at_another_total_batch() -> None:
    # 240 samples at 32: 8 steps; after 3 (96 samples) the total becomes 64, so the epoch
    # is 3 + 3 steps (64, 64, 16), not ceil(96 / 64) + 3 = 5 (Lightning stops after len())
    loader = HeteroDataLoader(TensorDataset(torch.arange(240)), batch_size=32, rank=0,
                              world_size=2)
    controller = Settable(32, 2)
    loader.attach(controller, 0, 2)
    steps = iter(loader)
    for _ in range(3):
        next(steps)
    assert len(loader) == loader.epoch_steps == 8
    controller.total = 64
    assert len(loader) == loader.epoch_steps == 6
    assert loader.step_split == (16, 16)
    state = loader.state_dict()
    for _ in range(3):
        next(steps)
    # the epoch has no step left: len() counts the next one, epoch_steps this one
    assert loader.epoch_steps == 6 and len(loader) == 4
    again = HeteroDataLoader(TensorDataset(torch.arange(240)), batch_size=32, rank=0,
                             world_size=2)
    again.attach(Settable(64, 2), 0, 2)
    again.load_state_dict(state)
    assert state["steps"] == 3 and again.epoch_steps == 6
    older = {k: v for k, v in state.items() if k != "steps"}  # a state saved before steps
    again.load_state_dict(older)
    assert again.epoch_steps == 2 + 3  # estimated at the current total
    with pytest.raises(ValueError, match="steps must be an integer >= 0, got -1"):
        again.load_state_dict({**state, "steps": -1})


def test_rewind_gives_back_the_step_count_too() -> None:
    loader = HeteroDataLoader(TensorDataset(torch.arange(40)), batch_size=10, rank=0,
                              world_size=1)
    steps = iter(loader)
    next(steps)
    next(steps)
    loader.rewind()
    assert loader.epoch_steps == 4 and loader.state_dict()["steps"] == 1
    assert loader.sampler.position == 10
