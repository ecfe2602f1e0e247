"""HeteroDataLoader: each step, this rank's uneven share of the next B samples.

Index logic lives in :class:`~cannikin.runtime.sampler.UnevenSampler` (pure, tested
in one process); this class asks its controller (the :class:`HeteroDataParallel`
it is attached to) for the current total batch and split right before taking each
step's indices, and fetches the samples itself with no prefetching, so a batch is
never drawn with a stale plan. The final partial batch of an epoch is re-planned for
the remainder (or dropped with ``drop_last=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from cannikin.runtime.fetch import make_fetcher
from cannikin.runtime.sampler import IndexArray, UnevenSampler

Batch = Any


class StepController(Protocol):
    """What the loader needs from the runtime each step."""

    @property
    def total_batch(self) -> int: ...

    def split_for(self, total: int) -> tuple[int, ...]: ...

    def begin_step(self, split: tuple[int, ...]) -> None: ...

    @property
    def accumulates(self) -> bool:
        """Whether a step may take several passes (then only :meth:`HeteroDataLoader.steps`
        can iterate it)."""
        ...

    def micro_sizes(self, batch: int) -> tuple[int, ...]:
        """This rank's passes of a local batch of ``batch`` samples."""
        ...

    def begin_pass(self, index: int) -> None:
        """Pass ``index`` of the step handed out is about to be loaded."""
        ...

    def abandon_step(self) -> bool:
        """Forget a step handed out that never reached its optimizer step; whether there
        was one."""
        ...

    def end_epoch(self) -> None:
        """The iteration handed out its epoch's last step, and the loop asks for another."""
        ...

    @property
    def step(self) -> int | None:
        """Optimizer steps taken through the loader (None: not watched)."""
        ...


class OnePass:
    """The pass members of a :class:`StepController` whose steps never accumulate."""

    @property
    def accumulates(self) -> bool:
        return False

    def micro_sizes(self, batch: int) -> tuple[int, ...]:
        return (batch,)

    def begin_pass(self, index: int) -> None:
        """Nothing to prepare."""


