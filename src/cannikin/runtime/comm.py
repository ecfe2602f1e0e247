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

The per-step exchange of measurements (a few hundred bytes per rank, zeros outside this
rank's row, so a sum is an all-gather) rides at the tail of the step's smallest bucket: on
gloo a collective costs far more than its bytes (every ring round is a wake-up of each
rank), and the bucket is written once anyway when it is scaled. float64 rows travel as
(hi, lo) float32 pairs in a float32 bucket, so they arrive to ~1e-14; a bucket of another
dtype (fp16, bf16) cannot carry them and they go in a small collective of their own.
"""

# No `from __future__ import annotations`: DDP checks the hook signature at run time.

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # what DDP's hook annotation must name

# (param, grad) -> gradient in the space the noise scale is measured in
GradTransform = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_FLOAT32_MAX = float(np.finfo(np.float32).max)


@dataclass(kw_only=True)
class CommState:
    """Shared state of the weighted all-reduce hook; one per wrapped model.

    ``weight`` is b_i / B for the current step (set before each backward).
    ``transform`` maps a gradient into the space the noise scale is measured in (None: the
    identity, one dot product per bucket). The hook takes the local |g_i|^2 before the
    all-reduce and the global |g|^2 from the reduced bucket, both through ``transform``,
    so the two are in the same space even under a scaled loss (AMP's GradScaler unscales
    the gradients only before the optimizer step). The ``ready``/``done`` lists and squared
    norms are this step's records, cleared by :meth:`begin_step`.
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
    rows: np.ndarray | None = None
    """Per-step exchange (float64) to sum over ranks, sent with bucket ``carrier_slot``."""
    rows_tail: torch.Tensor | None = None
    """The summed ``rows``, encoded, at the tail of the reduced carrier bucket."""
    rows_alone: tuple[torch.Tensor, dist.Work] | None = None
    """``rows`` in an all-reduce of their own (when the carrier's dtype cannot carry them)."""
    sizes: list[int] = field(default_factory=list)
    """This step's bucket sizes, in the order DDP hands them over (its index order)."""
    carrier_slot: int = 0
    """The bucket that carries ``rows``: the smallest of the previous step's (DDP's bucket
    layout is the same on every rank, so every rank chooses the same one)."""
    carrier: torch.Tensor | None = None
    """The carrier bucket and ``rows`` side by side, kept from step to step (a fresh tensor
    of a bucket's size costs page faults on every step); DDP has copied the reduced head
    into the gradients before the next backward writes it again."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"weight must be b_i/B in [0, 1], got {self.weight}")

    def begin_step(self, weight: float) -> None:
        """Set this step's weight b_i / B and clear the per-step records."""
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"weight must be b_i/B in [0, 1], got {weight}")
        self.weight = weight
        if self.sizes:
            self.carrier_slot = min(range(len(self.sizes)), key=self.sizes.__getitem__)
        self.sizes = []
        self.ready = []
        self.done = []
        self.local_parts = []
        self.global_parts = []
        self.rows = None
        self.rows_tail = None
        self.rows_alone = None

    def rows_reduced(self) -> np.ndarray | None:
        """``rows`` summed over ranks (after the backward); None if they were not sent."""
        if self.rows is None:
            return None
        if self.rows_alone is not None:
            summed, work = self.rows_alone
            work.wait()
            return summed.cpu().numpy().reshape(self.rows.shape)
        if self.rows_tail is None:
            return None
        return decode_rows(self.rows_tail.cpu().numpy()).reshape(self.rows.shape)

    def local_sqnorm(self) -> float:
        """|g_i|^2 of this step's local gradient (0.0 if no bucket was seen)."""
        return float(sum(float(t) for t in self.local_parts))

    def global_sqnorm(self) -> float | None:
        """|g|^2 of the all-reduced gradient, if the hook measured it this step."""
        if not self.capture_sqnorm or not self.global_parts:
            return None
        return float(sum(float(t) for t in self.global_parts))

    def carrier_for(self, bucket: torch.Tensor, extra: int) -> torch.Tensor:
        """A flat tensor like ``bucket`` with ``extra`` more elements (:attr:`carrier`)."""
        size = bucket.numel() + extra
        carrier = self.carrier
        if (carrier is None or carrier.numel() != size or carrier.dtype != bucket.dtype
                or carrier.device != bucket.device):
            carrier = self.carrier = bucket.new_empty(size)
        return carrier

    def _add_local(self, bucket: GradBucket) -> None:
        self._add_sqnorm(self.local_parts, bucket, bucket.buffer())

    def _add_global(self, bucket: GradBucket, reduced: torch.Tensor) -> None:
        self._add_sqnorm(self.global_parts, bucket, reduced)

    def _add_sqnorm(self, parts: list[torch.Tensor], bucket: GradBucket,
                    flat: torch.Tensor) -> None:
        """|transform(flat)|^2 into ``parts``; ``flat`` is laid out as the bucket's buffer
        (each gradient a view of it, found by its offset)."""
        if self.transform is None:
            parts.append(_sqnorm(flat))
            return
        base, size = bucket.buffer().data_ptr(), flat.element_size()
        for param, grad in zip(bucket.parameters(), bucket.gradients(), strict=True):
            start = (grad.data_ptr() - base) // size
            part = flat[start:start + grad.numel()].view(grad.shape)
            parts.append(_sqnorm(self.transform(param, part).detach().reshape(-1)))


