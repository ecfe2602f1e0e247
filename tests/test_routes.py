"""IdleRoutes: which groups a split's route uses, made once per set of ranks, at most
MAX_ROUTES routes (the groups themselves are faked here; test_runtime_dist.py's
idle_route check runs them on 3 gloo workers)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch.distributed as dist

from cannikin.runtime import routes
from cannikin.runtime.routes import IdleRoutes


class FakeTimeout:
    current_s = 30.0

    def __init__(self) -> None:
        self.followed: list[Any] = []

    def follow(self, group: Any) -> None:
        self.followed.append(group)


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, ...]]:
    groups: list[tuple[int, ...]] = []

    def new_group(ranks: list[int], **kwargs: Any) -> tuple[int, ...]:
        groups.append(tuple(ranks))
        return tuple(ranks)

    monkeypatch.setattr(dist, "new_group", new_group)
    return groups


def test_each_rank_gets_its_part_and_groups_are_made_once(made: list[tuple[int, ...]]) -> None:
    timeouts = [FakeTimeout() for _ in range(4)]
    ranks = [IdleRoutes(rank, 4, timeouts[rank]) for rank in range(4)]
    assert all(r.route((10, 10, 10, 10)) is None for r in ranks)  # nobody idle
    assert all(r.route((0, 0, 0, 0)) is None for r in ranks)  # nobody busy
    made.clear()
    got = [r.route((30, 0, 50, 0)) for r in ranks]
    # the largest batch (rank 2) sends to the idle ranks 1 and 3
    assert [(g.busy, g.fan, g.source) for g in got if g is not None] == [
        ((0, 2), None, 2), (None, (1, 2, 3), 2), ((0, 2), (1, 2, 3), 2), (None, (1, 2, 3), 2)]
    assert [t.followed for t in timeouts] == [[(0, 2)], [(1, 2, 3)], [(0, 2), (1, 2, 3)],
                                              [(1, 2, 3)]]
    assert made == [(0, 2), (1, 2, 3)] * 4  # every rank makes every group, in one order
    assert ranks[0].route((30, 0, 50, 0)) is got[0]  # kept
    ranks[0].route((50, 0, 30, 0))  # busy {0, 2} again, a new fan {0, 1, 3}
    assert made[8:] == [(0, 1, 3)]


def test_at_most_max_routes_are_made(made: list[tuple[int, ...]]) -> None:
    world = 6
    routes_ = IdleRoutes(0, world, FakeTimeout())
    splits = [tuple(0 if r in idle else 10 for r in range(world))
              for idle in itertools.combinations(range(1, world), 2)]
    assert len(splits) > routes.MAX_ROUTES
    got = [routes_.route(split) for split in splits]
    assert all(g is not None for g in got[:routes.MAX_ROUTES])
    assert all(g is None for g in got[routes.MAX_ROUTES:])  # all-reduced over every worker
    assert routes_.route(splits[0]) is got[0]  # a route made before is still used


def test_a_split_of_another_size_is_refused(made: list[tuple[int, ...]]) -> None:
    with pytest.raises(ValueError, match=r"a split of 2 workers for a job of 3: \[5, 0\]"):
        IdleRoutes(0, 3, FakeTimeout()).route((5, 0))
