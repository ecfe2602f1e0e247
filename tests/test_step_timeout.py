"""The collective timeout after start-up (cannikin.runtime.step_timeout), in a world of 1.

The rule's arithmetic and parsing; that the gloo group's own timeout really changes (read
back from its options); that the ranks' rules are compared is in tests/test_runtime_dist.py
(3 ranks), and what a cut link then costs is in tests/test_recovery.py. A checkpoint is
written under the start-up timeout.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from cannikin.runtime import HeteroDataLoader, HeteroDataParallel
from cannikin.runtime.checkpoint import CheckpointManager, save_training
from cannikin.runtime.distributed import destroy_distributed, init_distributed
from cannikin.runtime.planner import StepReport, WorkerReport
from cannikin.runtime.step_timeout import (
    DEFAULT_FACTOR,
    DEFAULT_FLOOR_S,
    FACTOR_ENV,
    FLOOR_ENV,
    MIN_STEPS,
    StepTimeout,
    TimeoutRule,
    group_timeout_s,
)

pytestmark = pytest.mark.timeout(60)

STARTUP_S = 120.0


@pytest.fixture(autouse=True)
def process_group() -> Iterator[None]:
    """A fresh group per test: each test lowers its timeout."""
    init_distributed("gloo", timeout_s=STARTUP_S, env={})
    yield
    destroy_distributed()


def reports(*step_s: float | None) -> list[WorkerReport]:
    """One step's exchange: a rank per value, None for a rank that did not measure."""
    return [WorkerReport(batch=1, previous=None if s is None else StepReport(
        batch=1, sqnorm=1.0, fwd_s=0.0, bwd_s=0.0, step_s=s)) for s in step_s]


def test_the_rule_is_a_floored_multiple_of_the_step_capped_by_start_up() -> None:
    rule = TimeoutRule()
    assert (rule.floor_s, rule.factor) == (DEFAULT_FLOOR_S, DEFAULT_FACTOR) == (30.0, 10.0)
    assert rule.timeout_s(0.2, 300) == 30
    assert rule.timeout_s(4.0, 300) == 40
    assert rule.timeout_s(60.0, 300) == 300
    assert TimeoutRule(floor_s=500).timeout_s(0.1, 300) == 300


def test_the_rule_comes_from_the_environment_and_bad_values_are_named() -> None:
    assert TimeoutRule.from_env({FLOOR_ENV: " 5 ", FACTOR_ENV: "0"}) == TimeoutRule(5, 0)
    assert TimeoutRule.from_env({FLOOR_ENV: ""}) == TimeoutRule()
    with pytest.raises(ValueError, match=f"^{FLOOR_ENV}=soon is not a number of seconds$"):
        TimeoutRule.from_env({FLOOR_ENV: "soon"})
    with pytest.raises(ValueError, match="floor 0.0 s is not valid: it must be a positive"):
        TimeoutRule.from_env({FLOOR_ENV: "0"})
    with pytest.raises(ValueError, match="factor -1.0 is not valid: it must be a number of "
                       "step times >= 0, 0 to keep the start-up timeout"):
        TimeoutRule.from_env({FACTOR_ENV: "-1"})
    with pytest.raises(ValueError, match="floor inf s"):
        TimeoutRule(floor_s=float("inf"))


def test_the_group_timeout_is_lowered_once_enough_steps_are_measured() -> None:
    group = dist.group.WORLD
    assert group is not None
    timeout = StepTimeout(rule=TimeoutRule(floor_s=2, factor=10))
    assert timeout.startup_s == timeout.current_s == group_timeout_s(group) == STARTUP_S
    for _ in range(MIN_STEPS - 1):
        timeout.observe(reports(0.01, 0.03))
        timeout.observe(reports(None, None))  # unmeasured steps count for nothing
    assert timeout.current_s == STARTUP_S
    timeout.observe(reports(0.01, 0.03))
    assert timeout.current_s == group_timeout_s(group) == 2.0  # the slowest rank's 0.3 s < 2
    for _ in range(40):  # steps become 1 s: the timeout follows, from the slowest rank
        timeout.observe(reports(0.5, 1.0))
    assert timeout.current_s == group_timeout_s(group) == 10.0
    timeout.observe(reports(1.1))  # a 10% change is not re-applied
    assert timeout.current_s == 10.0


def test_a_followed_group_gets_every_timeout_the_default_group_gets() -> None:
    # the groups of the idle route (cannikin.runtime.routes) are made after start-up
    timeout = StepTimeout(rule=TimeoutRule(floor_s=2, factor=10))
    for _ in range(MIN_STEPS):
        timeout.observe(reports(0.01))
    later = dist.new_group([0], timeout=timedelta(seconds=STARTUP_S))
    timeout.follow(later)
    assert group_timeout_s(later) == 2.0  # the timeout in force when it joined
    for _ in range(40):
        timeout.observe(reports(1.0))
    assert group_timeout_s(later) == timeout.current_s == 10.0
    with timeout.relaxed():
        assert group_timeout_s(later) == STARTUP_S
    assert group_timeout_s(later) == 10.0


def test_factor_zero_keeps_the_start_up_timeout() -> None:
    timeout = StepTimeout(env={FACTOR_ENV: "0"})
    for _ in range(2 * MIN_STEPS):
        timeout.observe(reports(0.01))
    assert timeout.current_s == STARTUP_S == group_timeout_s(dist.group.WORLD)  # type: ignore[arg-type]


def test_training_lowers_the_timeout_to_the_floor() -> None:
    """HeteroDataParallel feeds it every step: tiny steps, so the 30 s default floor."""
    net = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(96, 3), torch.zeros(96, dtype=torch.long))
    model = HeteroDataParallel(net, optimizer, HeteroDataLoader(data, batch_size=8))
    assert model.collective_timeout.current_s == STARTUP_S
    for x, y in model.loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    assert model.collective_timeout.current_s == DEFAULT_FLOOR_S
    assert group_timeout_s(dist.group.WORLD) == DEFAULT_FLOOR_S  # type: ignore[arg-type]
    model.remove_hooks()


class TimedManager(CheckpointManager):
    """Records the group's timeout while rank 0 writes."""

    seen: list[float]

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        self.seen.append(group_timeout_s(dist.group.WORLD))  # type: ignore[arg-type]
        return super().save(step, state)


def test_a_checkpoint_is_written_under_the_start_up_timeout(tmp_path: Path) -> None:
    """The other ranks wait in save_training's collective while rank 0 writes: a big
    checkpoint must not run into the step-time timeout."""
    net = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(96, 3), torch.zeros(96, dtype=torch.long))
    model = HeteroDataParallel(net, optimizer, HeteroDataLoader(data, batch_size=8))
    model.collective_timeout.current_s = 2.0  # as if lowered
    dist.group.WORLD.set_timeout(timedelta(seconds=2))  # type: ignore[union-attr]
    manager = TimedManager(tmp_path)
    manager.seen = []
    save_training(manager, model)
    assert manager.seen == [STARTUP_S]
    assert group_timeout_s(dist.group.WORLD) == 2.0  # type: ignore[arg-type]
    model.remove_hooks()
