"""Loading a step's samples: in this process, or in worker processes (``num_workers``).

HeteroDataLoader cannot hand a DataLoader its indices ahead of time: each step's split is
planned after the previous step's optimizer step. So :class:`ProcessFetcher` loads the
step in hand in ``num_workers`` chunks at once, and, while the step trains, the next step's
indices *as the plan stands*; if a re-plan changes them, that prefetch is dropped and the
step is loaded when asked for. The prefetch is a cache keyed by the indices themselves,
so it can never change which samples a step gets.

With the default collate function each worker collates its chunk and the chunks are
concatenated (the same batch as collating all samples at once); a custom ``collate_fn``
(one that pads to the longest sample, say) gets all the step's samples in this process.

A chunk goes to whichever process is free first, so a process's random number generators
would draw a chunk's augmentations from wherever its stream stood: another order of
processes, another augmentation, from run to run. Each chunk is loaded from generators
seeded by the base seed, the epoch and the chunk's first sample (each sample is in one
chunk an epoch), as a DataLoader's round-robin workers draw alike in every run: the same
run draws the same augmentations, and a resumed run those of the steps it resumes.
"""

from __future__ import annotations

import copy
import logging
import os
import random
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as torch_mp
from torch.utils.data import Dataset, TensorDataset, default_collate
from torch.utils.data._utils import worker as torch_worker

from cannikin.runtime.batches import map_batched
from cannikin.runtime.sampler import IndexArray

logger = logging.getLogger(__name__)

Batch = Any
Collate = Callable[[list[Any]], Batch]


def _empty_like(sample: Any) -> Any:
    """A zero-length batch with the structure of ``sample`` (for a worker given b_i = 0),
    its containers' types kept: a tokenizer's BatchEncoding was once given back whole, and
    the worker trained on the one sample it was made from; a named tuple raised."""
    return map_batched(sample, lambda t: t[:0])


def _samples(dataset: Dataset[Any], indices: Sequence[int]) -> list[Any]:
    getitems = getattr(dataset, "__getitems__", None)
    return list(getitems(list(indices))) if getitems else [dataset[i] for i in indices]


def concat_batches(parts: Sequence[Batch]) -> Batch:
    """Collated chunks joined into one batch along the sample dimension: tensors
    concatenated, sequences of leaves (strings, say) chained, containers entry by entry."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(list(parts))
    if isinstance(first, tuple) and hasattr(first, "_fields"):
        return type(first)(*(concat_batches(p) for p in zip(*parts, strict=True)))
    if isinstance(first, tuple | list):
        if all(isinstance(item, torch.Tensor | tuple | list | dict) for item in first):
            return type(first)(concat_batches(p) for p in zip(*parts, strict=True))
        # default_collate gives strings (and other leaves) back as the batch's sequence
        return type(first)(item for part in parts for item in part)
    if isinstance(first, dict):
        return type(first)({key: concat_batches([p[key] for p in parts]) for key in first})
    raise TypeError(f"cannot join collated batches of type {type(first).__name__}: pass a "
                    f"collate_fn, whose batches are collated in the main process")


def pinned(batch: Batch) -> Batch:
    """Every tensor of ``batch`` in page-locked memory (a faster copy to the GPU), through
    the containers DataLoader's ``pin_memory`` goes through: named tuples, sequences, any
    mapping (a Hugging Face ``BatchEncoding`` is a ``UserDict``, not a dict: it stayed
    unpinned), and an object with a ``pin_memory()`` method of its own (a custom batch)."""
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, str | bytes):
        return batch
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(pinned(b) for b in batch))
    if isinstance(batch, tuple | list):
        return type(batch)(pinned(b) for b in batch)
    if isinstance(batch, Mapping):
        items = {key: pinned(value) for key, value in batch.items()}
        try:
            if isinstance(batch, MutableMapping):
                clone = copy.copy(batch)  # keeps what its constructor would not take again
                clone.update(items)
                return clone
            rebuild: Callable[[dict[Any, Batch]], Batch] = type(batch)
            return rebuild(items)
        except TypeError:  # a mapping that cannot be rebuilt: a dict, as DataLoader gives
            return items
    if callable(getattr(batch, "pin_memory", None)):
        return batch.pin_memory()
    return batch


class LocalFetcher:
    """Loads in this process (``num_workers=0``)."""

    prefetches = False
    """Whether :meth:`fetch` makes use of the next step's indices."""

    def __init__(self, dataset: Dataset[Any], collate_fn: Collate, pin_memory: bool) -> None:
        self.dataset, self.collate_fn, self.pin_memory = dataset, collate_fn, pin_memory

    def fetch(self, indices: IndexArray, upcoming: IndexArray | None = None,
              epoch: int = 0) -> Batch:
        """The batch of ``indices`` (``upcoming``: the next step's, and ``epoch``, both
        ignored here: this process's generators draw in the step's order)."""
        batch = self._load(indices)
        return pinned(batch) if self.pin_memory else batch

    def _load(self, indices: IndexArray) -> Batch:
        if isinstance(self.dataset, TensorDataset):  # one gather per tensor, no Python list
            index = torch.from_numpy(indices.astype(np.int64, copy=False))
            return tuple(t[index] for t in self.dataset.tensors)
        if indices.size == 0:
            return _empty_like(self.collate_fn([self.dataset[0]]))
        return self.collate_fn(_samples(self.dataset, indices.tolist()))

    def close(self) -> None:
        """Nothing to release."""


