"""Performance model of a heterogeneous data-parallel step (DESIGN.md §1), and its online fit.

Per worker i with local batch b, forward ``F_i(b) = f0 + f1*b`` and backward
``K_i(b) = k0 + k1*b``. Gradients are all-reduced in buckets during the backward pass:
bucket j is ready on a worker once a fraction ``rho_j`` of its backward is done, its
all-reduce starts once every worker has it, and buckets go one after another. With
``R_j = c_j + ... + c_m`` the communication left from bucket j on::

    T(b) = max_j [ max_i (F_i(b_i) + rho_j * K_i(b_i)) + R_j ]

The fitters learn these parameters from measured samples robustly (a straggling step
must not wreck the model) over a bounded window (so the model follows a worker whose
speed changes), and :class:`PredictionTracker` reports how well the model predicts the
steps it later observes.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from cannikin.rowfit import (
    BoolArray,
    change_points,
    has_two_values,
    masked_median,
    robust_lines,
    robust_spread,
)

logger = logging.getLogger(__name__)

FloatArray = npt.NDArray[np.float64]

def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def micro_batches(batch: int, cap: int | None) -> tuple[int, ...]:
    """The micro-batch sizes of a local batch of ``batch`` under a memory cap of ``cap``
    samples per pass (None: no cap): as few as fit, as even as can be, the larger first
    (so the gradient is rescaled at most once between them). 0 samples are one empty pass:
    the worker still joins the all-reduce."""
    if not _is_int(batch) or batch < 0:
        raise ValueError(f"batch={batch!r} must be an integer >= 0")
    if cap is not None and (not _is_int(cap) or cap < 1):
        raise ValueError(f"cap={cap!r} must be None or an integer >= 1")
    count = 1 if cap is None or batch <= cap else -(-batch // cap)
    size, extra = divmod(int(batch), count)
    return (size + 1,) * extra + (size,) * (count - extra)


def even_passes(batch: int, count: int) -> tuple[int, ...]:
    """A local batch of ``batch`` in exactly ``count`` passes, as even as can be: the larger
    first, as :func:`micro_batches`, but the empty ones (fewer samples than passes) before
    the others, so that the gradient is still rescaled at most once between passes and the
    last pass, whose size weighs the all-reduce, is empty only if the batch is. For a loop
    that counts batches, not samples (Lightning's ``accumulate_grad_batches``)."""
    if not _is_int(batch) or batch < 0:
        raise ValueError(f"batch={batch!r} must be an integer >= 0")
    if not _is_int(count) or count < 1:
        raise ValueError(f"count={count!r} must be an integer >= 1")
    size, extra = divmod(int(batch), int(count))
    if size == 0:
        return (0,) * (count - extra) + (1,) * extra
    return (size + 1,) * extra + (size,) * (count - extra)


@dataclass(frozen=True, kw_only=True)
class FitConfig:
    """How :class:`NodeFitter` fits a line robustly and tells a lasting speed change."""

    outlier_sigmas: float = 3.5
    """Samples whose deviation from the line, relative to the line's time, lies further
    than this many robust standard deviations (1.4826 * MAD) from the median relative
    deviation are outliers (stragglers, GC pauses), left out of the fit."""
    min_slope_fraction: float = 1e-3
    """A fitted slope is never below this fraction of the worker's mean per-sample time, so
    a noisy fit cannot make a worker look free for extra samples (the split needs slopes
    > 0)."""
    slope_prior_sd: float = 0.5
    """The slope is shrunk toward the proportional model's (the median time per sample: the
    line with no fixed cost, about the steepest one a non-negative intercept allows) as a
    Gaussian prior with this relative standard deviation, weighed against the data by the
    residual noise. Once a plan holds, a worker's batch spans a few samples, and with 25%
    timing noise the least-squares slope then lands near 0 as often as near the truth: the
    worker looks free for extra samples and the next plan gives it most of the batch (2.6x
    the optimal step time in the planner's 2000-step runs). With the prior the same runs
    stay within 1.06x; spread data outweighs it."""
    drift_sigmas: float = 5.0
    """A worker's speed is taken to have changed (and the samples before the change are
    forgotten) when the mean log(measured/predicted) of the latest samples differs from
    the older ones by more than this many standard errors and by more than
    ``drift_min_change``: :func:`cannikin.rowfit.lasting_shift`, the rule the planner's
    drift check applies too, to another statistic with its own constants
    (:attr:`cannikin.runtime.planner.PlannerConfig.drift_sigmas`, 3). Here the question is
    *where* in the window the speed changed, so every split is tried and the largest z
    kept: that maximum over ~57 splits of a stationary 64-sample window passes 3 in 3-6%
    of fits at log-noise 0.1-0.5 (5% 10x stragglers), and each false change point throws
    the window and the anchors away; at 5, in at most 0.03%."""
    drift_min_change: float = 0.15
    """The smallest relative change of speed the change-point test acts on; smaller changes
    are left to the window. Half the planner's ``drift_change``: a re-plan out of turn is
    for changes that move the split, forgetting older samples costs nothing at a re-plan
    that is due anyway."""
    drift_min_segment: int = 4
    """Samples needed on each side of a change point."""

    def __post_init__(self) -> None:
        positive = ("outlier_sigmas", "min_slope_fraction", "slope_prior_sd", "drift_sigmas",
                    "drift_min_change")
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be finite and > 0")
        if not _is_int(self.drift_min_segment) or self.drift_min_segment < 1:
            raise ValueError(f"drift_min_segment={self.drift_min_segment!r} must be an "
                             "integer >= 1")

    @property
    def drift_clip(self) -> float:
        """Stragglers are clipped before the change-point test, but never closer to the
        centre than this: at low timing noise ``outlier_sigmas`` robust deviations are less
        than ``drift_min_change``, and the clipping would hide every shift (a 2x slowdown
        with 5% noise went unseen until it filled half the window). 1.5x the smallest shift
        keeps two 10x stragglers among the last ``drift_min_segment`` samples below it."""
        return 1.5 * math.log1p(self.drift_min_change)


def _check_line(name: str, line: tuple[float, float], node: str,
                parts: tuple[str, str] = ("intercept", "slope")) -> tuple[float, float]:
    if len(line) != 2:
        raise ValueError(f"node {node!r}: {name} must be ({parts[0]}, {parts[1]}), got {line!r}")
    first, second = float(line[0]), float(line[1])
    if not (math.isfinite(first) and math.isfinite(second)):
        raise ValueError(f"node {node!r}: {name}={line!r} must be finite")
    if first < 0 or second < 0:
        raise ValueError(f"node {node!r}: {name}={line!r} must have {parts[0]} >= 0 and "
                         f"{parts[1]} >= 0")
    return first, second


@dataclass(frozen=True)
class NodeModel:
    """One worker's compute model: forward and backward seconds, linear in its local batch.

    ``fwd=(f0, f1)`` covers forward, data loading and the optimiser step; ``bwd=(k0, k1)``
    the backward compute. ``min_batch``/``max_batch`` bound the local batch (``None``
    means unbounded). ``micro_batch`` is the most samples one forward and backward may
    hold (memory): a local batch above it runs as :func:`micro_batches` of it,
    accumulated, and only the last one's backward overlaps the all-reduce (None: one
    pass, ``max_batch`` is then the memory cap too). ``fixed_passes``: every step runs in
    exactly this many passes of :func:`even_passes` (a loop that counts batches), only the
    last one's backward overlapping the all-reduce; ``max_batch`` bounds their sum (None:
    one pass, or ``micro_batch``'s rule). ``noise`` is the spread of its compute time
    from step to step, the standard deviation of the time's log (0: deterministic); the
    lines are the medians, and the time about them log-normal (:func:`expected_max`): a
    step waits for the slowest worker *of that step*, so noise raises the expected step
    time above the max of the medians (:meth:`ClusterModel.expected_step_time`).
    ``noise_batch``: the local batch it was measured at, where the size of its
    disturbances (the log-normal part's scale, the compute there) holds at every batch
    (None: ``noise`` is relative at every batch). On
    quota workers the disturbances are of a fixed size (a throttled CFS period, a
    preemption), not a share of the work: the quarter-core worker's relative noise was
    0.3-0.85 at 0 samples (a millisecond of compute among throttle waits), 0.2-0.4 at
    20-40 and ~0.1 at 160, about 6 ms at each; held at 0 and taken as relative, it put the
    even split 20-70% high. ``idle_times=(fwd, bwd)``: its forward and backward seconds at
    0 samples, measured apart from the lines (None: the lines' intercepts). A step
    without samples skips most of the work, and the time falls below where the line
    through the busy batch sizes starts: on the quarter-core worker of ``bench_real``
    (one harness run) 8.1 ms at 0 samples, 19.1 at 4, 24.3 at 23, 37.9 at 63 and 59.2 at
    160; a line through 0 and 23 put 160 samples at 99-135 ms. ``cpu_floor=(c0, c1)``: the
    shortest step its CPU allows, ``c0 + c1*b`` seconds at local batch b (None: not
    bound). It is the worker's CPU seconds per step, every thread of it (compute, its
    share of the all-reduce, the runtime), over the cores it may use (a cgroup quota, its
    affinity). A worker held to a quarter of a core takes at least 4x its CPU per step
    even at 0 samples, and when its quota runs out the all-reduce waits for it too; the
    compute model alone does not see either (measured on CPU-quota workers). ``cpu_idle``:
    the floor at 0 samples where it was measured apart from the line (None: the line's
    ``c0``). With no samples there is no forward and backward at all, and the CPU falls
    below where the line through the busy batch sizes starts: on the quarter-core worker of
    ``bench_real`` under plain DDP (one run), a median of 9.1 ms of CPU per step at 0
    samples, 12.8 at 30 and 20.6 at 160, whose line starts at 11.0 (8 ms of wall time at a
    quarter of a core). ``cpu_noise``: the spread of the floor from step to step, as
    ``noise`` (the standard deviation of its log; 0: exact). A worker on its floor is as
    noisy as its CPU per step: a quarter-core worker at 0 samples (``bench_real``'s model
    and quotas, Cannikin alone for 400-600 steps), 10-11% (MAD) in three runs, where an
    exact floor predicted Cannikin's own balanced split 5-15% fast (docs/runtime.md, "The
    balanced step").
    """

    fwd: tuple[float, float]
    bwd: tuple[float, float]
    max_batch: int | None = None
    min_batch: int = 1
    name: str = ""
    noise: float = 0.0
    noise_batch: float | None = None
    idle_times: tuple[float, float] | None = None
    micro_batch: int | None = None
    fixed_passes: int | None = None
    cpu_floor: tuple[float, float] | None = None
    cpu_idle: float | None = None
    cpu_noise: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "fwd", _check_line("fwd", self.fwd, self.name))
        object.__setattr__(self, "bwd", _check_line("bwd", self.bwd, self.name))
        if self.idle_times is not None:
            object.__setattr__(self, "idle_times",
                               _check_line("idle_times", self.idle_times, self.name,
                                           parts=("fwd", "bwd")))
        if self.cpu_floor is not None:
            object.__setattr__(self, "cpu_floor",
                               _check_line("cpu_floor", self.cpu_floor, self.name))
        if self.cpu_idle is not None:
            idle = float(self.cpu_idle)
            if self.cpu_floor is None or not (math.isfinite(idle) and idle >= 0):
                raise ValueError(f"node {self.name!r}: cpu_idle={self.cpu_idle!r} must be "
                                 f"finite and >= 0, with a cpu_floor (got {self.cpu_floor!r})")
            object.__setattr__(self, "cpu_idle", idle)
        cpu_noise = float(self.cpu_noise)
        if not (math.isfinite(cpu_noise) and cpu_noise >= 0) or (
                cpu_noise > 0 and self.cpu_floor is None):
            raise ValueError(f"node {self.name!r}: cpu_noise={self.cpu_noise!r} must be finite "
                             f"and >= 0, and 0 without a cpu_floor (got {self.cpu_floor!r})")
        object.__setattr__(self, "cpu_noise", cpu_noise)
        if not _is_int(self.min_batch) or self.min_batch < 0:
            raise ValueError(
                f"node {self.name!r}: min_batch={self.min_batch!r} must be an integer >= 0"
            )
        object.__setattr__(self, "min_batch", int(self.min_batch))
        if self.max_batch is not None:
            if not _is_int(self.max_batch) or self.max_batch < max(self.min_batch, 1):
                raise ValueError(
                    f"node {self.name!r}: max_batch={self.max_batch!r} must be None or an "
                    f"integer >= max(min_batch, 1) = {max(self.min_batch, 1)}"
                )
            object.__setattr__(self, "max_batch", int(self.max_batch))
        noise = float(self.noise)
        if not (math.isfinite(noise) and noise >= 0):
            raise ValueError(f"node {self.name!r}: noise={self.noise!r} must be finite and >= 0")
        object.__setattr__(self, "noise", noise)
        if self.noise_batch is not None:
            at = float(self.noise_batch)
            if not (math.isfinite(at) and at >= 0):
                raise ValueError(f"node {self.name!r}: noise_batch={self.noise_batch!r} must "
                                 f"be None or finite and >= 0")
            object.__setattr__(self, "noise_batch", at)
        if self.micro_batch is not None:
            if not _is_int(self.micro_batch) or self.micro_batch < 1:
                raise ValueError(
                    f"node {self.name!r}: micro_batch={self.micro_batch!r} must be None or an "
                    f"integer >= 1"
                )
            if self.max_batch is None:
                raise ValueError(
                    f"node {self.name!r}: micro_batch={self.micro_batch} needs a max_batch "
                    f"(the most samples it may accumulate in a step)"
                )
            object.__setattr__(self, "micro_batch", int(self.micro_batch))
        if self.fixed_passes is not None:
            if not _is_int(self.fixed_passes) or self.fixed_passes < 1:
                raise ValueError(
                    f"node {self.name!r}: fixed_passes={self.fixed_passes!r} must be None or "
                    f"an integer >= 1"
                )
            if self.micro_batch is not None:
                raise ValueError(
                    f"node {self.name!r}: fixed_passes={self.fixed_passes} and micro_batch="
                    f"{self.micro_batch} are two rules for the passes of a step: give one"
                )
            object.__setattr__(self, "fixed_passes", int(self.fixed_passes))

    @property
    def passes(self) -> int:
        """Most micro-batches a step of this worker takes (1 without accumulation)."""
        if self.fixed_passes is not None:
            return self.fixed_passes
        if self.micro_batch is None or self.max_batch is None:
            return 1
        return -(-self.max_batch // self.micro_batch)

    @property
    def rows(self) -> int:
        """Pieces of its time model (:class:`ClusterArrays`): one per number of passes
        under ``micro_batch``, else one (a fixed number of passes is a single line)."""
        return 1 if self.fixed_passes is not None else self.passes

    def forward_time(self, batch: float) -> float:
        """Predicted forward seconds at local batch ``batch``."""
        if batch == 0 and self.idle_times is not None:
            return self.idle_times[0]
        return self.fwd[0] + self.fwd[1] * batch

    def backward_time(self, batch: float) -> float:
        """Predicted backward seconds at local batch ``batch``."""
        if batch == 0 and self.idle_times is not None:
            return self.idle_times[1]
        return self.bwd[0] + self.bwd[1] * batch


@dataclass(frozen=True)
class CommModel:
    """Gradient all-reduce buckets in ready order: ``(rho_j, c_j)``.

    ``rho_j`` is the fraction of a worker's backward after which bucket j is ready
    (non-decreasing, the last one 1.0), ``c_j`` the seconds its all-reduce takes.
    The default is one bucket that costs nothing (no communication).
    """

    buckets: Sequence[tuple[float, float]] = ((1.0, 0.0),)

    def __post_init__(self) -> None:
        buckets = tuple((float(r), float(c)) for r, c in self.buckets)
        if not buckets:
            raise ValueError("CommModel needs at least one bucket; use ((1.0, 0.0),) for none")
        previous = 0.0
        for j, (rho, cost) in enumerate(buckets):
            if not (math.isfinite(rho) and math.isfinite(cost)):
                raise ValueError(f"bucket {j}: (rho, c)=({rho}, {cost}) must be finite")
            if not previous <= rho <= 1.0:
                raise ValueError(
                    f"bucket {j}: rho={rho} must be in [{previous}, 1.0] (ready fractions are "
                    "non-decreasing in ready order)"
                )
            if cost < 0:
                raise ValueError(f"bucket {j}: all-reduce time c={cost} must be >= 0")
            previous = rho
        if buckets[-1][0] != 1.0:
            raise ValueError(
                f"the last bucket is ready when the backward ends: rho_m must be 1.0, "
                f"got {buckets[-1][0]}"
            )
        object.__setattr__(self, "buckets", buckets)

    @property
    def ready_fractions(self) -> FloatArray:
        """``rho_j`` for each bucket, shape (m,)."""
        return np.array([r for r, _ in self.buckets], dtype=np.float64)

    @property
    def remaining(self) -> FloatArray:
        """``R_j = c_j + ... + c_m``: communication left once bucket j may start, shape (m,)."""
        costs = np.array([c for _, c in self.buckets], dtype=np.float64)
        return np.cumsum(costs[::-1])[::-1].copy()

    @property
    def total(self) -> float:
        """Seconds of all-reduce per step if none of it overlapped the backward."""
        return float(sum(c for _, c in self.buckets))

    def binding(self) -> npt.NDArray[np.intp]:
        """Indices of the buckets that can set the step time, in ready order.

        A worker's share of the step is ``F + g(K)`` with ``g(K) = max_j (R_j + rho_j*K)``
        and ``K >= 0`` its backward time, the same ``g`` for every worker. Only buckets on
        the upper envelope of these lines over ``K >= 0`` ever bind; for real layouts
        that is a handful of the m buckets, and the planners work on those alone.
        """
        rho, remaining = self.ready_fractions, self.remaining
        hull: list[int] = []
        for j in np.lexsort((remaining, rho)).tolist():  # by slope, then intercept
            while hull and rho[hull[-1]] == rho[j]:
                hull.pop()  # same slope, lower intercept
            while len(hull) >= 2 and _crossing(rho, remaining, hull[-2], j) <= _crossing(
                    rho, remaining, hull[-2], hull[-1]):
                hull.pop()
            hull.append(j)
        while len(hull) >= 2 and _crossing(rho, remaining, hull[0], hull[1]) <= 0:
            hull.pop(0)  # only the larger line binds for every K >= 0
        return np.array(hull, dtype=np.intp)


def _crossing(rho: FloatArray, remaining: FloatArray, a: int, b: int) -> float:
    """K where lines a and b (rho[b] > rho[a]) of ``R + rho*K`` meet; inf for lines all
    but parallel (in Python floats, which give inf where numpy's warn of an overflow)."""
    return (float(remaining[a]) - float(remaining[b])) / (float(rho[b]) - float(rho[a]))


@dataclass(frozen=True)
class ClusterModel:
    """The workers' models plus the shared communication model: predicts a step's time."""

    nodes: Sequence[NodeModel]
    comm: CommModel = field(default_factory=CommModel)
    idle_comm: CommModel | None = None
    """The all-reduce of a step where some worker has 0 samples, where it differs (None:
    ``comm``): on a CPU-only job the busy workers reduce among themselves and one of them
    sends the sum to the idle ones (:mod:`cannikin.runtime.routes`), so a slow idle worker
    no longer paces the ring."""

    def __post_init__(self) -> None:
        nodes = tuple(self.nodes)
        if not nodes:
            raise ValueError("ClusterModel needs at least one node, got an empty list")
        for i, node in enumerate(nodes):
            if not isinstance(node, NodeModel):
                raise ValueError(f"node {i} must be a NodeModel, got {type(node).__name__}")
        object.__setattr__(self, "nodes", nodes)

    @property
    def size(self) -> int:
        """Number of workers."""
        return len(self.nodes)

    @cached_property
    def arrays(self) -> ClusterArrays:
        """The parameters as numpy arrays (computed once), for vectorised planners."""
        return ClusterArrays.of(self)

    @cached_property
    def with_idle(self) -> ClusterModel:
        """The same workers with ``idle_comm`` as their all-reduce: the model of a split
        that gives some worker 0 samples (itself where ``idle_comm`` is None)."""
        if self.idle_comm is None:
            return self
        return ClusterModel(nodes=self.nodes, comm=self.idle_comm)

    def node_times(self, local_batches: npt.ArrayLike) -> FloatArray:
        """Each worker's share of the step: ``max_j (F_i + rho_j K_i + R_j)``, or its CPU
        floor where that is longer, shape (n,) (or (n, T) for local batches of shape
        (n, T)), its earlier passes included where it accumulates (:class:`ClusterArrays`);
        a split with a worker at 0 through :attr:`with_idle`.

        The step time is the largest of these; bounds (min/max batch) are not enforced
        here so that any split, feasible or not, can be evaluated.
        """
        batches = self._checked(local_batches)
        if self.idle_comm is None:
            return self.arrays.worker_times(batches)
        idle = (batches == 0).any(axis=0)
        if not idle.any():
            return self.arrays.worker_times(batches)
        routed = self.with_idle.arrays.worker_times(batches)
        if idle.all():
            return routed
        return np.where(idle, routed, self.arrays.worker_times(batches))

    def _checked(self, local_batches: npt.ArrayLike) -> FloatArray:
        """``local_batches`` as floats, shape (n,) or (n, T); a ValueError naming them if
        they are not finite and >= 0, one per node."""
        b = np.asarray(local_batches, dtype=np.float64)
        if b.ndim not in (1, 2) or b.shape[0] != self.size:
            raise ValueError(
                f"local_batches has shape {b.shape}, expected ({self.size},) (one per node), "
                f"or ({self.size}, T) for T splits at once"
            )
        if not np.all(np.isfinite(b)) or np.any(b < 0):
            raise ValueError(f"local_batches must be finite and >= 0, got {b.tolist()}")
        return b

    def step_time(self, local_batches: npt.ArrayLike) -> float:
        """Predicted seconds of one synchronous step with these local batches (DESIGN §1)."""
        return float(np.max(self.node_times(local_batches)))

    def expected_step_time(self, local_batches: npt.ArrayLike) -> float:
        """Expected seconds of one step when each worker's compute is noisy (``noise``), and
        its CPU floor too (``cpu_noise``).

        The step ends with the slowest worker of that step, so at a balanced split the
        mean step time is the expected maximum of the workers' times, not the max of their
        means (12-26% more, measured on real 3-worker clusters). Worker i's time is the
        larger of its compute path and its CPU floor (:meth:`node_times`), each the median of
        a log-normal time (:func:`expected_max`), independent: the path's compute part
        with log spread ``noise_i`` (the communication left after its binding bucket is not
        its own noise), the floor with ``cpu_noise_i``. So the step is the expected maximum
        over every worker's path and floor; a worker far above its floor is as noisy as its
        compute, one far below it as its CPU. Equals :meth:`step_time` when nothing is
        noisy. A split with a worker at 0 is :attr:`with_idle`'s.
        """
        if self.idle_comm is not None and np.any(self._checked(local_batches) == 0):
            return self.with_idle.expected_step_time(local_batches)
        arr = self.arrays
        floor_noise = arr.floor_noise
        if not (np.any(arr.noise > 0) or (floor_noise is not None and np.any(floor_noise > 0))):
            return self.step_time(local_batches)
        batches = self._checked(local_batches)
        path, compute, row, x = arr.compute_paths(batches)
        if arr.noise_batch is not None:  # the spread measured there holds everywhere
            measured_at = np.where(np.isnan(arr.noise_batch), batches, arr.noise_batch)
            compute = arr.compute_paths(measured_at)[1]
        if arr.floor_rows is None:
            floors, floor_sigmas = np.empty(0), np.empty(0)
        else:  # the last column is the floors': a time of its own, with a noise of its own
            on = arr.floor_rows[row]
            assert floor_noise is not None
            floors, floor_sigmas = arr.floors(batches, row, x)[on], floor_noise[on]
        return expected_max(np.concatenate([path, floors]), np.concatenate([compute, floors]),
                            np.concatenate([arr.noise, floor_sigmas]))


@dataclass(frozen=True, eq=False)
class ClusterArrays:
    """A cluster as arrays of *rows*: on row r, at ``x`` samples past the row's ``start``,
    the time is ``max_j(offsets[r,j] + slopes[r,j]*x)``, for ``x`` in ``[lo[r], hi[r]]``.

    A worker that does not accumulate is one row (``start`` 0): ``offsets = R_j + f0 +
    rho_j*k0`` and ``slopes = f1 + rho_j*k1`` (shape (rows, m')), over the buckets that can
    bind (:meth:`CommModel.binding`), in ready order, so that consecutive columns are the
    envelope's consecutive pieces; ``hi`` is ``inf`` where uncapped. A worker with a
    ``micro_batch`` of c has one row per number of passes k, for its local batches
    ``b = (k-1)c + x`` in ``((k-1)c, kc]``: k-1 passes of full forward and backward
    (``F + S*m`` each, with ``F = f0 + k0`` and ``S = f1 + k1``) and a last one, of m
    samples, whose backward overlaps the all-reduce; with ``m = b/k`` that is
    ``(k-1)F + S*b*(k-1)/k + max_j(offset_j + slope_j*b/k)``, a max of lines in b again.
    A row past the first is worth using only once the one before it is full: its time at
    ``x = 0`` is above the previous row's at its top (each pass adds ``F`` and a slope no
    smaller), so the sum over rows of what each can take by a time t is the worker's.
    A worker with ``fixed_passes`` k is the same formula on one row from ``b = 0``.
    Where some worker has a ``cpu_floor`` (``floored``), every row has one more column
    after the buckets': that floor's line (``c0 + c1*b``, rising at least
    :data:`_FLOOR_SLOPE` of the row's slope), or for a worker without one a copy of its
    last bucket's line.
    """

    offsets: FloatArray
    slopes: FloatArray
    lo: FloatArray
    hi: FloatArray
    comm_left: FloatArray
    """``R_j`` of each binding bucket, shape (m',): the part of ``offsets`` that is not compute."""
    noise: FloatArray
    """Each worker's relative compute noise (:attr:`NodeModel.noise`), shape (n,)."""
    owner: npt.NDArray[np.intp]
    """The worker of each row, shape (rows,); rows of a worker are adjacent, by passes."""
    start: FloatArray
    """The local batch at which each row starts, shape (rows,): ``(k-1)*micro_batch``."""
    first_row: npt.NDArray[np.intp]
    """Each worker's first row, shape (n,)."""
    micro: FloatArray
    """Each worker's ``micro_batch`` (``inf`` where it does not accumulate), shape (n,)."""
    passes: npt.NDArray[np.intp]
    """Each worker's number of rows, shape (n,)."""
    floor_rows: BoolArray | None = None
    """The rows of workers with a CPU floor, shape (rows,); None when no worker has one.
    Otherwise the last column is the floors' (it may cross any bucket's line)."""
    idle_floor: FloatArray | None = None
    """Each worker's :attr:`NodeModel.cpu_idle`, the last column's value at 0 samples (NaN:
    the line's), shape (n,); None when no worker has one."""
    floor_noise: FloatArray | None = None
    """Each worker's :attr:`NodeModel.cpu_noise`, shape (n,); None where not :attr:`floored`."""
    noise_batch: FloatArray | None = None
    """Each worker's :attr:`NodeModel.noise_batch` (NaN: None), shape (n,); None where no
    worker has one."""
    idle_offsets: FloatArray | None = None
    """Each worker's bucket columns at 0 samples from its :attr:`NodeModel.idle_times`
    (``R_j + fwd + rho_j*bwd``; NaN: its line's), shape (n, m'); None when no worker has
    them."""

    @property
    def floored(self) -> bool:
        """Whether the last column is the CPU floors'."""
        return self.floor_rows is not None

    @property
    def is_first(self) -> BoolArray:
        """Rows that are a worker's first (the only ones a worker at 0 samples is on)."""
        first: BoolArray = self.start == 0
        return first

    @property
    def in_use(self) -> BoolArray:
        """Rows every split uses: a worker's first, and those its ``min_batch`` reaches."""
        used: BoolArray = self.is_first | (self.lo > 0)
        return used

    def rows_of(self, local_batches: FloatArray) -> tuple[npt.NDArray[np.intp], FloatArray]:
        """The row each worker's local batch falls on and its ``x`` there; the batches have
        shape (n,) or (n, T), and so do the results."""
        b = local_batches
        shape = (-1,) + (1,) * (b.ndim - 1)
        with np.errstate(invalid="ignore"):  # inf micro: one row
            k = np.where(np.isinf(self.micro.reshape(shape)), 1.0,
                         np.ceil(b / self.micro.reshape(shape)))
        k = np.clip(k, 1, self.passes.reshape(shape)).astype(np.intp)
        row = self.first_row.reshape(shape) + k - 1
        x: FloatArray = b - self.start[row]
        return row, x

    def compute_paths(self, local_batches: FloatArray) -> tuple[
        FloatArray, FloatArray, npt.NDArray[np.intp], FloatArray
    ]:
        """Each worker's path (its time without the CPU floor) at its local batch, shape
        (n,), the compute in it (the communication left after its binding bucket is not),
        and the rows and ``x`` the batches fall on (:meth:`rows_of`)."""
        lines, row, x = self._lines(local_batches)
        paths = lines if self.floor_rows is None else lines[:, :-1]
        binding = np.argmax(paths, axis=1)
        path: FloatArray = paths[np.arange(binding.size), binding]
        compute: FloatArray = np.maximum(path - self.comm_left[binding], 0.0)
        return path, compute, row, x

    def worker_times(self, local_batches: FloatArray) -> FloatArray:
        """Each worker's time at its local batch; (n,) or (n, T) as the batches."""
        lines = self._lines(local_batches)[0]
        if self.idle_floor is not None:
            lines[..., -1] = self._at_idle(local_batches, lines[..., -1])
        times: FloatArray = np.max(lines, axis=-1)
        return times

    def _lines(self, local_batches: FloatArray) -> tuple[
        FloatArray, npt.NDArray[np.intp], FloatArray
    ]:
        """Every column's value at the batches' rows (the bucket columns of a worker at 0
        samples from its :attr:`idle_offsets`), and the rows and ``x`` (:meth:`rows_of`)."""
        row, x = self.rows_of(local_batches)
        lines: FloatArray = self.offsets[row] + self.slopes[row] * x[..., None]
        if self.idle_offsets is None:
            return lines, row, x
        extra = (1,) * (local_batches.ndim - 1)
        idle = self.idle_offsets.reshape((self.idle_offsets.shape[0], *extra, -1))
        buckets = idle.shape[-1]
        at_zero = (local_batches == 0)[..., None] & np.isfinite(idle)
        lines[..., :buckets] = np.where(at_zero, idle, lines[..., :buckets])
        return lines, row, x

    def floors(self, local_batches: FloatArray, row: npt.NDArray[np.intp],
               x: FloatArray) -> FloatArray:
        """The last column (the CPU floors, where :attr:`floored`) at these batches, on
        their rows (:meth:`rows_of`): the idle floor where a worker has 0 samples."""
        floor: FloatArray = self.offsets[row, -1] + self.slopes[row, -1] * x
        return floor if self.idle_floor is None else self._at_idle(local_batches, floor)

    def _at_idle(self, local_batches: FloatArray, floor: FloatArray) -> FloatArray:
        """``floor`` (the last column's values) with each worker at 0 samples that has an
        :attr:`idle_floor` put on it."""
        assert self.idle_floor is not None
        idle = self.idle_floor.reshape((-1,) + (1,) * (local_batches.ndim - 1))
        at_idle: FloatArray = np.where((local_batches == 0) & np.isfinite(idle), idle, floor)
        return at_idle

    def worker_totals(self, rows: npt.ArrayLike) -> FloatArray:
        """Per-row amounts summed into per-worker local batches."""
        weights = np.asarray(rows, dtype=np.float64)
        totals = np.bincount(self.owner, weights=weights, minlength=self.noise.size)
        return totals.astype(np.float64)

    def row_amounts(self, local_batches: FloatArray) -> FloatArray:
        """Per-worker local batches spread over their rows, each row full before the next."""
        b = local_batches[self.owner]
        amounts: FloatArray = np.where(self.is_first, np.minimum(b, self.hi),
                                       np.clip(b - self.start, 0.0, self.hi))
        return amounts

    @staticmethod
    def of(cluster: ClusterModel) -> ClusterArrays:
        nodes = cluster.nodes
        # one row per node, read in one pass (a pass per field was ~0.9 ms at n = 1024)
        fields = np.array([(*n.fwd, *n.bwd, n.min_batch,
                            math.inf if n.max_batch is None else n.max_batch,
                            math.inf if n.micro_batch is None else n.micro_batch,
                            n.fixed_passes or 0, n.rows, n.noise,
                            *(n.cpu_floor or (math.nan, math.nan)),
                            math.nan if n.cpu_idle is None else n.cpu_idle, n.cpu_noise,
                            math.nan if n.noise_batch is None else n.noise_batch,
                            *(n.idle_times or (math.nan, math.nan)))
                           for n in nodes], dtype=np.float64)
        (f0, f1, k0, k1, lo_w, hi_w, micro, fixed_w, rows, noise, c0, c1, idle, cpu_noise,
         noise_batch, idle_fwd, idle_bwd) = fields.T
        binding = cluster.comm.binding()
        rho = cluster.comm.ready_fractions[binding]
        remaining = cluster.comm.remaining[binding]

        def at_buckets(fwd: FloatArray, bwd: FloatArray) -> FloatArray:
            """Each worker's time at each binding bucket, R_j + fwd + rho_j*bwd: (n, m')."""
            return remaining[None, :] + fwd[:, None] + rho[None, :] * bwd[:, None]

        offsets = at_buckets(f0, k0)
        idle_offsets = at_buckets(idle_fwd, idle_bwd) if np.any(np.isfinite(idle_fwd)) else None
        slopes = f1[:, None] + rho[None, :] * k1[:, None]
        passes = rows.astype(np.intp)
        owner = np.repeat(np.arange(len(nodes)), passes)
        first_row = (np.cumsum(passes) - passes).astype(np.intp)
        row_index = (np.arange(owner.size) - first_row[owner]).astype(np.float64)
        c = np.where(np.isinf(micro), 0.0, micro)[owner]
        start = row_index * c
        fixed = fixed_w[owner]
        k = np.where(fixed > 0, fixed, row_index + 1)  # passes of a row
        full = (f0 + k0)[owner][:, None]  # F: one pass's fixed time
        per_sample = (f1 + k1)[owner][:, None]  # S: one pass's time per sample
        kk = k[:, None]
        row_slopes = (per_sample * (kk - 1) + slopes[owner]) / kk
        row_offsets = offsets[owner] + (kk - 1) * full + row_slopes * start[:, None]
        top = np.minimum(np.where(passes[owner] > 1, k * c, np.inf), hi_w[owner])
        hi = top - start
        lo = np.clip(lo_w[owner] - start, 0.0, hi)  # rows below the minimum's are full
        has: BoolArray | None = None
        if np.any(np.isfinite(c0)):
            has = np.isfinite(c0)[owner]
            slope = np.maximum(c1[owner], _FLOOR_SLOPE * row_slopes.min(axis=1))
            row_offsets = np.column_stack([row_offsets, np.where(
                has, c0[owner] + slope * start, row_offsets[:, -1])])
            row_slopes = np.column_stack([row_slopes, np.where(has, slope, row_slopes[:, -1])])
            remaining = np.append(remaining, 0.0)  # no communication left after a floor
        return ClusterArrays(offsets=row_offsets, slopes=row_slopes, lo=lo, hi=hi,
                             comm_left=remaining, noise=noise, owner=owner, start=start,
                             first_row=first_row, micro=micro, passes=passes, floor_rows=has,
                             idle_floor=idle if np.any(np.isfinite(idle)) else None,
                             floor_noise=None if has is None else cpu_noise,
                             noise_batch=noise_batch if np.any(np.isfinite(noise_batch))
                             else None, idle_offsets=idle_offsets)


_FLOOR_SLOPE = 1e-6
"""A CPU floor's line rises at least this fraction of its worker's time per sample: the
planners invert every line, and a floor fitted flat (the same CPU at every batch) must stay
invertible without a slope so steep that summing the supply's slopes loses its digits."""

# The expected maximum integrates over the contenders' log-normal quantiles at this many
# standard normal deviates either side of their medians (probability < 1e-15 beyond),
# spaced evenly in the deviate (_QUANTILES of them each), and at most _GRID_POINTS of all
# of them, evenly by rank (many contenders' quantiles crowd where the density is), by
# Simpson's rule between them. The error against a 400 000-draw Monte Carlo is within its
# own, and against a single time's mean in closed form under 1e-4 (tests/test_perf.py).
_TAIL_SIGMAS = 8.0
_QUANTILES = 129
_GRID_POINTS = 129
_DEVIATES = np.linspace(-_TAIL_SIGMAS, _TAIL_SIGMAS, _QUANTILES)


def _normal_cdf(z: FloatArray) -> FloatArray:
    """Phi(z) to a relative error under 1.2e-7 (Numerical Recipes' erfc; numpy has none,
    and the planning code must not need scipy)."""
    x = np.abs(z) / math.sqrt(2.0)
    t = 1.0 / (1.0 + 0.5 * x)
    poly = -x * x - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))
    tail = 0.5 * t * np.exp(poly)  # Phi(-|z|)
    result: FloatArray = np.where(z < 0, tail, 1.0 - tail)
    return result


