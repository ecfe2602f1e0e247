"""Goodput and the choice of the total batch size (DESIGN.md §3).

A larger total batch B finishes an epoch in fewer, longer steps but makes less progress
per sample: with gradient noise scale ``phi`` (per-sample ``tr(Sigma) / |G|^2``) the
statistical efficiency relative to the initial batch ``B0`` is
``E(B) = (phi + B0) / (phi + B)``, and ``goodput(B) = B * E(B) / T*(B)`` with ``T*`` the
OptPerf step time. No grid: the continuous ``T*`` is piecewise linear in B, and on a
piece ``T = p + q*B`` the goodput ``~ B / ((phi + B)(p + q*B))`` peaks at
``B = sqrt(phi*p/q)``. The best per-piece peaks, split in integers, give a goodput that
the integer maximiser must reach; since integer step times are never below the
continuous ones, the maximiser lies where the continuous goodput reaches it too (a
quadratic inequality per piece), and every integer total there is evaluated exactly
with one sort (:meth:`~cannikin.optperf.Splitter.step_times`). With R rows of
:class:`~cannikin.perf.ClusterArrays` (one per worker, or per number of passes where a
worker accumulates) and m' binding buckets, the cost is O(R m' log(R m')) for the curve,
at most five integer splits (two seeds, the first total of the scan, the best, the
current one; a total is split once), and O((L + R) log(L + R)) time and O(L + R) memory
for the L totals in that range, which is narrow except on very flat goodput curves (L is
capped at ``MAX_SCAN``); stragglers do not widen it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from cannikin.optperf import Plan, Splitter, StepTimeCurve, share_split
from cannikin.perf import ClusterModel, FloatArray, _is_int

logger = logging.getLogger(__name__)

# The best continuous candidates split in integers to bound the integer optimum from below.
_SEEDS = 2
# Relative slack on that bound so rounding (of the continuous curve, accurate to ~1e-9
# relative even for 12 orders of magnitude between slopes) cannot exclude the maximiser.
_REACH_SLACK = 1e-6
# At most this many integer totals are evaluated; a wider candidate range (a goodput
# curve flat to ~1e-6, e.g. B up to 1e9 with infinite noise) is scanned around the best
# peak, which is then within one sample's cost of the exact maximiser rather than exact.
MAX_SCAN = 1 << 18


def _check_noise_scale(noise_scale: float | None) -> float:
    if noise_scale is None:
        raise ValueError("noise_scale=None: the noise scale is not estimated yet (no step "
                         "with two gradient groups); keep the initial batch size until it is")
    phi = float(noise_scale)
    if math.isnan(phi) or phi < 0:
        raise ValueError(
            f"noise_scale={noise_scale!r} must be >= 0 (inf allowed: pure noise); before the "
            "first estimate keep the initial batch size"
        )
    return phi


def _check_batch_range(init_batch: int, max_batch: int) -> None:
    if not _is_int(init_batch) or init_batch < 1:
        raise ValueError(f"init_batch={init_batch!r} must be an integer >= 1")
    if not _is_int(max_batch) or max_batch < init_batch:
        raise ValueError(f"max_batch={max_batch!r} must be an integer >= init_batch={init_batch}")


def _efficiency(total: FloatArray, init_batch: float, phi: float) -> FloatArray:
    if math.isinf(phi):
        return np.ones_like(total)
    result: FloatArray = (phi + init_batch) / (phi + total)
    return result


def efficiency(total_batch: float, init_batch: float, noise_scale: float) -> float:
    """Statistical efficiency ``(phi + B0) / (phi + B)`` of ``total_batch`` vs ``init_batch``.

    1.0 at ``B = B0``; per-sample progress relative to training at B0 (AdaScale gain over
    scale). ``noise_scale`` is in per-sample units (``tr(Sigma) / |G|^2``). It lies between
    ``B0/B`` (no noise) and 1 (pure noise) either way: below 1 for ``B > B0``, above for
    ``B < B0`` (an epoch's final partial batch).
    """
    phi = _check_noise_scale(noise_scale)
    for name, value in (("total_batch", total_batch), ("init_batch", init_batch)):
        if not (math.isfinite(float(value)) and float(value) > 0):
            raise ValueError(f"{name}={value!r} must be finite and > 0")
    return float(_efficiency(np.array([float(total_batch)]), float(init_batch), phi)[0])


@dataclass(frozen=True)
class BatchChoice:
    """The chosen total batch, its optimal split, and its goodput (samples/s at B0 rate)."""

    total_batch: int
    plan: Plan
    goodput: float
    efficiency: float


def _choice(plan: Plan, init_batch: int, phi: float) -> BatchChoice:
    eff = float(_efficiency(np.array([float(plan.total_batch)]), init_batch, phi)[0])
    return BatchChoice(total_batch=plan.total_batch, plan=plan,
                       goodput=plan.total_batch * eff / plan.step_time, efficiency=eff)


def _curve_time(curve: StepTimeCurve, batch: FloatArray) -> FloatArray:
    inside: FloatArray = np.interp(batch, curve.batch, curve.time)
    past = np.maximum(batch - curve.batch[-1], 0.0)
    with np.errstate(invalid="ignore"):  # inf slope (capped) times 0 past the end
        beyond = curve.time[-1] + past * curve.slope_beyond
    result: FloatArray = np.where(past > 0, beyond, inside)
    return result


def _pieces(curve: StepTimeCurve, lo: int, hi: int) -> tuple[FloatArray, FloatArray,
                                                              FloatArray, FloatArray]:
    """``T* = p + q*B`` on each piece ``[left, right]`` of the curve inside ``[lo, hi]``."""
    inner = curve.batch[(curve.batch > lo) & (curve.batch < hi)]
    ends = np.unique(np.concatenate([[float(lo)], inner, [float(hi)]]))
    if ends.size == 1:
        ends = np.array([float(lo), float(hi)])
    times = _curve_time(curve, ends)
    left, right = ends[:-1], ends[1:]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(right > left, np.diff(times) / (right - left), 0.0)
    return left, right, times[:-1] - q * left, q


def _piece_peaks(pieces: tuple[FloatArray, ...], phi: float) -> FloatArray:
    """Each piece's continuous goodput maximiser, clipped to the piece."""
    left, right, p, q = pieces
    with np.errstate(divide="ignore", invalid="ignore"):
        peak = np.sqrt(phi * p / q) if math.isfinite(phi) else np.full_like(p, np.inf)
    # p <= 0: goodput falls along the piece; q == 0 (flat): it rises to the right end.
    peak = np.where(p <= 0, left, np.where(q <= 0, right, peak))
    result: FloatArray = np.clip(peak, left, right)
    return result


def _reach(pieces: tuple[FloatArray, ...], phi: float, init_batch: int,
           floor: float) -> tuple[float, float]:
    """Smallest and largest B whose *continuous* goodput is >= ``floor``.

    The integer step time is never below the continuous one, so no total outside this
    range can beat a candidate whose integer goodput is ``floor``. Per piece,
    ``B*E(B) >= floor*(p + q*B)`` is a quadratic inequality in B.
    """
    left, right, p, q = pieces
    if math.isfinite(phi):
        # floor*q*B^2 + (floor*(p + q*phi) - (phi + B0))*B + floor*phi*p <= 0
        a2, a1, a0 = floor * q, floor * (p + q * phi) - (phi + init_batch), floor * phi * p
    else:
        # B >= floor*(p + q*B)
        a2, a1, a0 = np.zeros_like(q), floor * q - 1.0, floor * p
    with np.errstate(divide="ignore", invalid="ignore"):
        disc = np.sqrt(np.maximum(a1 * a1 - 4 * a2 * a0, 0.0))
        quad_lo = np.where(a2 > 0, (-a1 - disc) / (2 * a2), -np.inf)
        quad_hi = np.where(a2 > 0, (-a1 + disc) / (2 * a2), np.inf)
        root = -a0 / a1
    # linear case (a2 == 0): a1*B + a0 <= 0
    lin_lo = np.where(a1 < 0, root, -np.inf)
    lin_hi = np.where(a1 > 0, root, np.inf)
    low = np.maximum(left, np.where(a2 > 0, quad_lo, lin_lo))
    high = np.minimum(right, np.where(a2 > 0, quad_hi, lin_hi))
    ok = low <= high
    if not np.any(ok):
        return float(np.min(left)), float(np.max(right))
    return float(np.min(low[ok])), float(np.max(high[ok]))


def choose_batch_size(
    cluster: ClusterModel,
    noise_scale: float,
    init_batch: int,
    max_batch: int,
    current: int | None = None,
    min_gain: float = 0.05,
) -> BatchChoice:
    """The total batch in ``[init_batch, max_batch]`` with the highest goodput.

    Each candidate is split optimally (:func:`~cannikin.optperf.optimal_split`); the
    range is narrowed to what the workers' min/max batches allow. With ``current`` given,
    the choice moves away from it only if that gains more than ``min_gain`` (relative),
    so noise in the estimates does not make the batch size flap.
    """
    phi = _check_noise_scale(noise_scale)
    _check_batch_range(init_batch, max_batch)
    if current is not None and not _is_int(current):
        raise ValueError(f"current={current!r} must be None or an integer total batch")
    if not float(min_gain) >= 0:
        raise ValueError(f"min_gain={min_gain!r} must be >= 0 (inf: never move from current)")
    splitter = Splitter(cluster)
    curve = splitter.curve
    lo = max(int(init_batch), math.ceil(curve.min_total))
    hi = int(max_batch) if math.isinf(curve.max_total) else min(int(max_batch),
                                                                 math.floor(curve.max_total))
    if lo > hi:
        raise ValueError(
            f"no total batch in [init_batch={init_batch}, max_batch={max_batch}] fits the "
            f"workers' bounds [{curve.min_total:g}, {curve.max_total:g}] (sum of min_batch, "
            "sum of max_batch)"
        )
    pieces = _pieces(curve, lo, hi)
    peaks = _piece_peaks(pieces, phi)
    totals = np.unique(np.clip(np.concatenate([np.floor(peaks), np.ceil(peaks)]), lo, hi))
    continuous = totals * _efficiency(totals, init_batch, phi) / _curve_time(curve, totals)
    seeds = [_choice(splitter.split(int(totals[k])), init_batch, phi)
             for k in np.argsort(-continuous, kind="stable")[:_SEEDS]]
    floor = max(c.goodput for c in seeds) * (1.0 - _REACH_SLACK)
    first, last = _reach(pieces, phi, init_batch, floor)
    first, last = max(lo, math.floor(first) - 1), min(hi, math.ceil(last) + 1)
    if last - first + 1 > MAX_SCAN:
        logger.debug("goodput is flat over [%d, %d]: scanning %d totals around the peak",
                     first, last, MAX_SCAN)
        centre = max(seeds, key=lambda c: c.goodput).total_batch
        start = min(max(first, centre - MAX_SCAN // 2), last - MAX_SCAN + 1)
        first, last = start, start + MAX_SCAN - 1
    batch = np.arange(first, last + 1, dtype=np.float64)
    goodput = batch * _efficiency(batch, init_batch, phi) / splitter.step_times(first, last)
    best = _choice(splitter.split(first + int(np.argmax(goodput))), init_batch, phi)
    if current is None:
        return best
    if not lo <= current <= hi:
        logger.debug("current batch %s is outside [%d, %d]: moving to %d",
                     current, lo, hi, best.total_batch)
        return best
    stay = _choice(splitter.split(current), init_batch, phi)
    if best.goodput > stay.goodput * (1.0 + min_gain):
        return best
    return stay


def choose_even_batch_size(
    cluster: ClusterModel,
    noise_scale: float,
    init_batch: int,
    max_batch: int,
    current: int | None = None,
    min_gain: float = 0.05,
) -> BatchChoice:
    """AdaptDL's policy, the baseline: the total batch in ``[init_batch, max_batch]`` with
    the highest goodput when every total is split evenly (as far as the workers' caps
    allow, :func:`~cannikin.optperf.share_split`), so the step time is the even split's,
    not OptPerf's. ``current`` and ``min_gain`` as in :func:`choose_batch_size`. Every
    total T in the range is evaluated: O(n T) time and memory with every worker uncapped,
    and a water-filling share per total (O(n) per capped worker filled) with caps.
    """
    phi = _check_noise_scale(noise_scale)
    _check_batch_range(init_batch, max_batch)
    n = cluster.size
    caps = [nd.max_batch for nd in cluster.nodes]
    room = sum(c for c in caps if c is not None) if None not in caps else max_batch
    floor = sum(nd.min_batch for nd in cluster.nodes)
    lo, hi = max(init_batch, floor), min(max_batch, room)
    if lo > hi:
        raise ValueError(f"no total batch in [init_batch={init_batch}, max_batch={max_batch}] "
                         f"fits the workers' bounds [{floor}, {room}]")
    totals = np.arange(lo, hi + 1)
    if all(c is None for c in caps):  # b_i = B // n, the first B % n one more
        splits = totals[None, :] // n + (np.arange(n)[:, None] < totals[None, :] % n)
    else:
        splits = np.array([share_split(int(t), np.ones(n), caps) for t in totals]).T
    times = np.max(cluster.node_times(splits), axis=0)
    goodput = totals * _efficiency(totals.astype(np.float64), init_batch, phi) / times
    k = int(np.argmax(goodput))
    if current is not None and lo <= current <= hi:
        stay = current - lo
        if not goodput[k] > goodput[stay] * (1.0 + min_gain):
            k = stay
    split = tuple(int(b) for b in splits[:, k])
    plan = Plan(local_batches=split, step_time=float(times[k]))
    return _choice(plan, init_batch, phi)