_WORKER_STATE: dict[str, Any] = {}
"""Per worker *process*: the dataset and collate function, set once when it starts."""


def _init_worker(dataset: Dataset[Any], collate_fn: Collate | None, base_seed: int,
                 started: Any, num_workers: int,
                 worker_init_fn: Callable[[int], None] | None) -> None:
    """Keep the dataset and collate function, and seed this process's random number
    generators as DataLoader seeds a worker's (``base_seed`` plus its number, counted in
    ``started``), then call ``worker_init_fn`` with the number, as DataLoader does: forked
    with the loader's states, every process drew the same values, and a transform in
    ``__getitem__`` augmented the samples of each chunk as the others'. Within it, and in
    the dataset's code, ``torch.utils.data.get_worker_info()`` describes this process as
    DataLoader's does (its number, ``num_workers``, its seed, the dataset); it was None, so
    code that seeds or shards by it took its single-process path in every process."""
    torch.set_num_threads(1)
    with started.get_lock():
        number = started.value
        started.value += 1
    seed = base_seed + number
    _seed_generators(seed)
    # what DataLoader's worker loop sets, and get_worker_info() returns
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=number, num_workers=num_workers, seed=seed, dataset=dataset)
    _WORKER_STATE.update(dataset=dataset, collate_fn=collate_fn)
    if worker_init_fn is not None:
        worker_init_fn(number)


def _seed_generators(seed: int) -> None:
    """Seed Python's, torch's and numpy's global generators (numpy's is the one a
    transform's ``np.random`` calls draw from)."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(np.random.SeedSequence(seed).generate_state(4))  # noqa: NPY002


def chunk_seed(base_seed: int, epoch: int, first: int) -> int:
    """The seed a chunk is loaded with: of the loader's base seed, the epoch and the
    chunk's first sample (module docstring)."""
    return int(np.random.SeedSequence([base_seed, epoch, first]).generate_state(
        1, dtype=np.uint64)[0])


def _load_chunk(indices: list[int], seed: int) -> Batch:
    """In a worker: the samples of ``indices``, collated there if it was given a collate,
    drawn from generators seeded with ``seed``."""
    _seed_generators(seed)
    samples = _samples(_WORKER_STATE["dataset"], indices)
    collate = _WORKER_STATE["collate_fn"]
    return samples if collate is None else collate(samples)


