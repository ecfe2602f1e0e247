"""OptPerf: the split of a total batch that minimises the predicted step time (DESIGN.md §2).

Worker i's time at local batch b is ``tau_i(b) = max_j (d_ij + a_ij * b)`` (convex,
increasing; ``d``/``a`` from :class:`~cannikin.perf.ClusterArrays`). The step takes
``max_i tau_i(b_i)``. Its inverse ``beta_i(t)`` (the most worker i can take by time t) is
concave piecewise linear, so the total it can absorb, ``S(t) = sum_i clip(beta_i(t), lo_i,
hi_i)``, is piecewise linear with breakpoints that are known in closed form: where
``tau_i`` reaches ``lo_i`` or ``hi_i`` and where two of its lines cross. Sorting those
breakpoints gives ``S`` (and its inverse, the continuous optimum ``T*(B)``) exactly; the
integer split is the floor of the continuous one plus a greedy hand-out of the remaining
units to whichever worker would finish its extra sample first, which is exact for a
min-max of increasing per-worker costs.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from cannikin.perf import ClusterArrays, ClusterModel, CommModel, FloatArray, _is_int

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Plan:
    """Local batch per worker (in node order) and the step time the model predicts for it."""

    local_batches: tuple[int, ...]
    step_time: float

    @property
    def total_batch(self) -> int:
        """Sum of the local batches."""
        return sum(self.local_batches)


@dataclass(frozen=True, eq=False)
class StepTimeCurve:
    """The continuous optimal step time ``T*(B)`` (the LP bound of §2) as a function of B.

    Piecewise linear and convex between the breakpoints ``(batch[k], time[k])``; beyond
    the last breakpoint it rises with slope ``slope_beyond`` (seconds per sample) up to
    ``max_total`` (the sum of the caps; ``inf`` when some worker is uncapped). The integer
    optimum of :func:`optimal_split` is at most one sample's cost above it.
    """

    batch: FloatArray
    time: FloatArray
    slope_beyond: float
    max_total: float

    @property
    def min_total(self) -> float:
        """Sum of the workers' minimum batches: the smallest feasible total."""
        return float(self.batch[0])

    def __call__(self, total_batch: float) -> float:
        """``T*(total_batch)``; ValueError outside ``[min_total, max_total]``."""
        b = float(total_batch)
        if not self.min_total <= b <= self.max_total:
            raise ValueError(
                f"total_batch={total_batch!r} is outside the feasible range "
                f"[{self.min_total:g}, {self.max_total:g}] (sum of min_batch, sum of max_batch)"
            )
        if b > self.batch[-1]:
            return float(self.time[-1] + (b - self.batch[-1]) * self.slope_beyond)
        return float(np.interp(b, self.batch, self.time))


def checked_arrays(cluster: ClusterModel) -> ClusterArrays:
    """The cluster's arrays, after checking every worker gets slower with more samples."""
    arr = cluster.arrays
    bad = np.argwhere(arr.slopes <= 0)
    if bad.size:
        row, j = (int(v) for v in bad[0])
        i = int(arr.owner[row])
        node = cluster.nodes[i]
        raise ValueError(
            f"node {i} ({node.name!r}): time per sample f1 + rho_j*k1 = {arr.slopes[row, j]:g} "
            f"for bucket {j} must be > 0 (fwd={node.fwd}, bwd={node.bwd})"
        )
    return arr


def _per_worker(values: FloatArray, like: FloatArray) -> FloatArray:
    """Reshape per-worker ``values`` (n,) or (n, m) to broadcast against ``like[..., None]``."""
    if like.ndim == 1:
        return values
    extra = (1,) * (like.ndim - 1)
    shape = (values.shape[0], *extra, values.shape[1]) if values.ndim == 2 else (
        values.shape[0], *extra)
    return values.reshape(shape)


