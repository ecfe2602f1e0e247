"""Where a step's gradient buckets travel when some workers have no samples.

A worker planned 0 samples adds zeros to the gradient sum, yet in a plain all-reduce it
does a full share of the reduction: in gloo's ring every rank sends, receives and adds
2(n - 1)/n of each bucket. On the slowest worker, the one a plan gives 0 samples, that
share is most of its step: all-reducing 1.1M floats over 3 ranks at 1, 0.5 and 0.25 of a
core cost the quarter-core rank 4.4 ms of CPU, and the sum 17-18 ms of wall time
(``benchmarks/bench_idle_route.py``). On such a step the busy workers all-reduce among
themselves, and the one with the largest local batch (the *source*) then broadcasts the
sum to the idle ones, which only receive: 1.4 ms of CPU on the quarter-core rank, 8-9 ms
for the sum, in the same runs. The sum is the same, since the idle
workers' terms are zeros, and every rank ends with the source's bits.

Process groups are made collectively, so every rank asks for the route of every step's
split (the same split on every rank: the plan is), and a group of ranks is made once and
kept. At most :data:`MAX_ROUTES` routes are made (their groups hold connections of their
own); a split beyond them all-reduces as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from cannikin.runtime.step_timeout import StepTimeout

logger = logging.getLogger(__name__)

MAX_ROUTES = 8
"""Distinct (idle workers, source) pairs given groups of their own in one job."""


@dataclass(frozen=True)
class Route:
    """One rank's part in a step with idle workers."""

    busy: dist.ProcessGroup | None
    """The busy workers' group, which all-reduces the buckets; None on an idle worker."""
    fan: dist.ProcessGroup | None
    """The source and the idle workers' group, over which the source broadcasts the sum;
    None on a busy worker other than the source."""
    source: int
    """The source's global rank."""


def largest_batch_rank(split: tuple[int, ...]) -> int:
    """The rank with the step's largest local batch (the first of equals): a route's
    source, and the rank that takes |g|^2 of the reduced gradient for every rank
    (:attr:`cannikin.runtime.comm.CommState.takes_global`), so that on a route the rank
    that holds the sum first is the one that measures it."""
    return split.index(max(split))


class IdleRoutes:
    """The routes of one job, made on demand (collectively) and kept."""

    def __init__(self, rank: int, world_size: int, timeout: StepTimeout) -> None:
        self.rank, self.world_size = rank, world_size
        self.timeout = timeout
        """The collective timeout the new groups follow, as the default group does."""
        self._routes: dict[tuple[tuple[int, ...], int], Route] = {}
        self._groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._full_said = False

    def route(self, split: tuple[int, ...]) -> Route | None:
        """This rank's route for a step of ``split``; None where every worker (or none)
        has samples, or where :data:`MAX_ROUTES` routes are made already. Every rank must
        call it with the same split, step by step."""
        if len(split) != self.world_size:
            raise ValueError(f"a split of {len(split)} workers for a job of "
                             f"{self.world_size}: {list(split)}")
        idle = tuple(r for r, b in enumerate(split) if b == 0)
        if not idle or len(idle) == len(split):
            return None
        source = largest_batch_rank(split)
        key = (idle, source)
        if key not in self._routes:
            if len(self._routes) == MAX_ROUTES:
                if not self._full_said:
                    self._full_said = True
                    logger.info("%d routes for idle workers made: a split that idles "
                                "others (%s) all-reduces over every worker", MAX_ROUTES,
                                list(idle))
                return None
            self._routes[key] = self._make(idle, source)
        return self._routes[key]

    def _make(self, idle: tuple[int, ...], source: int) -> Route:
        busy = [r for r in range(self.world_size) if r not in idle]
        fan = sorted((source, *idle))
        logger.debug("workers %s idle: gradients all-reduced over %s, then broadcast by "
                     "rank %d", list(idle), busy, source)
        return Route(busy=self._group(busy), fan=self._group(fan), source=source)

    def _group(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """The group of ``ranks`` (made by every rank, kept: two routes may share one);
        None where this rank is not in it."""
        key = tuple(ranks)
        if key not in self._groups:
            group = dist.new_group(ranks, timeout=timedelta(seconds=self.timeout.current_s))
            self._groups[key] = group if self.rank in ranks else None
            if self.rank in ranks:
                self.timeout.follow(group)
        return self._groups[key]