class ProcessFetcher(LocalFetcher):
    """Loads in ``num_workers`` processes, and prefetches the next step (module docstring)."""

    prefetches = True

    def __init__(self, dataset: Dataset[Any], collate_fn: Collate, pin_memory: bool,
                 num_workers: int, worker_init_fn: Callable[[int], None] | None = None) -> None:
        super().__init__(dataset, collate_fn, pin_memory)
        self.num_workers = num_workers
        self._collate_in_worker = collate_fn is default_collate
        # fork where it exists, as DataLoader does on Linux: the dataset is inherited, not
        # pickled
        method = "fork" if "fork" in torch_mp.get_all_start_methods() else "spawn"
        context = torch_mp.get_context(method)
        # DataLoader's base seed: a draw of this process's torch RNG
        self._base_seed = int(torch.empty((), dtype=torch.int64).random_().item())
        self._pool = ProcessPoolExecutor(
            max_workers=num_workers, mp_context=context, initializer=_init_worker,
            initargs=(dataset, default_collate if self._collate_in_worker else None,
                      self._base_seed, context.Value("i", 0), num_workers, worker_init_fn))
        self._ahead: tuple[int, IndexArray, list[Future[Batch]]] | None = None
        self._closed = False

    def fetch(self, indices: IndexArray, upcoming: IndexArray | None = None,
              epoch: int = 0) -> Batch:
        """The batch of ``indices`` of epoch ``epoch``; then starts loading ``upcoming``
        (the next step's as the plan stands) while this step trains."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == epoch and np.array_equal(ahead[1], indices):
            futures = ahead[2]
        else:
            if ahead is not None:
                for future in ahead[2]:
                    future.cancel()
            futures = self._submit(indices, epoch)
        batch = self._join(indices, [future.result() for future in futures])
        if upcoming is not None and upcoming.size:
            self._ahead = (epoch, upcoming, self._submit(upcoming, epoch))
        return pinned(batch) if self.pin_memory else batch

    def _submit(self, indices: IndexArray, epoch: int) -> list[Future[Batch]]:
        if self._closed:
            raise RuntimeError("this HeteroDataLoader was closed: its loading processes are "
                               "gone; make a new loader to iterate again")
        if indices.size == 0:
            return []
        chunks = np.array_split(indices, min(self.num_workers, indices.size))
        return [self._pool.submit(_load_chunk, chunk.tolist(),
                                  chunk_seed(self._base_seed, epoch, int(chunk[0])))
                for chunk in chunks]

    def _join(self, indices: IndexArray, parts: list[Batch]) -> Batch:
        if not parts:
            return _empty_like(self.collate_fn([self.dataset[0]]))
        if self._collate_in_worker:
            return parts[0] if len(parts) == 1 else concat_batches(parts)
        return self.collate_fn([sample for part in parts for sample in part])

    def close(self) -> None:
        """Stop the worker processes (drops a prefetch in flight)."""
        self._ahead, self._closed = None, True
        self._pool.shutdown(wait=True, cancel_futures=True)


def make_fetcher(dataset: Dataset[Any], collate_fn: Collate, *, num_workers: int,
                 pin_memory: bool,
                 worker_init_fn: Callable[[int], None] | None = None) -> LocalFetcher:
    """The fetcher for these DataLoader-style options (``num_workers`` 0: this process, and
    ``worker_init_fn`` is not called, as with DataLoader)."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or not (
            0 <= num_workers <= (os.cpu_count() or 1) * 4):
        raise ValueError(f"num_workers must be an integer in [0, {(os.cpu_count() or 1) * 4}] "
                         f"(4 per CPU at most), got {num_workers!r}")
    if pin_memory and not torch.cuda.is_available():
        pin_memory = False  # as DataLoader: nothing to pin for without a GPU
    if num_workers and isinstance(dataset, TensorDataset) and worker_init_fn is not None:
        logger.warning("worker_init_fn is not called: a TensorDataset is indexed in this "
                       "process, with no loading processes (num_workers=%d is not used)",
                       num_workers)
    if num_workers == 0 or isinstance(dataset, TensorDataset):
        return LocalFetcher(dataset, collate_fn, pin_memory)
    return ProcessFetcher(dataset, collate_fn, pin_memory, num_workers, worker_init_fn)
