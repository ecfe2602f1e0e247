"""The weighted gradient all-reduce: exact mean gradient over uneven local batches.

Worker i computes the gradient g_i of its *local mean* loss over b_i samples. The
mean-loss gradient over all B = sum_i b_i samples is sum_i (b_i / B) g_i, so each
bucket is scaled by b_i / B and all-reduced with a *sum* (DESIGN.md §5). Plain DDP
averages (1/n) sum_i g_i, which is wrong whenever the b_i differ.

DDP calls the hook once per bucket, in the order buckets become ready, and rebuilds
its buckets after the first step; the per-step weight therefore lives in the shared
:class:`CommState`, not in any per-bucket closure. The hook also takes the marks the
profiler needs (bucket ready, all-reduce done) and, before scaling, the local squared
gradient norm |g_i|^2 for the noise-scale estimate.
"""

# No `from __future__ import annotations`: DDP checks the hook signature at run time.

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # what DDP's hook annotation must name

# (param, grad) -> gradient in the space the noise scale is measured in
GradTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(kw_only=True)
class CommState:
    """Shared state of the weighted all-reduce hook; one per wrapped model.

    ``weight`` is b_i / B for the current step (set before each backward).
    ``transform`` maps a local gradient into the space |g_i|^2 is measured in; None is
    the identity, and then the hook also takes the global |g|^2 from the reduced buckets
    (one dot product per bucket, no extra pass over the gradients). The ``ready``/``done``
    lists and squared norms are this step's records, cleared by :meth:`begin_step`.
    """

    clock: Any
    group: dist.ProcessGroup | None = None
    weight: float = 1.0
    transform: GradTransform | None = None
    capture_sqnorm: bool = True
    ready: list[Any] = field(default_factory=list)
    done: list[Any] = field(default_factory=list)
    local_parts: list[torch.Tensor] = field(default_factory=list)
    global_parts: list[torch.Tensor] = field(default_factory=list)
    rows: torch.Tensor | None = None
    """Per-step exchange to sum over ranks in place, launched after the first bucket's."""
    rows_work: dist.Work | None = None
    """The all-reduce of ``rows`` in flight (None before the first bucket)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"weight must be b_i/B in [0, 1], got {self.weight}")

    def begin_step(self, weight: float) -> None:
        """Set this step's weight b_i / B and clear the per-step records."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight must be b_i/B in [0, 1], got {weight}")
        self.weight = weight
        self.ready = []
        self.done = []
        self.local_parts = []
        self.global_parts = []
        self.rows = None
        self.rows_work = None

    def rows_reduced(self) -> torch.Tensor | None:
        """``rows`` summed over ranks (waits for its all-reduce); None if it was not sent."""
        if self.rows_work is None:
            return None
        self.rows_work.wait()
        return self.rows

    def local_sqnorm(self) -> float:
        """|g_i|^2 of this step's local gradient (0.0 if no bucket was seen)."""
        return float(sum(float(t) for t in self.local_parts))

    def global_sqnorm(self) -> float | None:
        """|g|^2 of the all-reduced gradient, if the hook measured it (identity transform)."""
        if self.transform is not None or not self.capture_sqnorm or not self.global_parts:
            return None
        return float(sum(float(t) for t in self.global_parts))

    def _add_local(self, bucket: GradBucket) -> None:
        if self.transform is None:
            flat = bucket.buffer()
            self.local_parts.append(torch.dot(flat, flat).double())
            return
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            g = self.transform(param, grad).detach().reshape(-1)
            self.local_parts.append(torch.dot(g, g).double())


def weighted_allreduce_hook(
    state: CommState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Scale the bucket by b_i / B and all-reduce it with a sum.

    A worker with b_i = 0 contributes zeros (its buffer is zeroed rather than
    multiplied, so a NaN from an empty local batch cannot leak into the sum).
    ``state.rows`` (float64, a few hundred bytes) is all-reduced right after the step's
    first bucket, so it travels while the backward computes; a separate collective
    rather than appended to the bucket, whose copy in and out cost more CPU than a
    small all-reduce, and more the larger the bucket.
    """
    state.ready.append(state.clock.mark())
    if state.capture_sqnorm and state.weight > 0.0:
        state._add_local(bucket)
    buffer = bucket.buffer()
    if state.weight == 0.0:
        buffer.zero_()
    elif state.weight != 1.0:
        buffer.mul_(state.weight)
    slot = len(state.done)
    state.done.append(None)
    future = dist.all_reduce(buffer, group=state.group, async_op=True).get_future()
    if slot == 0 and state.rows is not None:
        state.rows_work = dist.all_reduce(state.rows, group=state.group, async_op=True)
    global_sqnorm = state.capture_sqnorm and state.transform is None

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.done[slot] = state.clock.mark()
        try:
            reduced = fut.value()[0]
        except RuntimeError as error:  # gloo/nccl: the process group's timeout ran out
            raise RuntimeError(
                f"rank {dist.get_rank(state.group)} of {dist.get_world_size(state.group)}: "
                f"gradient all-reduce failed (a peer worker may be hung or dead; the wait is "
                f"bounded by init_distributed's timeout_s): {error}") from error
        if global_sqnorm:
            state.global_parts.append(torch.dot(reduced, reduced).double())
        return reduced

    result: torch.futures.Future[torch.Tensor] = future.then(finish)
    return result