def expected_max(medians: npt.ArrayLike, scales: npt.ArrayLike, sigmas: npt.ArrayLike) -> float:
    """``E[max_i X_i]`` for independent ``X_i = medians_i + scales_i (exp(sigmas_i Z_i) - 1)``,
    ``Z_i`` standard normal: a time whose noisy part (``scales_i`` at its median) is
    log-normal, as a time measured in log ratios is, and the simulator draws it
    (:mod:`cannikin.sim.truth`). A time with scale or sigma 0 is constant.

    Right-skewed, so its mean lies above its median (``scales_i (exp(sigma^2/2) - 1)``) and
    its upper tail is longer than a normal's of the same sigma: where every time is a
    median (the robust fits' lines and the CPU levels' medians), a normal noise predicted
    the mean step of real quota workers 2-3% short.

    ``E[max] = lo + integral_lo^hi (1 - prod_i P(X_i <= t)) dt`` with ``lo`` the point
    below which the product is 0 (some time is surely later) and ``hi`` the one above which
    it is 1, by Simpson's rule between the contenders' quantiles (only times whose upper
    tail reaches past ``lo`` take part, so a large cluster with a few contenders costs
    little).
    """
    mid = np.asarray(medians, dtype=np.float64)
    scale = np.asarray(scales, dtype=np.float64)
    sigma = np.asarray(sigmas, dtype=np.float64)
    noisy = (scale > 0) & (sigma > 0)
    if not np.any(noisy):
        return float(np.max(mid))
    base = mid - scale  # X_i = base_i + scale_i exp(sigma_i Z_i)
    lo = float(np.max(np.where(noisy, base + scale * np.exp(-_TAIL_SIGMAS * sigma), mid)))
    contenders = noisy & (base + scale * np.exp(_TAIL_SIGMAS * sigma) > lo)
    if not np.any(contenders):
        return lo
    base, scale, sigma = base[contenders], scale[contenders], sigma[contenders]
    grid = (base[:, None] + scale[:, None] * np.exp(sigma[:, None] * _DEVIATES[None, :])).ravel()
    t = np.unique(np.append(grid[grid > lo], lo))
    if t.size > _GRID_POINTS:
        t = t[np.linspace(0, t.size - 1, _GRID_POINTS).round().astype(np.intp)]
    # Simpson's rule on each interval, through its midpoint
    nodes = np.empty(2 * t.size - 1)
    nodes[0::2], nodes[1::2] = t, (t[1:] + t[:-1]) / 2.0
    with np.errstate(divide="ignore"):  # at or below a base: probability 0
        ratio = np.maximum(nodes[:, None] - base[None, :], 0.0) / scale[None, :]
        z = np.log(ratio) / sigma[None, :]
    above = 1.0 - np.prod(_normal_cdf(z), axis=1)
    return lo + float(np.dot(above[0:-2:2] + 4.0 * above[1::2] + above[2::2], np.diff(t)) / 6.0)