def _times(arr: ClusterArrays, batches: FloatArray) -> FloatArray:
    """``tau_i(batches_i)``: worker i's finishing time; ``batches`` has shape (n,) or (n, k)."""
    offsets, slopes = _per_worker(arr.offsets, batches), _per_worker(arr.slopes, batches)
    result: FloatArray = np.max(offsets + slopes * batches[..., None], axis=-1)
    return result


def _supply(arr: ClusterArrays, t: FloatArray) -> FloatArray:
    """``clip(beta_i(t_i), lo_i, hi_i)``: what worker i can take by time t; t is (n,) or (n, k)."""
    offsets, slopes = _per_worker(arr.offsets, t), _per_worker(arr.slopes, t)
    beta = np.min((t[..., None] - offsets) / slopes, axis=-1)
    result: FloatArray = np.clip(beta, _per_worker(arr.lo, t), _per_worker(arr.hi, t))
    return result


@dataclass(frozen=True, eq=False)
class _Breakpoints:
    """``S(t)`` at its sorted breakpoints ``times``, and its slope after the last one."""

    times: FloatArray
    supply: FloatArray
    slope_after: FloatArray  # dS/dt just after each breakpoint
    t_min: float  # max_i tau_i(lo_i): no split finishes sooner


def _breakpoints(arr: ClusterArrays) -> _Breakpoints:
    """Sort every worker's kinks of ``clip(beta_i)`` and sweep ``S(t)`` across them.

    Worker i's kinks are at ``tau_i(lo_i)``, ``tau_i(hi_i)`` and ``tau_i`` where two
    consecutive binding buckets' lines cross inside ``(lo_i, hi_i)``, or a bucket's line
    and the CPU floor's (a crossing below the envelope is one more point, harmless).
    Between its own kinks its supply is linear, so its slope changes only there; the sweep
    adds up those changes in time order and integrates. O(R m' log(R m')) for R rows of
    :class:`~cannikin.perf.ClusterArrays` (one per worker, or per number of passes where a
    worker accumulates micro-batches) and m' binding buckets.
    """
    n, m = arr.slopes.shape
    lo_t = _times(arr, arr.lo)
    capped = np.isfinite(arr.hi)
    hi_t = np.where(capped, _times(arr, np.where(capped, arr.hi, arr.lo)), np.inf)
    columns = [lo_t[:, None], hi_t[:, None]]
    if m > 1:
        j = np.arange(m - 1)
        k = j + 1
        if arr.floored:  # the last column, a CPU floor, may cross any bucket's line
            j, k = np.append(j, np.arange(m - 2)), np.append(k, np.full(m - 2, m - 1))
        da = arr.slopes[:, j] - arr.slopes[:, k]
        with np.errstate(divide="ignore", invalid="ignore"):
            cross = (arr.offsets[:, k] - arr.offsets[:, j]) / da
        inside = (da != 0) & (cross > arr.lo[:, None]) & (cross < arr.hi[:, None])
        cross = np.where(inside, cross, arr.lo[:, None])
        cross_t = np.where(inside, _times(arr, cross), np.inf)
        columns.append(cross_t)
    cand = np.sort(np.concatenate(columns, axis=1), axis=1)
    finite = np.isfinite(cand)
    value = _supply(arr, np.where(finite, cand, 0.0))  # values past the last kink unused
    final = np.where(np.isinf(arr.hi), 1.0 / np.max(arr.slopes, axis=1), 0.0)
    both = finite[:, :-1] & finite[:, 1:]
    with np.errstate(invalid="ignore", divide="ignore"):
        dt = np.diff(cand, axis=1)
        seg = np.where(both & (dt > 0), np.diff(value, axis=1) / dt, 0.0)
    seg = np.where(finite[:, :-1] & ~finite[:, 1:], final[:, None], seg)
    last = np.where(finite[:, -1], final, 0.0)
    after = np.concatenate([seg, last[:, None]], axis=1)
    before = np.concatenate([np.zeros((n, 1)), seg], axis=1)
    times = cand[finite]
    delta = (after - before)[finite]
    order = np.argsort(times, kind="stable")
    times, delta = times[order], delta[order]
    # Slope changes of +-1/a for a fast worker dwarf the others; summing them in extended
    # precision (where the platform has it) keeps the small slopes between them accurate.
    wide = np.cumsum(delta.astype(np.longdouble))
    wide[-1] = np.sum(final)  # exact: the uncapped workers' asymptotic slopes
    wide = np.maximum(wide, 0)
    supply = (float(np.sum(arr.lo)) + np.concatenate(
        [[0.0], np.cumsum(wide[:-1] * np.diff(times).astype(np.longdouble))]
    )).astype(np.float64)
    slope_after = wide.astype(np.float64)
    return _Breakpoints(times=times, supply=supply, slope_after=slope_after,
                        t_min=float(np.max(lo_t[arr.in_use])))


