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
    ``transform`` maps a local gradient into the space |g_i|^2 is measured in
    (identity if None). The ``ready``/``done`` lists and ``sqnorm`` are this step's
    records, cleared by :meth:`begin_step`.
    """

    clock: Any
    group: dist.ProcessGroup | None = None
    weight: float = 1.0
    transform: GradTransform | None = None
    capture_sqnorm: bool = True
    ready: list[Any] = field(default_factory=list)
    done: list[Any] = field(default_factory=list)
    sqnorm: torch.Tensor | None = None

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
        self.sqnorm = None

    def local_sqnorm(self) -> float:
        """|g_i|^2 of this step's local gradient (0.0 if no bucket was seen)."""
        return 0.0 if self.sqnorm is None else float(self.sqnorm.item())

    def _add_sqnorm(self, bucket: GradBucket) -> None:
        total = self.sqnorm
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            g = grad if self.transform is None else self.transform(param, grad)
            part = g.detach().double().pow(2).sum()
            total = part if total is None else total + part
        self.sqnorm = total


def weighted_allreduce_hook(
    state: CommState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Scale the bucket by b_i / B and all-reduce it with a sum.

    A worker with b_i = 0 contributes zeros (its buffer is zeroed rather than
    multiplied, so a NaN from an empty local batch cannot leak into the sum).
    """
    state.ready.append(state.clock.mark())
    if state.capture_sqnorm and state.weight > 0.0:
        state._add_sqnorm(bucket)
    buffer = bucket.buffer()
    if state.weight == 0.0:
        buffer.zero_()
    elif state.weight != 1.0:
        buffer.mul_(state.weight)
    slot = len(state.done)
    state.done.append(None)
    future = dist.all_reduce(buffer, group=state.group, async_op=True).get_future()

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.done[slot] = state.clock.mark()
        return fut.value()[0]

    result: torch.futures.Future[torch.Tensor] = future.then(finish)
    return result