def encode_rows(rows: np.ndarray, dtype: torch.dtype) -> np.ndarray | None:
    """float64 ``rows`` as a flat array that a bucket of ``dtype`` can carry and whose sum
    over ranks decodes to their sum, or None when ``dtype`` cannot carry them. A sum of
    zeros and one rank's value is exact in any dtype, so the float32 (hi, lo) split loses
    only lo's rounding; a value beyond float32's range travels as NaN. numpy, not torch:
    a few hundred values, where torch's per-op cost dominates."""
    flat = rows.reshape(-1)
    if dtype == torch.float64:
        return flat
    if dtype != torch.float32:
        return None
    if not np.abs(flat).max(initial=0.0) <= _FLOAT32_MAX:
        flat = np.where(np.abs(flat) <= _FLOAT32_MAX, flat, np.nan)
    hi = flat.astype(np.float32)
    return np.concatenate([hi, (flat - hi).astype(np.float32)])


def decode_rows(encoded: np.ndarray) -> np.ndarray:
    """Inverse of :func:`encode_rows` (a new float64 array, flat)."""
    if encoded.dtype == np.float64:
        return encoded.copy()
    wide = encoded.astype(np.float64)
    half = wide.size // 2
    return wide[:half] + wide[half:]


def weighted_allreduce_hook(
    state: CommState, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Scale the bucket by b_i / B and all-reduce it with a sum.

    A worker with b_i = 0 contributes zeros. ``state.rows`` travels at the tail of
    bucket ``state.carrier_slot`` (see the module docstring); that bucket is scaled into
    :attr:`CommState.carrier` instead of in place, and DDP copies the reduced head into
    the gradients as it does for any hook's result.
    """
    state.ready.append(state.clock.mark())
    if state.capture_sqnorm and state.weight > 0.0:
        state._add_local(bucket)
    buffer = bucket.buffer()
    slot = len(state.done)
    state.done.append(None)
    state.sizes.append(buffer.numel())
    rows = state.rows if slot == state.carrier_slot else None
    payload = None if rows is None else encode_rows(rows, buffer.dtype)
    size = buffer.numel()
    if payload is None:
        send = _scaled(buffer, state.weight, out=buffer)
    else:
        send = state.carrier_for(buffer, payload.size)
        _scaled(buffer, state.weight, out=send[:size])
        send[size:].copy_(torch.from_numpy(payload))
    future = dist.all_reduce(send, group=state.group, async_op=True).get_future()
    if rows is not None and payload is None:
        alone = torch.from_numpy(rows).to(buffer.device)
        state.rows_alone = (alone, dist.all_reduce(alone, group=state.group, async_op=True))
    capture = state.capture_sqnorm

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        state.done[slot] = state.clock.mark()
        try:
            reduced = fut.value()[0]
        except RuntimeError as error:  # gloo/nccl: the process group's timeout ran out
            raise RuntimeError(
                f"rank {dist.get_rank(state.group)} of {dist.get_world_size(state.group)}: "
                f"gradient all-reduce failed (a peer worker may be hung or dead; the wait is "
                f"bounded by init_distributed's timeout_s): {error}") from error
        if payload is not None:
            state.rows_tail = reduced[size:]
            reduced = reduced[:size]
        if capture:
            state._add_global(bucket, reduced)
        return reduced

    result: torch.futures.Future[torch.Tensor] = future.then(finish)
    return result


def _sqnorm(flat: torch.Tensor) -> torch.Tensor:
    """|flat|^2 as a 0-dim float32 or float64 tensor (read with ``float()`` once the
    step's backward is done): a half-precision square overflows at |g| ~ 256."""
    if flat.dtype in (torch.float32, torch.float64):
        return torch.dot(flat, flat)
    return torch.linalg.vector_norm(flat, dtype=torch.float32).square()


def _scaled(buffer: torch.Tensor, weight: float, out: torch.Tensor) -> torch.Tensor:
    """``out = weight * buffer`` (``out`` may be ``buffer`` itself). A weight of 0 gives
    zeros rather than a product, so a NaN from an empty local batch cannot leak into the
    sum."""
    if weight == 0.0:
        out.zero_()
    elif weight != 1.0:
        torch.mul(buffer, weight, out=out)
    elif out is not buffer:
        out.copy_(buffer)
    return out