def _curve(arr: ClusterArrays, bp: _Breakpoints) -> StepTimeCurve:
    start = int(np.searchsorted(bp.times, bp.t_min, side="left"))
    batch = np.concatenate([[float(np.sum(arr.lo))], bp.supply[start:]])
    time = np.concatenate([[bp.t_min], bp.times[start:]])
    max_total = float(np.sum(arr.hi))
    if math.isfinite(max_total):
        batch[-1] = max_total  # the last breakpoint is t_max, where every worker is capped
    keep = np.concatenate([[True], np.diff(batch) > 0])
    final = float(bp.slope_after[-1])
    return StepTimeCurve(
        batch=batch[keep], time=time[keep],
        slope_beyond=1.0 / final if final > 0 else math.inf,
        max_total=max_total,
    )


def step_time_curve(cluster: ClusterModel) -> StepTimeCurve:
    """``T*(B)``, the continuous optimum, for every feasible B at once: O(R m' log(R m'))
    for R rows and m' binding buckets (:func:`_breakpoints`)."""
    arr = checked_arrays(cluster)
    return _curve(arr, _breakpoints(arr))


def _check_total(arr: ClusterArrays, total_batch: int) -> None:
    if not _is_int(total_batch):
        raise ValueError(f"total_batch={total_batch!r} must be an integer")
    lo, hi = float(np.sum(arr.lo)), float(np.sum(arr.hi))
    if total_batch < lo:
        raise ValueError(
            f"total_batch={total_batch} is below the sum of the workers' min_batch ({lo:g}); "
            f"valid: {lo:g} <= total_batch <= {hi:g}"
        )
    if total_batch > hi:
        raise ValueError(
            f"total_batch={total_batch} exceeds the sum of the workers' max_batch ({hi:g}); "
            f"valid: {lo:g} <= total_batch <= {hi:g}"
        )


def _continuous(arr: ClusterArrays, bp: _Breakpoints, total: float) -> FloatArray:
    """A continuous split of ``total`` with every worker finishing by ``T*(total)``.

    The accumulated breakpoint supplies only locate the linear piece; the split itself
    comes from ``S`` evaluated directly at the piece's ends, so rounding does not build up.
    """
    n = arr.lo.size
    lo_sum = float(np.sum(arr.lo))
    at_min = _supply(arr, np.full(n, bp.t_min))
    if float(np.sum(at_min)) >= total:
        # T* = t_min (the slowest worker's minimum): any split under at_min will do.
        spare = float(np.sum(at_min)) - lo_sum
        scale = (total - lo_sum) / spare if spare > 0 else 0.0
        result: FloatArray = arr.lo + (at_min - arr.lo) * scale
        return result
    k = min(max(int(np.searchsorted(bp.supply, total, side="left")) - 1, 0), bp.times.size - 1)
    t0 = max(float(bp.times[k]), bp.t_min)
    have0 = float(np.sum(_supply(arr, np.full(n, t0))))
    if k + 1 < bp.times.size:
        t1 = float(bp.times[k + 1])
        have1 = float(np.sum(_supply(arr, np.full(n, t1))))
        frac = min(max((total - have0) / (have1 - have0), 0.0), 1.0) if have1 > have0 else 1.0
        t_star = t0 + frac * (t1 - t0)
    else:
        final = float(bp.slope_after[-1])
        t_star = t0 + max(total - have0, 0.0) / final if final > 0 else t0
    return _supply(arr, np.full(n, t_star))


