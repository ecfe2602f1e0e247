"""What a policy is allowed to know: public job facts and simulated measurements.

A real training job knows its worker count, memory bounds and batch-size settings, and
observes timings and gradient norms. Nothing here refers to the ground truth; the arrays
are read-only copies, so a policy cannot reach back into the simulator through them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _frozen(a: np.ndarray) -> np.ndarray:
    out = np.array(a, dtype=float, copy=True)
    out.setflags(write=False)
    return out


@dataclass(frozen=True, kw_only=True)
class PolicyContext:
    """Public facts of a job, known before it starts."""

    num_workers: int
    max_local_batch: tuple[int, ...]
    """Per-worker memory bound on one pass (the runtime's ``max_local_batch``)."""
    init_batch: int
    """B0: the batch size the hyper-parameters were tuned for."""
    max_batch: int
    """Largest total batch the user allows."""
    max_micro_batches: int = 1
    """Passes of at most ``max_local_batch`` a worker may run per step, gradients
    accumulated (the runtime's ``max_micro_batches``)."""

    def __post_init__(self) -> None:
        if self.max_micro_batches < 1:
            raise ValueError(f"max_micro_batches must be >= 1, got {self.max_micro_batches}")
        if len(self.max_local_batch) != self.num_workers:
            raise ValueError(f"max_local_batch has {len(self.max_local_batch)} entries for "
                             f"{self.num_workers} workers")
        if min(self.max_local_batch) < 1:
            raise ValueError(f"every worker must hold at least one sample, got "
                             f"max_local_batch {self.max_local_batch}")
        if self.max_batch < self.start_batch:
            raise ValueError(f"max_batch {self.max_batch} is below the start batch "
                             f"{self.start_batch}")

    @property
    def max_share(self) -> tuple[int, ...]:
        """Per-worker largest local batch: its memory bound times the passes allowed."""
        return tuple(c * self.max_micro_batches for c in self.max_local_batch)

    @property
    def start_batch(self) -> int:
        """The fixed/initial total batch: B0, or one sample per worker if there are more."""
        return max(self.init_batch, self.num_workers)


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What the runtime's profiler reports for one block of steps with one split.

    Step times and gradient norms are reported for every step of the block, per-phase
    timings for ``sampled`` steps of it (the same subsampling for every policy).
    """

    local_batches: tuple[int, ...]
    steps: int
    elapsed_s: float
    """Wall-clock time since the job started, at the end of the block."""
    step_s: np.ndarray
    """(steps,) measured step times."""
    fwd_s: np.ndarray
    """(sampled, n) measured forward time per worker."""
    bwd_s: np.ndarray
    """(sampled, n) measured backward time per worker."""
    ready_fractions: np.ndarray
    """(sampled, m) fraction of the backward pass after which each bucket was ready."""
    allreduce_s: np.ndarray
    """(sampled, m) measured duration of each bucket's all-reduce."""
    local_sqnorms: np.ndarray
    """(steps, n) |g_i|^2 of each worker's local mean gradient; (0, n) if not gathered."""
    global_sqnorm: np.ndarray
    """(steps,) |g|^2 of the all-reduced gradient."""
    timed_batches: tuple[int, ...] = ()
    """The samples of the pass each worker's ``fwd_s`` and ``bwd_s`` time: its first one
    where it accumulates, as the runtime measures; () for ``local_batches``."""

    def __post_init__(self) -> None:
        for name in ("step_s", "fwd_s", "bwd_s", "ready_fractions", "allreduce_s",
                     "local_sqnorms", "global_sqnorm"):
            object.__setattr__(self, name, _frozen(getattr(self, name)))

    @property
    def total_batch(self) -> int:
        return sum(self.local_batches)

    @property
    def timed(self) -> tuple[int, ...]:
        """:attr:`timed_batches`, or the local batches where every worker ran one pass."""
        return self.timed_batches or self.local_batches