@dataclass
class _EvenSplit(OnePass):
    """Controller of a loader used without HeteroDataParallel: fixed B, even split."""

    batch_size: int
    world_size: int

    @property
    def total_batch(self) -> int:
        return self.batch_size

    def split_for(self, total: int) -> tuple[int, ...]:
        n = self.world_size
        return tuple(total // n + (1 if i < total % n else 0) for i in range(n))

    def begin_step(self, split: tuple[int, ...]) -> None:
        """Nothing to prepare."""

    def abandon_step(self) -> bool:
        """Without a training step to watch, every step counts as taken."""
        return False

    def end_epoch(self) -> None:
        """Nothing to check."""

    @property
    def step(self) -> int | None:
        """Not watched."""
        return None


@dataclass(frozen=True)
class _Paused:
    """Where the loader stood when a newer iteration over it began."""

    state: dict[str, int | bool]
    before_take: dict[str, int | bool] | None
    steps: int | None
    """The controller's optimizer steps then."""


@dataclass
class _Iteration:
    """One ``for`` loop over the loader (or over :meth:`HeteroDataLoader.steps`): None
    while it is the live one, else where it paused."""

    paused: _Paused | None = None


@dataclass(frozen=True, kw_only=True)
class Autoscale:
    """Goodput-adaptive total batch: B in [batch_size, max_batch_size]."""

    max_batch_size: int
    local_bsz_bounds: tuple[int, int | None]


class HeteroDataLoader:
    """Iterates one epoch per ``for`` loop, yielding this rank's local batch of each step.

    Every index of an epoch is used exactly once, whatever the splits and however often
    they change; breaking out of the loop and iterating again resumes the same epoch, and
    an iteration that starts once the epoch has no step left starts the next one (a loop
    that stops after ``len(loader)`` steps without exhausting the iterator, as Lightning's
    does). A loop that goes on after another loop over the loader ran inside it (an
    evaluation over the training loader) goes on where it was: the other's samples come
    again, unless it trained on them (refused). ``batch_size`` is the total over all
    workers. ``shuffle=False`` keeps the dataset's order (each step's samples are then
    the ones DistributedSampler with ``shuffle=False`` gives the ranks together).
    ``num_workers`` processes load the samples, the next step's while this one trains
    (:mod:`cannikin.runtime.fetch`; a TensorDataset is always indexed in this process);
    ``pin_memory`` and ``worker_init_fn`` (called with the process's number in each, after
    it is seeded as a DataLoader worker is, ``get_worker_info()`` set) as DataLoader's;
    each chunk of a step is loaded from the global generators seeded by the epoch and its
    first sample, so that the same run draws the same augmentations whichever process
    takes which chunk (a generator of the dataset's own is not reseeded).
    ``rank`` and ``world_size`` each default to the default process group's (or 0 and 1
    without one); HeteroDataParallel sets them when it attaches.
    """

    def __init__(self, dataset: Dataset[Any], batch_size: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False,
                 collate_fn: Callable[[list[Any]], Batch] | None = None, num_workers: int = 0,
                 pin_memory: bool = False,
                 worker_init_fn: Callable[[int], None] | None = None, rank: int | None = None,
                 world_size: int | None = None) -> None:
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(dataset, IterableDataset):
            raise TypeError(f"HeteroDataLoader needs a map-style dataset (it draws each step's "
                            f"samples by index, so that every sample is used once per epoch "
                            f"whatever the split), got the IterableDataset "
                            f"{type(dataset).__name__}: give it a Dataset with __getitem__ "
                            f"and __len__")
        size = len(dataset)  # type: ignore[arg-type]
        if size < batch_size:
            raise ValueError(f"dataset of {size} samples is smaller than one batch "
                             f"(batch_size={batch_size}): use batch_size <= {size}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn or default_collate
        self.sampler = UnevenSampler(size, seed=seed, drop_last=drop_last, shuffle=shuffle)
        self.fetcher = make_fetcher(dataset, self.collate_fn, num_workers=num_workers,
                                    worker_init_fn=worker_init_fn,
                                    pin_memory=pin_memory)
        initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
        if world_size is None:
            world_size = torch.distributed.get_world_size() if initialized else 1
        if rank is None:
            rank = torch.distributed.get_rank() if initialized else 0
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not a worker of a world of {world_size}: "
                             f"expected 0 <= rank < {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.autoscale: Autoscale | None = None
        self.controller: StepController = _EvenSplit(batch_size, world_size)
        self.step_split: tuple[int, ...] | None = None
        """Every rank's local batch of the step last handed out."""
        self._taken = 0
        """Steps handed out in the epoch in progress (meaningful while its position is > 0:
        ``set_epoch`` may start another behind the loader's back)."""
        self._before_take: dict[str, int | bool] | None = None
        self._live: _Iteration | None = None
        """The iteration whose steps the loader hands out (None: none under way)."""

    # -- configuration -----------------------------------------------------------------------------
    def autoscale_batch_size(self, max_batch_size: int,
                             local_bsz_bounds: tuple[int, int | None] | None = None) -> None:
        """Let the total batch grow from ``batch_size`` up to ``max_batch_size`` by goodput.

        ``local_bsz_bounds=(lo, hi)`` bounds every worker's local batch (hi None: no bound).
        Without this call the total stays ``batch_size`` and only the split adapts.
        Call it before wrapping the model in HeteroDataParallel.
        """
        if not isinstance(self.controller, _EvenSplit):
            raise RuntimeError("autoscale_batch_size() must be called before the model is "
                               "wrapped in HeteroDataParallel, which reads the bounds once")
        if not isinstance(max_batch_size, int) or max_batch_size < self.batch_size:
            raise ValueError(f"max_batch_size must be an integer >= batch_size "
                             f"({self.batch_size}), got {max_batch_size!r}")
        lo, hi = local_bsz_bounds if local_bsz_bounds is not None else (1, None)
        if not isinstance(lo, int) or lo < 1 or (hi is not None and (
                not isinstance(hi, int) or hi < lo)):
            raise ValueError(f"local_bsz_bounds must be (lo, hi) with 1 <= lo <= hi (hi may be "
                             f"None), got {local_bsz_bounds!r}")
        self.autoscale = Autoscale(max_batch_size=max_batch_size, local_bsz_bounds=(lo, hi))

    def attach(self, controller: StepController, rank: int, world_size: int) -> None:
        """Called by HeteroDataParallel: it plans the steps of this loader from now on."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.controller, self.rank, self.world_size = controller, rank, world_size

    # -- iteration ---------------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        """Steps in this epoch at the current total batch, as DataLoader's: the same number
        throughout a fixed-batch epoch (:attr:`epoch_steps`, the steps taken and those left
        at the current total once the batch adapts). Once the epoch has no step left it
        counts the next, which a loop asks for before its next epoch's first step."""
        sampler = self.sampler
        if sampler.next_total(self.controller.total_batch) == 0:
            return self._steps_in(sampler.num_samples)
        return self.epoch_steps

    @property
    def epoch_steps(self) -> int:
        """Steps of the epoch in progress: those handed out and those left at the current
        total batch (its last one included once taken). A loop that counts its batches
        (Lightning's) must follow it when the total batch changes: the steps taken at
        another total are counted as they were, not re-divided."""
        taken = self._taken if self.sampler.position > 0 else 0
        return taken + self._steps_in(self.sampler.remaining())

    def _steps_in(self, samples: int) -> int:
        """Steps that ``samples`` samples make at the current total batch."""
        total = self.controller.total_batch
        return samples // total if self.sampler.drop_last else -(-samples // total)

    def set_epoch(self, epoch: int) -> None:
        """DistributedSampler's ``set_epoch`` (see :meth:`UnevenSampler.set_epoch`)."""
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Batch]:
        """This rank's local batch of each step, in one pass (see :meth:`steps` for a model
        that accumulates gradients over several)."""
        if self.controller.accumulates:
            raise RuntimeError(
                "this loader's model accumulates gradients (max_micro_batches > 1), so a "
                "step may take several micro-batches on this rank: iterate "
                "`for step in loader.steps(): for x, y in step: ...` with the optimizer "
                "step after the inner loop")
        for indices in self._step_indices():
            yield self.fetcher.fetch(indices, self._upcoming() if self.fetcher.prefetches
                                     else None, self.epoch)

    def steps(self) -> Iterator[Iterator[Batch]]:
        """One item per step, the same number on every rank; iterating it yields this
        rank's micro-batches of that step (one unless the model accumulates gradients,
        ``HeteroDataParallel(max_micro_batches=...)``). The loss of each micro-batch is
        its own mean; the gradient after the last one is the mean over the step's total
        batch, as without accumulation. Every micro-batch must go through forward and
        backward before the optimizer step."""
        for indices in self._step_indices():
            yield self._passes(indices)

    def _passes(self, indices: IndexArray) -> Iterator[Batch]:
        sizes = self.controller.micro_sizes(len(indices))
        ends = [sum(sizes[:j + 1]) for j in range(len(sizes))]
        for j, (size, end) in enumerate(zip(sizes, ends, strict=True)):
            self.controller.begin_pass(j)
            upcoming = None
            if self.fetcher.prefetches:
                upcoming = (indices[end:end + sizes[j + 1]] if j + 1 < len(sizes)
                            else self._upcoming(first_pass=True))
            yield self.fetcher.fetch(indices[end - size:end], upcoming, self.epoch)

    def _step_indices(self) -> Iterator[IndexArray]:
        """Each step's indices of this rank, after the step is handed to the controller."""
        # a batch taken by an iteration that was dropped before its optimizer step (a peek:
        # ``next(iter(loader))``) comes again, so no sample of the epoch is lost
        if self.controller.abandon_step() and self._before_take is not None:
            self.rewind()
        if self.sampler.next_total(self.controller.total_batch) == 0:
            self.sampler.new_epoch()  # the last one ended without its StopIteration
        iteration = _Iteration()
        self._take_over(iteration)
        while True:
            self._go_on(iteration)
            total = self.sampler.next_total(self.controller.total_batch)
            if total == 0:
                break
            split = self.controller.split_for(total)
            self._before_take = self.state_dict()
            if self.sampler.position == 0:
                self._taken = 0
            indices = self.sampler.take(split, self.rank)
            self._taken += 1
            self.step_split = tuple(split)
            self.controller.begin_step(tuple(split))
            yield indices
        self.controller.end_epoch()
        self.sampler.new_epoch()
        self._live = None

    def _take_over(self, iteration: _Iteration) -> None:
        """``iteration`` hands out the steps from here; the one that did, if another,
        pauses where the loader stands."""
        if self._live is not None and self._live is not iteration:
            self._live.paused = _Paused(self.state_dict(), self._before_take,
                                        self.controller.step)
        self._live, iteration.paused = iteration, None

    def _go_on(self, iteration: _Iteration) -> None:
        """A loop goes on: where another loop over the loader ran in between (an evaluation
        over the training loader, inside the training loop), the loader goes back to where
        this one paused, so that its epoch loses none of its samples to the other, as
        with a DataLoader, whose iterators are independent. Refused where the other loop
        trained (or no runtime watched whether it did): its steps took those samples."""
        paused = iteration.paused
        if paused is None:
            return
        steps = self.controller.step
        if steps is None or paused.steps is None or steps != paused.steps:
            trained = ("without HeteroDataParallel watching its steps" if steps is None
                       or paused.steps is None else f"and trained {steps - paused.steps} "
                       f"steps on this epoch's samples")
            raise RuntimeError(
                f"rank {self.rank}: a loop over this HeteroDataLoader went on after another "
                f"loop over it ran inside it (a `for` over the same loader), {trained}: the "
                f"samples that loop took are of this loop's epoch, which would skip them. "
                f"Train in one loop over the loader, and evaluate over a loader of its own "
                f"(a torch DataLoader over the same dataset)")
        self._take_over(iteration)
        self.load_state_dict(paused.state)
        self._before_take = paused.before_take

    def _upcoming(self, first_pass: bool = False) -> Any:
        """The next step's indices as the plan stands (None at the end of the epoch); with
        ``first_pass``, those of its first micro-batch."""
        total = self.sampler.next_total(self.controller.total_batch)
        if total == 0:
            return None
        indices = self.sampler.peek(self.controller.split_for(total), self.rank)
        if first_pass:
            indices = indices[:self.controller.micro_sizes(len(indices))[0]]
        return indices

    def close(self) -> None:
        """Stop the loading processes (``num_workers``); the loader cannot load after it."""
        self.fetcher.close()

    def rewind(self) -> None:
        """Give back the last step's samples (its update was skipped): they come again next."""
        if self._before_take is None:
            raise RuntimeError("rewind() before any step was taken")
        self.load_state_dict(self._before_take)
        self._before_take = None

    # -- state -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int | bool]:
        """The epoch, the position in its permutation and the steps it took (plain
        integers)."""
        return {**self.sampler.state_dict(), "steps": self._taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. A state saved without its steps (before they were
        kept) counts the epoch's steps taken at the current total batch."""
        self.sampler.load_state_dict(state)
        steps = state.get("steps")
        if steps is None:
            steps = -(-self.sampler.position // self.controller.total_batch)
        elif isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"loader state steps must be an integer >= 0, got {steps!r}")
        self._taken = steps