def _units_by(arr: ClusterArrays, base: IntArray, room: FloatArray, t: float) -> IntArray:
    """How many of its next ``room`` samples beyond ``base`` each worker finishes by ``t``.

    Counted as :func:`_times` evaluates them (so ties and rounding fall exactly as a heap of
    finishing times would pop them): the inverse ``beta_i(t)`` gives the count up to the
    digits lost when a slope is tiny next to its offset, and forward evaluations at the
    count's edge correct it (a unit or two, and only then).
    """
    with np.errstate(invalid="ignore"):  # inf - inf for a worker with no room
        beta = np.min((t - arr.offsets) / arr.slopes, axis=1)
    counts: IntArray = np.clip(np.floor(beta) - base, 0, room).astype(np.int64)
    while True:
        more = (counts < room) & (_times(arr, (base + counts + 1).astype(np.float64)) <= t)
        fewer = (counts > 0) & (_times(arr, (base + counts).astype(np.float64)) > t)
        if not (np.any(more) or np.any(fewer)):
            return counts
        counts += more.astype(np.int64) - fewer.astype(np.int64)


def _cheapest(arr: ClusterArrays, base: IntArray, count: int) -> tuple[IntArray, FloatArray]:
    """The ``count`` samples beyond ``base`` that finish first: each one's worker and
    finishing time, in finishing order (ties: the lower worker first).

    What popping a heap of next-sample finishing times ``count`` times gives, in O(count + n)
    memory however many samples a fast worker could finish by then: a bisection on the time
    ``t`` finds one by which at least ``count`` and at most ``count + n`` samples finish
    (no worker counts more than ``count``); those alone are listed and sorted. Costs
    O(R m') per bisection step for R rows and m' binding buckets (none in issue 17's
    straggler choices of ``benchmarks/bench_planner.py``, 15 for its straggler split; at
    most the ~60-100 halvings down to adjacent floats) plus O((count + R) log(count + R)).
    The total must fit the caps (``sum(hi - base) >= count``).
    """
    if count <= 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0)
    n = base.size
    room = np.minimum(arr.hi - base, float(count))  # no worker gives more than count
    has_room = room >= 1
    first = np.where(has_room, _times(arr, (base + 1).astype(np.float64)), np.inf)
    if count <= int(np.sum(has_room)):
        hi = float(np.partition(first, count - 1)[count - 1])  # count first samples by then
    else:  # every worker's room by then: sum(room) >= count
        hi = float(np.max(np.where(has_room, _times(arr, (base + room).astype(np.float64)),
                                  -np.inf)))
    lo = float(np.nextafter(np.min(first), -np.inf))  # nothing finishes by lo
    counts = _units_by(arr, base, room, hi)
    while int(counts.sum()) > count + n:
        mid = lo + 0.5 * (hi - lo)
        if not lo < mid < hi:
            break  # adjacent floats: hi is the count-th time, at most n samples tie at it
        at_mid = _units_by(arr, base, room, mid)
        if int(at_mid.sum()) >= count:
            hi, counts = mid, at_mid
        else:
            lo = mid
    worker = np.repeat(np.arange(n), counts)
    step = np.arange(worker.size) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    finish = np.max(arr.offsets[worker] + arr.slopes[worker] * (base[worker] + step)[:, None],
                    axis=1)
    order = np.lexsort((worker, finish))[:count]
    return worker[order], finish[order]


def _hand_out(arr: ClusterArrays, base: IntArray, remaining: int) -> IntArray:
    """Give ``remaining`` single samples, each to the worker that would finish it first
    (:func:`_cheapest`)."""
    taken, _ = _cheapest(arr, base, remaining)
    result: IntArray = base + np.bincount(taken, minlength=base.size)
    return result


