"""The collective timeout once training runs: a multiple of the measured step time, floored.

``init_distributed(timeout_s=...)`` (300 s by default) bounds every collective from the start,
and it must be generous there: workers start, import and load checkpoints at different speeds.
During training that bound is what a cut link costs: gloo over TCP gets no reset when a link
goes down (nothing comes back at all), so the ranks on the other side wait in their next
collective for the whole timeout, and the cluster stalls for five minutes before torchrun can
restart it without the lost host.

:class:`StepTimeout` lowers the process group's timeout once steps are measured, to

    min(start-up timeout, max(floor_s, factor x median step time))

with the median over the last :data:`WINDOW` measured steps of the *slowest* rank's step
period, from at least :data:`MIN_STEPS` of them. Each rank takes the step times from the
per-step exchange, which every rank receives identically, so every rank computes the same
timeout; the rule itself is checked to be the same on every rank when the model is wrapped.
A new value is applied when it differs from the one in force by more than
:data:`REAPPLY_CHANGE` (``ProcessGroup.set_timeout``, which gloo honours from the next
collective on, on connections already made).

Defaults: floor 30 s, factor 10 (``CANNIKIN_TIMEOUT_FLOOR_S``, ``CANNIKIN_TIMEOUT_STEPS``; a
factor of 0 keeps the start-up timeout throughout). The floor must exceed any wait between two
collectives that is not a training step: rank 0 alone writing a checkpoint, evaluating or
logging while the others wait in their next collective. :func:`startup_timeout` puts the
start-up bound back for such a block; ``save_training`` uses it while rank 0 writes.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import statistics
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cannikin.runtime.planner import WorkerReport

logger = logging.getLogger(__name__)

FLOOR_ENV = "CANNIKIN_TIMEOUT_FLOOR_S"
FACTOR_ENV = "CANNIKIN_TIMEOUT_STEPS"
DEFAULT_FLOOR_S = 30.0
"""No collective times out sooner once training runs: a cut link costs ~30 s, not 300 s."""
DEFAULT_FACTOR = 10.0
"""Step times a collective may take: a step of 3 s or more lifts the timeout above the floor."""
MIN_STEPS = 5
"""Measured steps before the first lowering (the first ones include start-up work)."""
WINDOW = 32
"""Measured steps the median is taken over."""
REAPPLY_CHANGE = 0.25
"""Relative change of the computed timeout that is applied (and logged)."""


def _number(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw} is not a number of seconds") from None


@dataclass(frozen=True)
class TimeoutRule:
    """How the collective timeout follows the step time: ``max(floor_s, factor x median)``."""

    floor_s: float = DEFAULT_FLOOR_S
    factor: float = DEFAULT_FACTOR
    """0 keeps the start-up timeout."""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.floor_s) and self.floor_s > 0):
            raise ValueError(f"the collective-timeout floor {self.floor_s} s is not valid: it "
                             f"must be a positive number of seconds ({FLOOR_ENV})")
        if not (math.isfinite(self.factor) and self.factor >= 0):
            raise ValueError(f"the collective-timeout factor {self.factor} is not valid: it "
                             f"must be a number of step times >= 0, 0 to keep the start-up "
                             f"timeout ({FACTOR_ENV})")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TimeoutRule:
        """The rule of ``CANNIKIN_TIMEOUT_FLOOR_S`` and ``CANNIKIN_TIMEOUT_STEPS``, defaults
        where unset."""
        return cls(floor_s=_number(env, FLOOR_ENV, DEFAULT_FLOOR_S),
                   factor=_number(env, FACTOR_ENV, DEFAULT_FACTOR))

    def timeout_s(self, median_step_s: float, startup_s: float) -> float:
        """The timeout for steps of ``median_step_s``, never above the start-up timeout."""
        return min(startup_s, max(self.floor_s, self.factor * median_step_s))


def group_timeout_s(group: dist.ProcessGroup) -> float:
    """The timeout in force on ``group``'s backend (gloo's or nccl's options), seconds."""
    device = torch.device("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    timeout: timedelta = group._get_backend(device).options._timeout
    return timeout.total_seconds()


class StepTimeout:
    """Lowers ``group``'s collective timeout from the start-up bound to the step-time rule.

    Made on every rank (a collective: the ranks' rules are compared, and a difference raises
    ValueError naming both) and fed each step's exchanged reports with :meth:`observe`.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, rule: TimeoutRule | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        group = dist.group.WORLD if group is None else group
        if group is None:
            raise RuntimeError("StepTimeout needs a process group: call "
                               "cannikin.runtime.init_distributed() first")
        self.group: dist.ProcessGroup = group
        self.rule = rule if rule is not None else TimeoutRule.from_env(
            os.environ if env is None else env)
        self.startup_s = group_timeout_s(self.group)
        """The group's timeout now: ``init_distributed``'s ``timeout_s``, unless an earlier
        model on this group lowered it (a group keeps no attribute of ours to remember it)."""
        self.current_s = self.startup_s
        """The timeout in force now."""
        self._steps: deque[float] = deque(maxlen=WINDOW)
        self._followers: list[dist.ProcessGroup] = []
        self._agree()

    def follow(self, group: dist.ProcessGroup) -> None:
        """Give ``group`` (one this rank belongs to, made after this) the timeout in force,
        and every later one: a collective on it bounds a hung peer's wait like one on
        :attr:`group`."""
        group.set_timeout(timedelta(seconds=self.current_s))
        self._followers.append(group)

    def _apply(self, seconds: float) -> None:
        for group in (self.group, *self._followers):
            group.set_timeout(timedelta(seconds=seconds))

    def _agree(self) -> None:
        world = dist.get_world_size(self.group)
        if world == 1:
            return
        rules: list[object] = [None] * world
        dist.all_gather_object(rules, self.rule, group=self.group)
        for rank, other in enumerate(rules):
            if other != rules[0]:
                raise ValueError(
                    f"rank {rank}'s collective-timeout rule {other} differs from rank 0's "
                    f"{rules[0]}: set {FLOOR_ENV} and {FACTOR_ENV} the same for every rank")

    def observe(self, reports: Sequence[WorkerReport]) -> None:
        """Take one step's exchanged reports (the same on every rank); lower the timeout once
        enough steps are measured, and follow the step time after that."""
        times = [r.previous.step_s for r in reports if r.previous is not None]
        if not times or self.rule.factor == 0:
            return
        self._steps.append(max(times))
        if len(self._steps) < MIN_STEPS:
            return
        median = statistics.median(self._steps)
        target = self.rule.timeout_s(median, self.startup_s)
        if abs(target - self.current_s) > REAPPLY_CHANGE * self.current_s:
            self._apply(target)
            logger.info("collective timeout %.1f s (was %.1f s): max(floor %g s, %g x median "
                        "step %.3f s), at most the start-up %g s", target, self.current_s,
                        self.rule.floor_s, self.rule.factor, median, self.startup_s)
            self.current_s = target

    @contextlib.contextmanager
    def relaxed(self) -> Iterator[None]:
        """The start-up timeout while the block runs, the step-time one again after it."""
        if self.current_s == self.startup_s:
            yield
            return
        self._apply(self.startup_s)
        try:
            yield
        finally:
            self._apply(self.current_s)


def startup_timeout(model: object) -> contextlib.AbstractContextManager[None]:
    """The start-up collective timeout around work that makes the other ranks wait on one
    (rank 0 writing a checkpoint): ``model``'s :class:`StepTimeout` relaxed, if it has one.
    Every rank must enter it, as every rank enters the collectives inside."""
    timeout = getattr(model, "collective_timeout", None)
    return timeout.relaxed() if isinstance(timeout, StepTimeout) else contextlib.nullcontext()
