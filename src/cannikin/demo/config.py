"""What one ``cannikin demo`` run does, validated once (pure Python, no torch).

The parent process builds a :class:`DemoConfig` from the command line and hands it to the
workers as JSON, so both sides agree on every number.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

DEFAULT_WORKERS = 4
MIN_WORKERS = 2
WORKERS_PER_CORE = 4
"""Emulated workers mostly sleep (they pad their compute to a target time), so a core holds
a few of them; beyond four per core the real compute of one delays the others' padding."""
WORKER_MEMORY_BYTES = 512 * 2**20
"""Resident memory of one worker process (torch, gloo, the model and the task's data)."""
TASKS = ("digits", "teacher")
"""What the demo can train: scikit-learn's digits with a small CNN
(:mod:`cannikin.demo.digits`), or softmax regression on a random teacher's labels, whose
noise scale grows as it trains (:mod:`cannikin.demo.teacher`)."""
LR_SCHEDULES = ("steps", "progress")
"""What ``DemoConfig.lr_decay`` counts: optimizer steps (what a plain LambdaLR counts) or
AdaScale's progress (B0-steps of statistical progress, ``model.scaler.progress``)."""
LR_DECAY = 0.1
"""The learning rate's factor after the decay (the classic step decay's tenth)."""


def default_speeds(workers: int) -> tuple[float, ...]:
    """Speeds 1..4 spread over the workers: ``2 ** floor(2 i / (n - 1))``.

    4 workers give 1, 1, 2, 4 and 3 workers give 1, 2, 4: the slowest is always 1 and the
    fastest 4, so the even split wastes most of the fast workers' time.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1:
        return (1.0,)
    return tuple(float(2 ** math.floor(2 * i / (workers - 1))) for i in range(workers))


def _available_memory_bytes() -> int:
    """Memory the kernel could give new processes (Linux MemAvailable, else free pages)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine_worker_limit() -> int:
    """Most workers this machine can hold: 4 per usable core, and 512 MiB of memory each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    by_cores = WORKERS_PER_CORE * (cores or 1)
    by_memory = _available_memory_bytes() // WORKER_MEMORY_BYTES
    return max(MIN_WORKERS, min(by_cores, by_memory))


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """One demo: the same training run with an even split, then with Cannikin."""

    speeds: tuple[float, ...] = field(default_factory=lambda: default_speeds(DEFAULT_WORKERS))
    """Relative speed of each worker (one per worker); 2 means twice as fast as 1."""
    epochs: int | None = None
    """Train for this many passes over the training split (exclusive with ``steps``)."""
    steps: int | None = None
    """Train for ``steps * batch_size`` samples: the baseline's number of steps."""
    batch_size: int = 64
    """Initial total batch B0 (the baseline's fixed total batch)."""
    adaptive_batch: bool = False
    """Let Cannikin choose the total batch by goodput (up to ``max_batch_size``)."""
    max_batch_size: int = 256
    """Largest total batch the adaptive mode may choose."""
    target: float | None = None
    """Time to accuracy: train three runs (DDP, AdaptDL-like, Cannikin; the latter two with
    the goodput-chosen batch) each until the held-out accuracy reaches this, or the sample
    budget is spent; None: the DDP and Cannikin runs over the whole budget."""
    eval_every: int = 256
    """With a ``target``: evaluate the held-out accuracy each time this many more samples
    have been trained on (the same points in every run, whatever its batch)."""
    replan_every: int = 5
    """Steps between re-plans of the split."""
    lr: float = 0.05
    """SGD (Nesterov momentum 0.9) learning rate at B0; AdaScale scales it as B grows. At 0.1
    the loss spikes early in training and the even and Cannikin runs, which differ only in
    float summation order and the AdaScale factor of each epoch's partial batch, then end far
    apart; at 0.05 training is stable and they end close together."""
    lr_decay: str | None = None
    """Multiply the learning rate by :data:`LR_DECAY` once half the budget's steps of B0 have
    passed, counted as one of :data:`LR_SCHEDULES` says; None: a constant rate. Under an
    adaptive batch "steps" decays later than AdaScale intends (a step of B samples is worth
    up to B/B0 steps of B0), "progress" when the statistical progress is there; the figures
    of both are in docs/runtime.md."""
    task: str = "digits"
    """What to train, one of :data:`TASKS`."""
    seed: int = 0
    """Seed of the model initialisation, the data split and the sample order."""
    verbose: bool = False
    """Show the workers' logs."""
    cpu_shares: tuple[float, ...] | None = None
    """Real heterogeneity: each worker's CPU quota, in cores (``--heterogeneity quota``, see
    :mod:`cannikin.runtime.quota`); None emulates the speeds by sleep-padding instead."""
    worker_limit: int = field(default_factory=machine_worker_limit)
    """Most workers the machine can hold (see :func:`machine_worker_limit`)."""

    def __post_init__(self) -> None:
        n = len(self.speeds)
        if not MIN_WORKERS <= n <= self.worker_limit:
            raise ValueError(
                f"workers {n} is out of range: this machine holds {MIN_WORKERS} to "
                f"{self.worker_limit} workers"
            )
        for rank, speed in enumerate(self.speeds):
            if not (math.isfinite(speed) and speed > 0):
                raise ValueError(
                    f"speed {speed} of worker {rank} is not valid: speeds must be positive "
                    "finite numbers"
                )
        if (self.epochs is None) == (self.steps is None):
            raise ValueError(
                f"give exactly one of epochs ({self.epochs}) and steps ({self.steps})"
            )
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.batch_size < n:
            raise ValueError(
                f"batch size {self.batch_size} is smaller than the {n} workers: every worker "
                "needs at least one sample per step"
            )
        if self.max_batch_size < self.batch_size:
            raise ValueError(
                f"max batch size {self.max_batch_size} is below the batch size "
                f"{self.batch_size}"
            )
        if self.replan_every < 1:
            raise ValueError(f"replan_every must be >= 1, got {self.replan_every}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.target is not None and not 0.0 < self.target < 1.0:
            raise ValueError(f"target accuracy {self.target} is not valid: give a fraction "
                             "of the held-out samples strictly between 0 and 1, e.g. 0.9")
        if self.lr_decay is not None and self.lr_decay not in LR_SCHEDULES:
            raise ValueError(f"lr_decay {self.lr_decay!r} is not valid: give one of "
                             f"{', '.join(LR_SCHEDULES)} or None")
        if self.task not in TASKS:
            raise ValueError(f"task {self.task!r} is not valid: give one of "
                             f"{', '.join(TASKS)}")
        if self.eval_every < 1:
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")
        if self.cpu_shares is not None and len(self.cpu_shares) != n:
            raise ValueError(f"{len(self.cpu_shares)} CPU shares for {n} workers: give one "
                             "per worker")

    @property
    def workers(self) -> int:
        return len(self.speeds)

    @property
    def heterogeneity(self) -> str:
        """"quota" (real CPU quotas) or "emulate" (sleep-padding)."""
        return "emulate" if self.cpu_shares is None else "quota"

    @property
    def phases(self) -> tuple[tuple[str, str], ...]:
        """(phase name, HeteroDataParallel split) of each run, in the order they train: the
        DDP baseline first; with a ``target`` also AdaptDL's policy (even split, goodput
        batch) before Cannikin."""
        if self.target is None:
            return (("even", "even"), ("cannikin", "optimal"))
        return (("even", "even"), ("adaptdl", "adaptdl"), ("cannikin", "optimal"))

    def adapts_batch(self, split: str) -> bool:
        """Whether the run with ``split`` chooses its total batch by goodput."""
        return split != "even" and (self.adaptive_batch or self.target is not None)

    @property
    def slowdowns(self) -> tuple[float, ...]:
        """Per-rank slowdown factor for emulation: the fastest worker runs at factor 1."""
        fastest = max(self.speeds)
        return tuple(fastest / s for s in self.speeds)

    def sample_budget(self, train_size: int) -> int:
        """Samples each run trains on, so the baseline and Cannikin see the same amount."""
        if self.steps is not None:
            return self.steps * self.batch_size
        assert self.epochs is not None
        return self.epochs * train_size

    def lr_factor(self, position: float, train_size: int) -> float:
        """The learning rate's schedule factor at ``position`` (optimizer steps or progress,
        as :attr:`lr_decay` says): :data:`LR_DECAY` from half the budget in steps of B0."""
        half = self.sample_budget(train_size) / self.batch_size / 2
        return LR_DECAY if self.lr_decay is not None and position >= half else 1.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DemoConfig:
        shares = data.get("cpu_shares")
        return cls(**{**data, "speeds": tuple(data["speeds"]),
                      "cpu_shares": None if shares is None else tuple(shares)})