def _integer_split(arr: ClusterArrays, bp: _Breakpoints, total_batch: int) -> Plan:
    """The floor of the continuous split, then single samples to whoever finishes them
    first. Per worker, not per row: a worker's rows are filled in order before the
    hand-out (the continuous split may spread a worker's batch over rows otherwise where
    their times tie), so each row's next sample is the worker's next one."""
    lo = arr.worker_totals(arr.lo)
    cont = arr.worker_totals(_continuous(arr, bp, float(total_batch)))
    base = np.maximum(np.floor(cont), lo).astype(np.int64)
    while int(base.sum()) > total_batch:  # only after float slack: undo the latest finisher
        over = np.where(base > lo, arr.worker_times(base.astype(np.float64)), -np.inf)
        base[int(np.argmax(over))] -= 1
    rows = arr.row_amounts(base.astype(np.float64)).astype(np.int64)
    local = arr.worker_totals(_hand_out(arr, rows, total_batch - int(base.sum())))
    step = float(np.max(arr.worker_times(local)))
    return Plan(local_batches=tuple(local.astype(np.int64).tolist()), step_time=step)


def optimal_split(cluster: ClusterModel, total_batch: int) -> Plan:
    """The integer split of ``total_batch`` with the smallest predicted step time.

    Honours each node's ``min_batch``/``max_batch``; ValueError if ``total_batch`` is not
    an integer in ``[sum min_batch, sum max_batch]`` or a node's time per sample is not
    positive. Deterministic: equal inputs give equal plans on every rank.
    """
    arr = checked_arrays(cluster)
    _check_total(arr, total_batch)
    return _integer_split(arr, _breakpoints(arr), int(total_batch))


class Splitter:
    """:func:`optimal_split` for many totals on one cluster, sharing the breakpoint sort."""

    def __init__(self, cluster: ClusterModel) -> None:
        self.cluster = cluster
        self._arr = checked_arrays(cluster)
        self._bp = _breakpoints(self._arr)
        self.curve = _curve(self._arr, self._bp)
        self._plans: dict[int, Plan] = {}

    def split(self, total_batch: int) -> Plan:
        """Same result as ``optimal_split(self.cluster, total_batch)``, each total split once
        (the goodput choice splits its best total again, often a seed's: ~1 ms at n = 1024)."""
        _check_total(self._arr, total_batch)
        plan = self._plans.get(int(total_batch))
        if plan is None:
            plan = self._plans[int(total_batch)] = _integer_split(self._arr, self._bp,
                                                                   int(total_batch))
        return plan

    def step_times(self, first: int, last: int) -> FloatArray:
        """The optimal integer step time of every total in ``[first, last]``, exactly.

        From the optimal split of ``first`` (all its samples finish by ``T1``), the
        optimum of ``first + k`` is ``max(T1, c_k)`` with ``c_k`` the k-th smallest
        finishing time among the samples not yet handed out (:func:`_cheapest`). With
        L = last - first, R rows and m' binding buckets: the split of ``first`` and then
        O((L + R) log(L + R)) time and O(L + R) memory, plus O(R m') per bisection step
        (see :func:`_cheapest`), however fast a worker is.
        """
        _check_total(self._arr, first)
        _check_total(self._arr, last)
        if last < first:
            raise ValueError(f"last={last} must be >= first={first}")
        start = self.split(first)
        rows = self._arr.row_amounts(np.array(start.local_batches, dtype=np.float64))
        _, finish = _cheapest(self._arr, rows.astype(np.int64), last - first)
        return np.concatenate([[start.step_time], np.maximum(start.step_time, finish)])