@dataclass
class NodeFitter:
    """Learns one worker's :class:`NodeModel` from per-step samples, online.

    Keeps the last ``window`` accepted samples and fits them robustly (stragglers are
    rejected as outliers, :func:`cannikin.rowfit.robust_lines`). When a worker's speed
    changes, a change-point test on measured/predicted time finds the shift and the older
    samples are dropped: a 2x slowdown with 10% timing noise is followed to within 10% for
    good after 3-35 new samples (median 10 over 20 seeds, window 64; the window alone
    would need 46-63; ``tests/test_perf.py`` checks <= 36). Shifts under
    ``drift_min_change`` are absorbed as the window rolls over.

    Once a plan holds, the window fills with one or two batch sizes and forgets the
    warm-up's even split; a slope fitted to 1-2 samples under noise was 5-20x the truth on
    real workers, and the model then predicted the even split 13x too slow. So the latest
    ``level_samples`` measurements ``add``-ed with ``remember`` at each of up to ``levels``
    distinct batch sizes are kept too, and the median of every such batch size that the
    window no longer holds (with at least ``anchor_min_samples`` measurements) joins the
    fit as an anchor. A change of speed forgets the anchors with the older samples.

    Steps at 0 samples stay out of the lines: their latest ``idle_samples`` measurements
    give the model's :attr:`NodeModel.idle_times` (their medians, once
    ``anchor_min_samples`` are in). In the lines they set the intercept of a worker held
    at 0, and with a few samples near it its slope: on the quarter-core worker of
    ``bench_real`` 0.7-0.8 ms per sample against 0.27-0.34 between 4 and 160 samples.

    Before two distinct batch sizes are known the model is proportional to the
    measurements (``F(b) = F(b*) * b / b*``) or, once a two-size fit exists, that fit's
    shape rescaled to pass through the current measurements.

    A re-plan fits every worker at once with :func:`fit_nodes`; :meth:`fit` is that for one.
    """

    window: int = 64
    levels: int = 16
    """Distinct batch sizes remembered beyond the window (past it, the one adding the least
    spread is forgotten)."""
    level_samples: int = 9
    """Latest measurements kept per remembered batch size (their median is its anchor)."""
    anchor_min_samples: int = 3
    """Measurements a batch size needs before its median anchors the fit (a median of 3
    ignores one straggler)."""
    noise_min_samples: int = 8
    """Window samples needed to estimate the worker's timing noise (fewer: taken as exact)."""
    idle_samples: int = 16
    """Latest measurements at 0 samples whose medians are its :attr:`NodeModel.idle_times`:
    a change there is followed after 9, and a 25% noise is ~6% in their median."""
    config: FitConfig = field(default_factory=FitConfig)
    """How each line is fitted and a change of speed told."""
    _ring: FloatArray = field(init=False, repr=False)
    """The window's samples as columns (batch, fwd, bwd), a ring written twice over, so
    that ``[:, start:start + window]`` is the window in time order (zeros past the count):
    a re-plan copies every worker's in one slice each, no gather and no mask."""
    _start: int = field(default=0, init=False, repr=False)  # the oldest sample's row
    _count: int = field(default=0, init=False, repr=False)
    _levels: OrderedDict[float, deque[tuple[float, float]]] = field(init=False, repr=False)
    _idle: deque[tuple[float, float]] = field(init=False, repr=False)
    """The latest (fwd, bwd) measured at 0 samples."""
    _anchor_rows: FloatArray | None = field(default=None, init=False, repr=False)
    """Every remembered batch size's anchor row, until a measurement is remembered."""
    _shape: tuple[float, float, float, float] | None = field(default=None, init=False, repr=False)
    _fitted: tuple[tuple[str, int, int | None], NodeModel | None] | None = field(
        default=None, init=False, repr=False)
    """The last fit's arguments and result, until a sample arrives: a re-plan refits only
    the workers with new samples (an idle or unmeasured worker's fit is the same)."""

    def __post_init__(self) -> None:
        if not _is_int(self.window) or self.window < 2:
            raise ValueError(f"window={self.window!r} must be an integer >= 2")
        for name in ("levels", "level_samples", "anchor_min_samples", "noise_min_samples",
                     "idle_samples"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("level_samples", "idle_samples"):
            if self.anchor_min_samples > getattr(self, name):
                raise ValueError(f"anchor_min_samples={self.anchor_min_samples} exceeds "
                                 f"{name}={getattr(self, name)}")
        self._ring = np.zeros((3, 2 * self.window))
        self._levels = OrderedDict()
        self._idle = deque(maxlen=self.idle_samples)

    @property
    def num_samples(self) -> int:
        """Accepted samples currently in the window."""
        return self._count

    def samples(self) -> FloatArray:
        """The window's samples, oldest first: rows (batch, fwd, bwd)."""
        return self._ring[:, self._start:self._start + self._count].T.copy()

    def batch_sizes(self) -> list[float]:
        """The distinct batch sizes the next fit's lines rest on (the window's and the
        anchors'; 0 samples is :meth:`idle_times`)."""
        held = set(self.samples()[:, 0].tolist())
        return sorted(held | set(self._anchors(held)[:, 0].tolist()))

    def idle_times(self) -> tuple[float, float] | None:
        """Median forward and backward seconds of the latest steps at 0 samples (None
        before ``anchor_min_samples`` of them)."""
        if len(self._idle) < self.anchor_min_samples:
            return None
        return (statistics.median(f for f, _ in self._idle),
                statistics.median(k for _, k in self._idle))

    def level_count(self, batch: float) -> int:
        """Measurements remembered at ``batch`` (at most ``level_samples``)."""
        level = self._levels.get(float(batch))
        return 0 if level is None else len(level)

    def nearest_level(self, batch: float) -> float | None:
        """The remembered batch size nearest ``batch`` (None before any)."""
        return min(self._levels, key=lambda b: (abs(b - batch), b), default=None)

    def slope_error(self) -> float:
        """Relative standard error of the time per sample that the data alone give (no
        prior): ``inf`` without two distinct batch sizes. Least squares of the total time
        on the window and the anchors, each point's variance that of multiplicative noise
        (``(r * time)^2`` over its samples' worth, r the robust relative noise of the
        window's residuals): a far batch size measured a few times is worth less than
        its count says when its times are longer."""
        if not self._count:
            return math.inf
        data = self.samples()
        anchors = self._anchors(set(data[:, 0].tolist()))
        b = np.concatenate([data[:, 0], anchors[:, 0]])
        y = np.concatenate([data[:, 1] + data[:, 2], anchors[:, 1] + anchors[:, 2]])
        count = np.concatenate([np.ones(len(data)), anchors[:, 3]])
        if np.unique(b).size < 2 or not np.all(y > 0):
            return math.inf
        w = count / (y * y)  # inverse variances, up to the common factor r^2
        b_mean, y_mean = float(np.average(b, weights=w)), float(np.average(y, weights=w))
        sxx = float((w * (b - b_mean)) @ (b - b_mean))
        slope = float((w * (b - b_mean)) @ (y - y_mean)) / sxx
        fitted = y_mean + slope * (b - b_mean)
        if slope <= 0 or not np.all(fitted[: len(data)] > 0):
            return math.inf
        log_ratio = np.log(y[: len(data)] / fitted[: len(data)])
        r = 1.4826 * float(np.median(np.abs(log_ratio - np.median(log_ratio))))
        return r / math.sqrt(sxx) / slope

    def add(self, batch: float, fwd_s: float, bwd_s: float, remember: bool = False) -> bool:
        """Record one step's measurement; returns False (and logs) if it is rejected.

        ``remember``: also keep it beyond the window, as a measurement at its batch size
        (for batch sizes chosen regardless of the measurements: the warm-up's even split,
        a probe). Batch sizes a plan chose are not remembered: a plan keeps a worker's
        batch while its times look low, so their medians ran 10-15% fast in the planner
        tests. A step at 0 samples goes to :meth:`idle_times`, not the window. Rejected: a
        non-finite or negative batch or time. Never raises, so a bad timer reading cannot
        stop training.
        """
        values = (float(batch), float(fwd_s), float(bwd_s))
        if not all(math.isfinite(v) and v >= 0 for v in values):
            logger.warning(
                "rejected timing sample (batch=%r, fwd_s=%r, bwd_s=%r): values must be finite "
                "and >= 0", batch, fwd_s, bwd_s,
            )
            return False
        self._fitted = None
        if values[0] == 0:
            self._idle.append(values[1:])
            return True
        at = (self._start + self._count) % self.window
        self._ring[:, at] = self._ring[:, at + self.window] = values
        if self._count < self.window:
            self._count += 1
        else:
            self._start = (self._start + 1) % self.window
        if remember:
            self._remember(values)
        return True

    def _remember(self, values: tuple[float, float, float]) -> None:
        level = self._levels.get(values[0])
        if level is None:
            level = self._levels[values[0]] = deque(maxlen=self.level_samples)
            if len(self._levels) > self.levels:
                self._forget_a_level(keep=values[0])
        self._levels.move_to_end(values[0])
        level.append(values[1:])
        self._anchor_rows = None

    def _forget_a_level(self, keep: float) -> None:
        """Drop the remembered batch size that adds the least spread: the one nearest its
        neighbours (the least recently measured among equals), never ``keep`` nor the
        smallest or largest. The far ones carry the slope; evicting by age alone lost the
        warm-up's even split among 1-9 samples."""
        sizes = sorted(self._levels)
        gap = {b: min(b - lower, upper - b)
               for lower, b, upper in zip(sizes, sizes[1:], sizes[2:], strict=False)}
        gap.pop(keep, None)
        if not gap:
            del self._levels[next(b for b in self._levels if b != keep)]
            return
        nearest = min(gap.values())
        del self._levels[next(b for b in self._levels if gap.get(b) == nearest)]

    def _forget_oldest(self, count: int) -> None:
        """Drop the window's ``count`` oldest samples and every anchor (a change of speed)."""
        gone = (self._start + np.arange(count)) % self.window
        self._ring[:, gone] = self._ring[:, gone + self.window] = 0.0  # zeros past the count
        self._start = (self._start + count) % self.window
        self._count -= count
        self._levels.clear()
        self._anchor_rows = None

    def anchor_rows(self) -> FloatArray:
        """Rows (batch, median fwd, median bwd, weight) of every remembered batch size with
        at least ``anchor_min_samples`` measurements; a median of k normal samples is worth
        2k/pi of them (its variance)."""
        if self._anchor_rows is None:
            rows = [(b, statistics.median(f for f, _ in level),
                     statistics.median(k for _, k in level), 2 * len(level) / math.pi)
                    for b, level in self._levels.items() if len(level) >= self.anchor_min_samples]
            self._anchor_rows = np.array(rows, dtype=np.float64).reshape(-1, 4)
        return self._anchor_rows

    def _anchors(self, held: set[float]) -> FloatArray:
        """The anchor rows of the remembered batch sizes not in ``held``."""
        rows = self.anchor_rows()
        kept: FloatArray = rows[np.array([b not in held for b in rows[:, 0].tolist()],
                                         dtype=bool)]
        return kept

    def fit(self, name: str = "", min_batch: int = 1, max_batch: int | None = None) -> (
        NodeModel | None
    ):
        """The current model, or None before any sample with a non-zero batch.

        If the window shows a significant lasting shift in speed, the samples from before
        it (and the anchors) are forgotten first (the only state ``fit`` changes). Without
        a new sample since a fit that forgot nothing, that fit's model is returned as it is.
        """
        return fit_nodes([self], [name], [min_batch], [max_batch])[0]


def fit_nodes(fitters: Sequence[NodeFitter], names: Sequence[str],
              min_batches: Sequence[int], max_batches: Sequence[int | None]) -> (
    list[NodeModel | None]
):
    """Every fitter's :meth:`NodeFitter.fit` with its name and batch bounds, the refits
    done together (one numpy call per statistic over all workers with new samples)."""
    keys = list(zip(names, min_batches, max_batches, strict=True))
    if len(keys) != len(fitters):
        raise ValueError(f"{len(fitters)} fitters but {len(keys)} names and bounds")
    models: list[NodeModel | None] = [None] * len(fitters)
    stale: dict[tuple[int, FitConfig, int], list[int]] = {}  # alike windows stack together
    for i, (fitter, key) in enumerate(zip(fitters, keys, strict=True)):
        if fitter._fitted is not None and fitter._fitted[0] == key:
            models[i] = fitter._fitted[1]
        elif fitter.num_samples:
            alike = (fitter.window, fitter.config, fitter.noise_min_samples)
            stale.setdefault(alike, []).append(i)
    for rows in stale.values():
        refits = _refit([fitters[i] for i in rows], [keys[i] for i in rows], detect=True)
        for i, model in zip(rows, refits, strict=True):
            models[i] = model
    return models


def _windows(fitters: Sequence[NodeFitter]) -> tuple[FloatArray, FloatArray, BoolArray]:
    """The windows of fitters with one window length, oldest sample first: batch, forward
    and backward times (stacked, as the line fit takes them; 0 past a window's count) and
    which are samples."""
    width = fitters[0].window
    data = np.concatenate([f._ring[:, f._start:f._start + width] for f in fitters],
                          axis=1).reshape(3, len(fitters), width)  # a row at a time: 1.4x
    count = np.array([f._count for f in fitters])
    valid = np.arange(width)[None, :] < count[:, None]
    return data[0], data[1:], valid


def _log_ratio(lines: FloatArray, b: FloatArray, total: FloatArray) -> FloatArray:
    """log(measured / predicted) of each window sample under rows ``(f0, f1, k0, k1)``."""
    tiny = np.finfo(np.float64).tiny
    predicted = lines[:, 0:1] + lines[:, 2:3] + (lines[:, 1:2] + lines[:, 3:4]) * b
    ratio: FloatArray = np.log(np.maximum(total, tiny) / np.maximum(predicted, tiny))
    return ratio


def _refit(fitters: Sequence[NodeFitter], keys: Sequence[tuple[str, int, int | None]],
           detect: bool) -> list[NodeModel | None]:
    """The models of fitters that share a window length and a config. ``detect``: look for
    a change of speed (and if one is found forget the older samples and fit again)."""
    first = fitters[0]
    b, times, valid = _windows(fitters)
    anchors, anchored = _stacked_anchors(fitters, b, valid)
    # an anchor's batch size is one the window does not hold: either makes two sizes
    shaped = has_two_values(b, valid) | anchored.any(axis=1)
    params = _params(fitters, shaped, b, times, valid, anchors, anchored)
    log_ratio = _log_ratio(params, b, times[0] + times[1])
    spread = robust_spread(log_ratio, valid)
    shift = change_points(log_ratio, valid, first.config, spread) if detect else (
        np.zeros(len(fitters), dtype=np.intp))
    count = valid.sum(axis=1)
    noise = np.where(count >= first.noise_min_samples, spread[1], 0.0)
    # where the noise was measured: the window's mean batch (NodeModel.noise_batch)
    noise_batch = np.where(valid, b, 0.0).sum(axis=1) / np.maximum(count, 1)
    # rows a NodeModel would accept; any other goes through its checks (and their error)
    sound = ((np.isfinite(params) & (params >= 0)).all(axis=1) & np.isfinite(noise)
             & (noise >= 0)).tolist()
    templates: dict[tuple[object, ...], dict[str, object]] = {}  # by bounds: a checked model's
    models: list[NodeModel | None] = []
    for fitter, key, forget, line, two_sizes, sd, at, checked in zip(
            fitters, keys, shift.tolist(), params.tolist(), shaped.tolist(), noise.tolist(),
            noise_batch.tolist(), sound, strict=True):
        if forget:
            logger.info("node %r: speed changed %d samples ago; forgetting %d older samples",
                        key[0], fitter.num_samples - forget, forget)
            fitter._forget_oldest(forget)
            models.append(_refit([fitter], [key], detect=False)[0])
            continue
        model = None
        if not math.isnan(line[0]):
            if two_sizes:
                fitter._shape = tuple(line)
            bounds = (*key[1:], type(key[1]), type(key[2]))  # 1 == 1.0 == True: not alike
            template = templates.get(bounds) if checked else None
            if template is None:
                model = NodeModel(fwd=(line[0], line[1]), bwd=(line[2], line[3]), name=key[0],
                                  min_batch=key[1], max_batch=key[2], noise=sd,
                                  noise_batch=at if sd > 0 else None,
                                  idle_times=fitter.idle_times())
                templates.setdefault(bounds, vars(model))
            else:
                model = _model_like(template, line, key[0], sd, at if sd > 0 else None,
                                    fitter.idle_times())
        if detect:  # a fit that forgot nothing gives the same model until a sample arrives
            fitter._fitted = (key, model)
        models.append(model)
    return models


def _model_like(fields: dict[str, object], line: list[float], name: str, noise: float,
                noise_batch: float | None, idle_times: tuple[float, float] | None) -> NodeModel:
    """A :class:`NodeModel` with a checked model's ``fields`` but another fitted line (f0,
    f1, k0, k1), name, noise, noise_batch and idle_times, none of it checked again: the
    bounds passed ``NodeModel``'s checks, and the numbers are finite and >= 0 (the caller
    checks every row at once; times at 0 are medians of accepted samples). At n = 1024 the
    checks cost ~2.7 ms a re-plan, this ~0.6 ms (~0.9 ms with the fields passed as
    keywords)."""
    model = object.__new__(NodeModel)
    attrs = vars(model)
    attrs.update(fields)
    attrs["fwd"], attrs["bwd"] = (line[0], line[1]), (line[2], line[3])
    attrs["name"], attrs["noise"], attrs["noise_batch"] = name, noise, noise_batch
    attrs["idle_times"] = idle_times
    return model


def _stacked_anchors(fitters: Sequence[NodeFitter], b: FloatArray, valid: BoolArray) -> (
    tuple[FloatArray, BoolArray]
):
    """Every fitter's anchor rows, padded to one width, and which of them join its fit:
    those at a batch size its window does not hold."""
    rows = [f.anchor_rows() for f in fitters]
    lengths = np.array([len(r) for r in rows])
    present = np.arange(lengths.max()) < lengths[:, None]
    anchors = np.zeros((*present.shape, 4))
    anchors[present] = np.concatenate(rows)  # row by row, each padded after its own
    held = ((anchors[:, :, None, 0] == b[:, None, :]) & valid[:, None, :]).any(axis=2)
    return anchors, present & ~held


def _params(fitters: Sequence[NodeFitter], two_sizes: BoolArray, b: FloatArray,
            times: FloatArray, valid: BoolArray, anchors: FloatArray, anchored: BoolArray) -> (
    FloatArray
):
    """Rows ``(f0, f1, k0, k1)`` from the windows' batches and (forward, backward) times,
    NaN for a fitter without a non-zero batch: robust lines
    where the window and the anchors hold two batch sizes (``two_sizes``), else a level's
    medians through the last two-size fit's shape (or proportional to the batch)."""
    cfg = fitters[0].config
    params = np.full((len(fitters), 4), np.nan)
    lines = slice(None) if two_sizes.all() else np.flatnonzero(two_sizes)
    if two_sizes.any():
        intercept, slope = robust_lines(
            cfg, b[lines], times[:, lines], valid[lines],
            anchors[lines, :, 0], np.stack([anchors[lines, :, 1], anchors[lines, :, 2]]),
            anchors[lines, :, 3], anchored[lines])
        params[lines] = np.stack([intercept[0], slope[0], intercept[1], slope[1]], axis=1)
    levels = np.flatnonzero(~two_sizes)
    if levels.size:
        fwd_level, bwd_level = masked_median(times[:, levels], valid[levels]).tolist()
        for row, fwd_at, bwd_at in zip(levels.tolist(), fwd_level, bwd_level, strict=True):
            at, shape = float(b[row, 0]), fitters[row]._shape
            if shape is not None:
                f0, f1, k0, k1 = shape
                fs, ks = _rescale(fwd_at, f0 + f1 * at), _rescale(bwd_at, k0 + k1 * at)
                params[row] = (f0 * fs, f1 * fs, k0 * ks, k1 * ks)
            elif at > 0:
                params[row] = (0.0, fwd_at / at, 0.0, bwd_at / at)
    return params


def _rescale(measured: float, predicted: float) -> float:
    return measured / predicted if predicted > 0 else 1.0


class _CpuLevels(NamedTuple):
    """What :class:`CpuFitter` reads from its measurements, until the next one."""

    medians: dict[float, float]
    """The median CPU seconds at each batch size measured enough."""
    floor: dict[float, float]
    """The medians made non-decreasing in the batch size."""
    counts: dict[float, int]
    """The measurements at each."""
    noise: float
    """Their spread (:meth:`CpuFitter.noise`)."""


@dataclass
class CpuFitter:
    """One worker's CPU seconds per step (every thread) against its local batch, 0
    included: its CPU floor (:attr:`NodeModel.cpu_floor` and :attr:`NodeModel.cpu_idle`,
    once divided by its cores).

    The floor is the chord from the median CPU at the smallest to the median at the
    largest batch size measured at least ``min_samples`` times, in the window of the last
    ``window`` measured steps of the last ``span`` steps, or remembered (``add(...,
    remember=True)``: the warm-up's even split, probes; the latest ``level_samples`` at
    each of up to ``levels`` sizes). The span keeps the floor on the worker's present CPU
    where a held plan is measured every 16th step (:attr:`~cannikin.runtime.planner.
    PlannerConfig.max_measure_stride`): 64 measurements then reached 1000 steps back, and
    when the quarter-core worker's CPU at 0 samples crept from 7.0 to 9.0 ms over the last
    200 steps of a 900-step ``bench_prediction`` run the floor read 7.5-8.3 ms, the step
    predicted 7-12% short. A chord, not a
    fitted line: a worker's CPU per sample falls as its batch grows (a larger matrix
    product is cheaper per sample; on the quarter-core worker of ``bench_real`` 16.6 ms at
    0 samples, 22.5 at 28, 27.2 at 80, 30.4 at 160), so a least-squares line through the
    many steps at the split in use and a few far from it predicted 160 samples 27% high.
    The chord stays under every measurement between its ends, as a floor should, where
    the CPU per sample falls; where it grows, :meth:`floor_line` takes the levels' lower
    convex hull at the size in use.

    The chord's ends are read from the level medians made non-decreasing in the batch size
    (weighted by their samples; more samples cannot take less CPU): a level of a few
    early steps reads high (the warm-up's even split, on caches and allocators not yet
    warm: 23.3 ms of CPU at 160 samples against 21.4 at 162 and 20.8 at 177 later in one
    run of ``bench_real``), and as the chord's end it lifted the floor of every split.

    0 samples is a point of its own (no forward, no backward): always remembered, and the
    chord runs over the busy sizes where they span a factor of 2 or more or their medians
    resolve its slope, 0 being :meth:`idle` apart, and from 0 where they do not (sizes
    closer than that, 0 not among them, make no floor: :meth:`floor_line`). Through 0 the
    chord starts low and rises steeply, and under-predicts every small batch; without 0 it
    starts too high, and the planner saw no gain in giving the quarter-core worker of
    ``bench_real`` 0 samples over a few (Cannikin's own CPU per step there: 11.5-11.9 ms at
    0 samples, 13.2-13.5 at 16-19, in two runs).
    """

    window: int = 64
    span: int = 256
    levels: int = 16
    level_samples: int = 9
    min_samples: int = 3
    _recent: deque[tuple[int, float, float]] = field(init=False, repr=False)
    _remembered: OrderedDict[float, deque[float]] = field(init=False, repr=False)
    _read: _CpuLevels | None = field(default=None, init=False, repr=False)
    """The levels, as read since the last :meth:`add` (None: not read since). A re-plan
    reads them four times per worker, and every rank fits (only one decides): computed at
    each read, the floors took 3.0 ms of the fit's 3.3 ms of CPU on one core (three
    workers, ``tests/test_planner_model.py``'s), read once 1.4 of 1.7."""

    def __post_init__(self) -> None:
        for name in ("window", "span", "levels", "level_samples", "min_samples"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if self.levels < 2:
            raise ValueError(f"levels={self.levels} must be >= 2 (a chord has two ends)")
        self._recent = deque(maxlen=self.window)
        self._remembered = OrderedDict()

    @property
    def num_samples(self) -> int:
        """Steps in the window (the latest ``window``, whatever their age)."""
        return len(self._recent)

    def add(self, batch: float, cpu_s: float, remember: bool = False,
            step: int | None = None) -> bool:
        """Record one step's CPU, measured at step ``step`` (None: the step after the last
        one added); False (nothing kept) for a non-finite or negative value."""
        if not (math.isfinite(batch) and math.isfinite(cpu_s) and batch >= 0 and cpu_s >= 0):
            return False
        if step is None:
            step = self._recent[-1][0] + 1 if self._recent else 0
        self._recent.append((step, float(batch), float(cpu_s)))
        self._read = None
        if remember or batch == 0:
            level = self._remembered.get(float(batch))
            if level is None:
                level = self._remembered[float(batch)] = deque(maxlen=self.level_samples)
                if len(self._remembered) > self.levels:
                    ends = (min(self._remembered), max(self._remembered), float(batch))
                    del self._remembered[next(b for b in self._remembered if b not in ends)]
            self._remembered.move_to_end(float(batch))
            level.append(float(cpu_s))
        return True

    def _spanned(self) -> list[tuple[float, float]]:
        """The window's ``(batch, cpu_s)`` of its last ``span`` steps, oldest first."""
        latest = self._recent[-1][0] if self._recent else 0
        return [(batch, cpu) for step, batch, cpu in self._recent if step > latest - self.span]

    def _levels(self) -> _CpuLevels:
        """The levels as they stand (:class:`_CpuLevels`), computed once per :meth:`add`."""
        if self._read is None:
            self._read = self._measured_levels()
        return self._read

    def _measured_levels(self) -> _CpuLevels:
        """The measurements at each batch size measured at least ``min_samples`` times:
        the window's within its span, and the remembered sizes it does not hold enough of;
        their medians made non-decreasing in the batch size, weighted by their samples (see
        the class docstring); and their spread (:meth:`noise`)."""
        by_size: dict[float, list[float]] = {}
        for batch, cpu in self._spanned():
            by_size.setdefault(batch, []).append(cpu)
        levels = {b: v for b, v in by_size.items() if len(v) >= self.min_samples}
        for batch, level in self._remembered.items():
            if batch not in levels and len(level) >= self.min_samples:
                levels[batch] = list(level)
        medians = {b: statistics.median(v) for b, v in levels.items()}
        sizes = sorted(levels)
        fitted = _nondecreasing([medians[b] for b in sizes], [len(levels[b]) for b in sizes])
        deviations = [abs(math.log(cpu / medians[b])) for b, level in levels.items()
                      if medians[b] > 0 for cpu in level if cpu > 0]
        return _CpuLevels(medians=medians, floor=dict(zip(sizes, fitted, strict=True)),
                          counts={b: len(v) for b, v in levels.items()},
                          noise=1.4826 * statistics.median(deviations) if deviations else 0.0)

    def level_medians(self) -> dict[float, float]:
        """Median CPU seconds at each batch size measured at least ``min_samples`` times."""
        return dict(self._levels().medians)

    def _floor_levels(self) -> dict[float, float]:
        """:meth:`level_medians` made non-decreasing in the batch size, weighted by their
        samples (see the class docstring)."""
        return self._levels().floor

    def floor_line(self) -> tuple[float, float] | None:
        """``(c0, c1)``: CPU seconds at 0 samples and per sample along the chord; None
        before two batch sizes (0 and another, or two far enough apart) are measured enough.

        Closer ends make a chord of noise: on the half-core worker of a ``bench_real`` run,
        medians of 19.2 ms at 159 samples and 20.4 at 160 made one of 1.2 ms of CPU per
        sample (0.09 from 0 to 160); the model then predicted Cannikin's split 8.6x slower
        than it ran and planned that worker 0 samples. So the ends must be a factor of 2
        apart, or closer where their medians resolve the slope (:meth:`_resolves`): with
        the factor alone, on real quotas the full-core worker's 160 and 317 samples (1.98x)
        and the half-core worker's 117 and 173 made no floor, each in one ``bench_real
        --model transformer`` run, at a split where that worker's CPU per step was near
        its step.

        Where the CPU per sample grows with the batch instead (a small transformer: 10.7 ms
        at 106 samples, 15.5 at 165, 32.1 at 330 on one core), the chord runs over the
        sizes between its ends. When it runs over the size in use (:meth:`in_use`) by more
        than twice that level's standard error, the line is the lower convex hull's tangent
        there (of the chord's slope where it can be): under every level, through the one in
        use. On the half-core worker of ``bench_real --model transformer``, a probe at 330
        samples lifted the chord to 43% over the split in use, the model predicted that
        split 44% slow, and the planner left it for one 1.07x slower."""
        fitted = self._floor_levels()
        busy = [b for b in fitted if b > 0]
        ends = busy if len(busy) >= 2 and self._resolves(min(busy), max(busy)) else list(fitted)
        if len(ends) < 2 or not self._resolves(min(ends), max(ends)):
            return None
        lo, hi = min(ends), max(ends)
        slope = max((fitted[hi] - fitted[lo]) / (hi - lo), 0.0)
        in_use = self.in_use()
        if in_use is not None and lo < in_use[0] < hi and in_use[0] in fitted:
            batch, count = in_use
            level = fitted[batch]
            if fitted[lo] + slope * (batch - lo) - level > 2 * self._median_error(level, count):
                line = _tangent(sorted((b, fitted[b]) for b in ends), batch, slope)
                return line or (0.0, min(fitted[b] / b for b in ends if b > 0))
        return max(fitted[lo] - slope * lo, 0.0), slope

    def _resolves(self, lo: float, hi: float) -> bool:
        """Whether the levels at ``lo`` and ``hi`` (measured, ``lo < hi``) make a chord:
        a factor of 2 apart, or closer where their medians resolve its slope (its
        standard error, carried over ``hi`` samples, at most :data:`_CHORD_ERROR` of the
        floor there). Not the error alone: a probe's level holds 3-5 steps, and in a run of
        ``bench_real --model transformer`` the half-core worker's 160 and 350 samples and
        the quarter-core worker's 0, 25 and 160 then made no floor."""
        if hi >= 2 * lo:
            return True
        read = self._levels()
        errors = (self._median_error(read.floor[b], read.counts[b]) for b in (lo, hi))
        return math.hypot(*errors) * hi / (hi - lo) <= _CHORD_ERROR * read.floor[hi]

    def _median_error(self, level: float, count: int) -> float:
        """The standard error of a level's median, ``level`` CPU seconds over ``count``
        steps, at the pooled spread (:meth:`noise`)."""
        return _MEDIAN_ERROR * self.noise() * level / math.sqrt(count)

    def in_use(self) -> tuple[float, int] | None:
        """The busy batch size measured most often in the window's last ``span`` steps (the
        latest among equals) and how often: the split in use; None before one."""
        counts = Counter(batch for batch, _ in reversed(self._spanned()) if batch > 0)
        return counts.most_common(1)[0] if counts else None

    def idle(self) -> float | None:
        """CPU seconds at 0 samples (their median, under the busy sizes' if it was above
        them); None before it is measured ``min_samples`` times."""
        return self._floor_levels().get(0.0)

    def noise(self) -> float:
        """The spread of the CPU per step around its batch size's median, pooled over the
        batch sizes: 1.4826 times the median absolute deviation of the log ratio (robust
        to the odd stalled step; the standard deviation of a log-normal time's log); 0.0
        before a size is measured ``min_samples`` times. The floor's noise
        (:attr:`NodeModel.cpu_noise`)."""
        return self._levels().noise


_CHORD_ERROR = 0.1
"""How far a CPU floor's chord may be off, from its ends' noise alone, at its far end's batch
size (a fraction of the floor there). With a spread of 5% and 9 steps at each end, a chord
from 160 samples is off by 33% at 175, 8% at 240 and 5% at 317; from 159 to 160 (the case
of :meth:`CpuFitter.floor_line`, 1.5% and 30 and 9 steps) by 113%."""

_MEDIAN_ERROR = math.sqrt(math.pi / 2)
"""A median's standard error over the spread of the values it is taken of, times the root
of their count (normal values)."""


def _tangent(points: Sequence[tuple[float, float]], at: float,
             slope: float) -> tuple[float, float] | None:
    """``(c0, c1)``, both >= 0: a line under every point (sorted by x) that touches their
    lower convex hull at ``at``, strictly within their span: the hull's edge there, or where
    ``at`` is a vertex the slope nearest ``slope`` between its two edges' (any between them
    stays under; the mean of two edges, one between close sizes, was a slope of noise).
    None where no such line starts at 0 or above."""
    hull: list[tuple[float, float]] = []
    for x, y in points:
        while len(hull) >= 2 and ((hull[-1][0] - hull[-2][0]) * (y - hull[-2][1])
                                  - (hull[-1][1] - hull[-2][1]) * (x - hull[-2][0])) <= 0:
            hull.pop()
        hull.append((x, y))
    slopes = [(y2 - y1) / (x2 - x1) for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False)]
    right = next(i for i, (x, _) in enumerate(hull) if x >= at)
    x, y = hull[right]
    if x == at:  # steeper than y / x would start below 0
        low, high = slopes[right - 1], min(slopes[right], y / x)
        if low > high:
            return None
        slope = min(max(slope, low), high)
    else:
        slope = slopes[right - 1]
    return (y - slope * x, slope) if y - slope * x >= 0 else None


def _nondecreasing(values: Sequence[float], weights: Sequence[int]) -> list[float]:
    """The weighted least-squares non-decreasing fit to ``values`` (pool adjacent
    violators: each run that falls is replaced by its weighted mean)."""
    pools: list[tuple[float, int, int]] = []  # (value, weight, values pooled)
    for value, weight in zip(values, weights, strict=True):
        pools.append((value, weight, 1))
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            (v2, w2, c2), (v1, w1, c1) = pools.pop(), pools.pop()
            pools.append(((v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, c1 + c2))
    return [value for value, _, count in pools for _ in range(count)]


@dataclass
class CommFitter:
    """Learns the :class:`CommModel` from per-step bucket measurements (robust medians).

    Each sample holds, per bucket in ready order, the fraction of the backward done when
    it became ready and its all-reduce seconds. If the number of buckets changes (DDP
    rebuilds its buckets after the first step) the window restarts with the new layout.
    """

    window: int = 64
    _samples: deque[tuple[tuple[float, ...], tuple[float, ...]]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window={self.window!r} must be an integer >= 1")
        self._samples = deque(maxlen=self.window)

    @property
    def num_samples(self) -> int:
        """Accepted samples currently in the window."""
        return len(self._samples)

    def add(self, ready_fractions: Sequence[float], allreduce_s: Sequence[float]) -> bool:
        """Record one step; returns False (and logs) for a malformed sample, never raises."""
        rho = tuple(float(r) for r in ready_fractions)
        cost = tuple(float(c) for c in allreduce_s)
        valid = (
            len(rho) == len(cost) > 0
            and all(math.isfinite(r) and -1e-9 <= r <= 1 + 1e-9 for r in rho)
            and all(math.isfinite(c) and c >= 0 for c in cost)
        )
        if not valid:
            logger.warning(
                "rejected comm sample (ready_fractions=%r, allreduce_s=%r): need equal "
                "non-zero lengths, fractions in [0, 1], finite times >= 0",
                ready_fractions, allreduce_s,
            )
            return False
        if self._samples and len(self._samples[-1][0]) != len(rho):
            logger.debug("bucket count changed %d -> %d: comm window restarts",
                         len(self._samples[-1][0]), len(rho))
            self._samples.clear()
        self._samples.append((rho, cost))
        return True

    def fit(self) -> CommModel | None:
        """Median ready fraction and all-reduce time per bucket, or None before any sample."""
        if not self._samples:
            return None
        rho = np.median(np.array([s[0] for s in self._samples]), axis=0)
        cost = np.median(np.array([s[1] for s in self._samples]), axis=0)
        rho = np.maximum.accumulate(np.clip(rho, 0.0, 1.0))
        rho[-1] = 1.0
        return CommModel(buckets=[(float(r), float(c)) for r, c in zip(rho, cost, strict=True)])


@dataclass
class PredictionTracker:
    """How well the model predicts the steps it later observes.

    ``record`` each step's predicted and measured seconds; ``end_window`` at each re-plan.
    Per-step errors are noisy (timing CV 0.3-0.9 on shared cores); the window error
    ``|mean pred - mean meas| / mean meas`` is what the planner is accountable for.
    At most ``max_history`` errors of each kind are kept.
    """

    max_history: int = 100_000
    _steps: deque[float] = field(init=False, repr=False)
    _windows: deque[float] = field(init=False, repr=False)
    _pred_sum: float = field(default=0.0, init=False, repr=False)
    _meas_sum: float = field(default=0.0, init=False, repr=False)
    _count: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if not _is_int(self.max_history) or self.max_history < 1:
            raise ValueError(f"max_history={self.max_history!r} must be an integer >= 1")
        self._steps = deque(maxlen=self.max_history)
        self._windows = deque(maxlen=self.max_history)

    def record(self, predicted_s: float, measured_s: float) -> bool:
        """Add one step; returns False (and logs) unless both are finite and measured > 0."""
        pred, meas = float(predicted_s), float(measured_s)
        if not (math.isfinite(pred) and math.isfinite(meas) and pred >= 0 and meas > 0):
            logger.warning("rejected prediction sample (predicted_s=%r, measured_s=%r)",
                           predicted_s, measured_s)
            return False
        self._steps.append(abs(pred - meas) / meas)
        self._pred_sum += pred
        self._meas_sum += meas
        self._count += 1
        return True

    def end_window(self) -> None:
        """Close the current window (call at each re-plan); an empty window is ignored."""
        if self._count:
            self._windows.append((self._pred_sum - self._meas_sum) / self._meas_sum)
        self._pred_sum = self._meas_sum = 0.0
        self._count = 0

    def window_errors(self) -> list[float]:
        """Relative error of the mean prediction, per completed window."""
        return [abs(error) for error in self._windows]

    def signed_window_errors(self) -> list[float]:
        """``(mean pred - mean meas) / mean meas`` per completed window: below 0 where the
        model predicted the steps faster than they ran (a bias, where most are)."""
        return list(self._windows)

    def step_errors(self) -> list[float]:
        """``|pred - meas| / meas`` per recorded step."""
        return list(self._steps)

    def median_window_error(self) -> float:
        """Median of :meth:`window_errors`; NaN when there is none."""
        return float(np.median(self.window_errors())) if self._windows else math.nan

    def median_step_error(self) -> float:
        """Median of :meth:`step_errors`; NaN when there is none."""
        return float(np.median(self._steps)) if self._steps else math.nan
