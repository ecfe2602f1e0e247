"""Exactly-once sampling with uneven, changing local batches (pure numpy, no torch).

Each epoch has one seeded permutation of the dataset indices, the same on every rank. A step
consumes the next ``sum(local_batches)`` indices of it at the shared ``position``; rank ``r``
gets the slice after the first ``r`` workers' shares. Because every rank advances the position
by the same total, every index of an epoch is used exactly once whatever the splits and however
often they (or the number of workers) change. The state is a few plain numbers (seed, epoch,
position, dataset size, ``drop_last``, a version), so a checkpoint resumes exactly where
training stopped.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

STATE_VERSION = 1
"""Version of :meth:`UnevenSampler.state_dict`; bumped when its meaning changes."""

IndexArray = npt.NDArray[np.int64]


def epoch_permutation(seed: int, epoch: int, num_samples: int) -> IndexArray:
    """The order of the dataset indices in ``epoch``: identical on every rank and platform."""
    _check_int("seed", seed, minimum=0)
    _check_int("epoch", epoch, minimum=0)
    _check_int("num_samples", num_samples, minimum=1)
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_samples).astype(np.int64)


def split_slices(position: int, local_batches: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` of each rank's share of the permutation for a step at ``position``."""
    bounds = list(accumulate((int(b) for b in local_batches), initial=position))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _check_int(name: str, value: object, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class UnevenSampler:
    """One rank's view of the epoch permutation, shared position, uneven shares.

    Every rank holds its own sampler with the same ``num_samples`` and ``seed`` and calls
    :meth:`take` with the same ``local_batches`` each step; they stay in lock-step without
    communicating. ``drop_last`` only changes :meth:`next_total`: the final partial batch of an
    epoch is skipped instead of being split.
    """

    def __init__(self, num_samples: int, seed: int = 0, drop_last: bool = False,
                 shuffle: bool = True) -> None:
        self.num_samples = _check_int("num_samples", num_samples, minimum=1)
        self.seed = _check_int("seed", seed, minimum=0)
        self.drop_last = bool(drop_last)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.position = 0
        self._permutation: IndexArray | None = None

    def permutation(self) -> IndexArray:
        """This epoch's permutation (computed once per epoch); the dataset's own order
        without ``shuffle``."""
        if self._permutation is None:
            self._permutation = (
                epoch_permutation(self.seed, self.epoch, self.num_samples) if self.shuffle
                else np.arange(self.num_samples, dtype=np.int64))
        return self._permutation

    def remaining(self) -> int:
        """Samples of this epoch not yet handed out."""
        return self.num_samples - self.position

    def next_total(self, total_batch: int) -> int:
        """Total batch of the next step for a requested ``total_batch``; 0 when the epoch is over.

        ``min(total_batch, remaining())``, except that with ``drop_last`` a final batch smaller
        than ``total_batch`` counts as over. Plan the split for this total, not for B.
        """
        _check_int("total_batch", total_batch, minimum=1)
        left = self.remaining()
        if self.drop_last and left < total_batch:
            return 0
        return min(total_batch, left)

    def take(self, local_batches: Sequence[int], rank: int) -> IndexArray:
        """This rank's indices of the next ``sum(local_batches)`` samples; advances the position.

        ``local_batches[i]`` is rank i's share (0 is allowed); the sum must be between 1 and
        :meth:`remaining`. For the last, partial batch of an epoch re-plan for the remainder.
        """
        batches = [_check_int(f"local_batches[{i}]", b, minimum=0)
                   for i, b in enumerate(local_batches)]
        if not batches:
            raise ValueError("local_batches must name at least one worker, got []")
        if not 0 <= rank < len(batches):
            raise ValueError(f"rank must be in [0, {len(batches)}), got {rank}")
        total = sum(batches)
        if total < 1:
            raise ValueError(f"local_batches must sum to at least 1, got {batches}")
        if self.remaining() == 0:
            raise ValueError(f"epoch {self.epoch} is over; call new_epoch() before take()")
        if total > self.remaining():
            raise ValueError(
                f"local_batches {batches} sum to {total} but only {self.remaining()} samples "
                f"are left in epoch {self.epoch}; split min(B, remaining) = "
                f"{self.remaining()} instead"
            )
        start, stop = split_slices(self.position, batches)[rank]
        self.position += total
        return self.permutation()[start:stop].copy()

    def peek(self, local_batches: Sequence[int], rank: int) -> IndexArray:
        """What :meth:`take` would return now, without advancing (for prefetching); an
        empty array where it would refuse."""
        total = sum(local_batches)
        if not 1 <= total <= self.remaining() or not 0 <= rank < len(local_batches):
            return np.empty(0, dtype=np.int64)
        start, stop = split_slices(self.position, local_batches)[rank]
        return self.permutation()[start:stop].copy()

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration use ``epoch``'s permutation, as DistributedSampler's
        ``set_epoch`` does. The epoch in progress is kept when ``epoch`` names it, so the
        usual ``for epoch in range(start, E): sampler.set_epoch(epoch)`` loop neither
        skips an epoch (this sampler moves to the next one by itself) nor restarts one
        resumed from a checkpoint mid-way; another epoch starts at its first sample."""
        epoch = _check_int("epoch", epoch, minimum=0)
        if epoch == self.epoch:
            return
        if 0 < self.position < self.num_samples:
            logger.warning("set_epoch(%d) leaves epoch %d after %d of its %d samples", epoch,
                           self.epoch, self.position, self.num_samples)
        self.epoch, self.position, self._permutation = epoch, 0, None

    def new_epoch(self) -> None:
        """Start the next epoch (a new permutation, position 0), whether or not this one ended."""
        self.epoch += 1
        self.position = 0
        self._permutation = None

    def state_dict(self) -> dict[str, int | bool]:
        """Plain numbers: enough to resume exactly-once on any number of workers."""
        return {"version": STATE_VERSION, "num_samples": self.num_samples, "seed": self.seed,
                "epoch": self.epoch, "position": self.position, "drop_last": self.drop_last,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`; refuse, saying why, a state this sampler cannot honour.

        The dataset size and seed must match: another permutation would silently repeat or
        skip samples. A different ``drop_last`` is honoured (it only changes the epoch's end).
        """
        if not isinstance(state, Mapping):
            raise TypeError(f"sampler state must be a mapping, got {type(state).__name__}")
        missing = {"version", "num_samples", "seed", "epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"sampler state lacks {sorted(missing)}; got keys {sorted(state)}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"sampler state version {state['version']!r} is not supported "
                             f"(this code reads version {STATE_VERSION})")
        for key, mine in (("num_samples", self.num_samples), ("seed", self.seed)):
            theirs = _check_int(key, state[key], minimum=0)
            if theirs != mine:
                raise ValueError(
                    f"cannot resume: the checkpoint's {key} is {theirs} but this sampler's is "
                    f"{mine}; resuming would not visit each sample exactly once"
                )
        epoch = _check_int("epoch", state["epoch"], minimum=0)
        position = _check_int("position", state["position"], minimum=0)
        if position > self.num_samples:
            raise ValueError(f"position must be in [0, {self.num_samples}], got {position}")
        if bool(state.get("shuffle", True)) != self.shuffle:
            raise ValueError(f"cannot resume: the checkpoint was taken with shuffle="
                             f"{bool(state.get('shuffle', True))} but this sampler has shuffle="
                             f"{self.shuffle}; resuming would not visit each sample exactly once")
        if "drop_last" in state and bool(state["drop_last"]) != self.drop_last:
            logger.warning("checkpoint had drop_last=%s; continuing with drop_last=%s",
                           bool(state["drop_last"]), self.drop_last)
        self.epoch, self.position, self._permutation = epoch, position, None