def zero_split(cluster: ClusterModel, total_batch: int, expected: bool = False,
               optimal: Plan | None = None) -> Plan:
    """:func:`optimal_split`, where a worker may also get 0 samples when the step is faster.

    A worker with no samples still joins the all-reduce and the update, so it still takes
    its fixed time ``tau_i(0)``; when that is below the optimum its ``min_batch`` forces,
    dropping it to 0 lets the others finish sooner (on real 100/50/25% CPU workers the best
    split gave the slowest none). Allowed batches are ``{0} U [min_batch, max_batch]``.
    Only a plan with some worker at its lower bound can gain, so any other plan is
    returned as it is. With ``min_batch <= 1`` everywhere the result is exact (it is the
    optimum over ``[0, max_batch]``); with larger minima (a non-convex set), workers the
    zero-floored optimum gives fewer than their minimum get 0 and the rest are split again
    until none is short (never worse than :func:`optimal_split`; exact in 343 of the 354
    enumerated cases with minimum 2 of ``tests/test_optperf.py``). The workers given 0 are
    left out of the split of the rest, so when one's fixed time sets the step the others
    are still balanced among themselves (by the max of the means any split under it would
    do, and a stale model of the idle worker then left the others at 1.24x their best).
    Compares predicted step times (:meth:`ClusterModel.step_time`), or with ``expected``
    the expected ones of noisy workers (:meth:`ClusterModel.expected_step_time`: a worker
    at a few samples still adds its noise to the step's maximum). A total below the sum of
    the minima is split with zeros. ``optimal``: ``optimal_split(cluster, total_batch)``
    where the caller has it already (a re-plan does).

    Where a step with an idle worker has an all-reduce of its own
    (:attr:`ClusterModel.idle_comm`), a plan with no worker at its minimum can gain from
    0 too: the busy worker with the fewest samples is then dropped, one at a time, while
    the step gets faster (:func:`_dropping_the_least`).
    """
    plan = _floored(cluster, total_batch, expected, optimal)
    if cluster.idle_comm is None:
        return plan
    return _dropping_the_least(cluster, total_batch, expected, plan)


def _floored(cluster: ClusterModel, total_batch: int, expected: bool,
             optimal: Plan | None) -> Plan:
    """:func:`zero_split` with the all-reduce of every split the same."""
    nodes = cluster.nodes
    plan = None
    if _is_int(total_batch) and total_batch >= sum(n.min_batch for n in nodes):
        plan = optimal if optimal is not None else optimal_split(cluster, total_batch)
        if not any(0 < b == n.min_batch for b, n in zip(plan.local_batches, nodes, strict=True)):
            return plan
    dropped: set[int] = set()  # workers planned 0
    while True:
        rest = [i for i in range(len(nodes)) if i not in dropped]
        sub = ClusterModel(nodes=[dataclasses.replace(nodes[i], min_batch=0) for i in rest],
                           comm=cluster.with_idle.comm if dropped else cluster.comm,
                           idle_comm=cluster.idle_comm)
        try:
            part = optimal_split(sub, total_batch)
        except ValueError:  # the others cannot hold the batch without the dropped workers
            if plan is None:
                raise
            return plan
        # below the minimum (0 included): 0 for good, and the rest split again among
        # themselves; when a dropped worker's fixed time sets the step, any split of the
        # others under it is as fast by the max of the means, and this balances them
        short = {i for i, b in zip(rest, part.local_batches, strict=True)
                 if b < max(nodes[i].min_batch, 1)}
        if not short:
            break
        dropped |= short
    local = [0] * len(nodes)
    for i, b in zip(rest, part.local_batches, strict=True):
        local[i] = b
    floored = Plan(local_batches=tuple(local), step_time=cluster.step_time(local))
    if plan is None:
        return floored
    if expected:
        better = (cluster.expected_step_time(list(floored.local_batches))
                  < cluster.expected_step_time(list(plan.local_batches)))
    else:
        better = floored.step_time < plan.step_time
    return floored if better else plan


def _dropping_the_least(cluster: ClusterModel, total_batch: int, expected: bool,
                        plan: Plan) -> Plan:
    """``plan`` with the busy worker of the fewest samples given 0 (the others split again),
    one at a time, while the (expected) step gets faster."""
    def time_of(candidate: Plan) -> float:
        if expected:
            return cluster.expected_step_time(list(candidate.local_batches))
        return candidate.step_time

    current = time_of(plan)
    while True:
        busy = [i for i, b in enumerate(plan.local_batches) if b > 0]
        if len(busy) < 2:
            return plan
        least = min(busy, key=lambda i: plan.local_batches[i])
        idle = {i for i, b in enumerate(plan.local_batches) if b == 0} | {least}
        try:
            candidate = split_without(cluster, total_batch, idle)
        except ValueError:  # the others cannot hold the batch
            return plan
        faster = time_of(candidate)
        if not faster < current:
            return plan
        plan, current = candidate, faster


def split_without(cluster: ClusterModel, total_batch: int, idle: Collection[int]) -> Plan:
    """The workers in ``idle`` get 0 samples, the others ``total_batch`` split optimally
    within their bounds; the step time counts the idle workers' fixed time too (they still
    join the all-reduce). ValueError if no worker is left or the rest cannot hold it."""
    rest = [i for i in range(cluster.size) if i not in idle]
    if not rest:
        raise ValueError(f"idle={sorted(idle)} leaves none of the {cluster.size} workers")
    part = optimal_split(ClusterModel(nodes=[cluster.nodes[i] for i in rest],
                                      comm=cluster.with_idle.comm if idle else cluster.comm),
                         total_batch)
    local = [0] * cluster.size
    for i, b in zip(rest, part.local_batches, strict=True):
        local[i] = b
    return Plan(local_batches=tuple(local), step_time=cluster.step_time(local))


def without_worker(cluster: ClusterModel, rank: int) -> ClusterModel:
    """The cluster with worker ``rank`` gone: its node dropped and each all-reduce time
    that of a step with a worker idle (:attr:`ClusterModel.idle_comm`: the others reduce
    among themselves, a little less without the send to it) or, without one, scaled as a
    ring all-reduce's, whose per-rank traffic is ``2(n-1)/n`` of the gradient (a single
    worker communicates nothing). ``rank`` must be a valid index and the cluster must have
    >= 2 workers."""
    n = cluster.size
    if n < 2 or not 0 <= rank < n:
        raise ValueError(f"rank={rank!r} must index one of n={n} >= 2 workers")
    scale = ((n - 2) / (n - 1)) / ((n - 1) / n)
    comm = cluster.idle_comm or CommModel(
        buckets=[(rho, c * scale) for rho, c in cluster.comm.buckets])
    return ClusterModel(nodes=[nd for i, nd in enumerate(cluster.nodes) if i != rank], comm=comm)


@dataclass(frozen=True)
class CostlyWorker:
    """A worker planned 0 samples whose fixed time or all-reduce share still slows the step:
    the step time predicted with it (its plan) and without it (the same total, split
    optimally over the others, zeros allowed)."""

    rank: int
    step_time: float
    without_step_time: float

    @property
    def cost_s(self) -> float:
        """Seconds per step it costs."""
        return self.step_time - self.without_step_time

    @property
    def speedup(self) -> float:
        """How many times faster the step would be without it."""
        return self.step_time / self.without_step_time


def costly_workers(cluster: ClusterModel, plan: Plan,
                   min_speedup: float = 1.01) -> tuple[CostlyWorker, ...]:
    """The workers ``plan`` gives 0 samples that the step would be faster without.

    Listed when the step would be at least ``min_speedup`` times faster without the worker
    alone (the ring all-reduce of one rank fewer saves a fraction of a percent in large
    clusters: not worth a word). Both sides are :meth:`ClusterModel.expected_step_time`
    (the noise-aware prediction; the max of the means for noise-free models). A worker
    whose removal leaves the total beyond the others' caps is not listed.
    """
    if cluster.size < 2 or 0 not in plan.local_batches:
        return ()
    with_it = cluster.expected_step_time(list(plan.local_batches))
    found = []
    for rank, b in enumerate(plan.local_batches):
        if b != 0:
            continue
        rest = without_worker(cluster, rank)
        caps = [nd.max_batch for nd in rest.nodes]
        if None not in caps and sum(c for c in caps if c is not None) < plan.total_batch:
            continue
        if sum(nd.min_batch for nd in rest.nodes) > plan.total_batch:
            continue
        split = zero_split(rest, plan.total_batch)
        without = rest.expected_step_time(list(split.local_batches))
        if with_it >= min_speedup * without:
            found.append(CostlyWorker(rank=rank, step_time=with_it, without_step_time=without))
    return tuple(found)


def share_split(total_batch: int, weights: npt.ArrayLike,
                caps: Sequence[int | None] | None = None, minimum: int = 0) -> tuple[int, ...]:
    """``minimum`` samples each, the rest in proportion to ``weights``, none above its cap.

    The one even/proportional rule (the baselines, the warm-up's even split, the
    simulator's policies): a worker whose share would pass its cap (``None``: uncapped)
    is pinned there and the rest shared again among the others (water-filling); shares are
    rounded by largest remainder, ties to the lower rank. Weights are floored at 1e-12 so
    a zero weight still gets its minimum; a cap below ``minimum`` wins over it. O(n) per
    round of pinning, at most one round per capped worker. ValueError unless ``minimum * n
    <= total_batch <= sum(caps)``.
    """
    w = np.maximum(np.asarray(weights, dtype=np.float64), 1e-12)
    n = w.size
    cap = np.full(n, np.inf) if caps is None else np.array(
        [np.inf if c is None else c for c in caps], dtype=np.float64)
    if cap.shape != (n,):
        raise ValueError(f"caps {list(caps or [])} need one entry per weight ({n})")
    if not _is_int(total_batch) or not minimum * n <= total_batch <= float(cap.sum()):
        raise ValueError(f"cannot split total_batch={total_batch!r} over {n} workers: it "
                         f"must be an integer in [{minimum} x {n}, sum of the caps "
                         f"{float(cap.sum()):g}]")
    out = np.full(n, float(minimum))
    free = np.ones(n, dtype=bool)
    while True:  # water-fill: workers whose share exceeds their cap are pinned there
        left = total_batch - out[~free].sum()
        with np.errstate(invalid="ignore"):  # 0/0 once the caps hold everything
            share = minimum + (left - minimum * free.sum()) * w / w[free].sum()
        share[~free] = out[~free]
        over = free & (share > cap)
        if not over.any():
            break
        out[over] = cap[over]
        free &= ~over
    base = np.minimum(np.where(free, np.floor(share), out), cap)
    remainder = np.where(free, share - np.floor(share), -1.0)
    base[np.argsort(-remainder, kind="stable")[: total_batch - int(base.sum())]] += 1
    return tuple(int(v) for v in base)


def even_split(cluster: ClusterModel, total_batch: int) -> Plan:
    """The homogeneous baseline (DDP, AdaptDL): equal shares, ignoring speeds and caps."""
    if not _is_int(total_batch) or total_batch < 0:
        raise ValueError(f"total_batch={total_batch!r} must be an integer >= 0")
    local = share_split(total_batch, np.ones(cluster.size))
    return Plan(local_batches=local, step_time=cluster.step_time(local))


def proportional_split(
    cluster: ClusterModel, total_batch: int, throughput: Sequence[float] | None = None
) -> Plan:
    """The LB-BSP-style baseline: shares proportional to each worker's throughput.

    ``throughput`` (samples/s, one per node) defaults to each node's modelled throughput
    at the even share (at least one sample), ``(B/n) / tau_i(B/n)``. Caps are not
    enforced.
    """
    n = cluster.size
    if not _is_int(total_batch) or total_batch < 0:
        raise ValueError(f"total_batch={total_batch!r} must be an integer >= 0")
    if throughput is None:
        even = np.full(n, max(total_batch / n, 1.0))
        speed = even / cluster.node_times(even)
    else:
        speed = np.asarray(throughput, dtype=np.float64)
        if speed.shape != (n,) or not np.all(np.isfinite(speed)) or np.any(speed <= 0):
            raise ValueError(f"throughput must be {n} finite values > 0, got {throughput!r}")
    local = share_split(total_batch, speed)
    return Plan(local_batches=local, step_time=cluster.step_time(local))
