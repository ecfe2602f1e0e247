"""Robust line fits, change points and noise levels for many workers at once, one per row.

A re-plan refits every worker; at n = 1024 a per-worker loop of small numpy calls cost
~0.55 ms each. Here each statistic is one numpy call over a (workers, samples) array,
with a mask for the rows' different sample counts (inside, a missing sample is NaN: a
sort puts it last and the arithmetic carries it, with no masked copies): a worker's fit
(:class:`cannikin.perf.NodeFitter`) is a batch of one, so the rule exists once. The rule
that a shift of speed is real, :func:`lasting_shift`, is the planner's too.
Torch-free.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, overload

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from cannikin.perf import FitConfig

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]
IntArray = npt.NDArray[np.intp]

# Relative tolerance added to the robust scale so exact (noise-free) samples are inliers.
SCALE_FLOOR = 1e-9
LEAST_TIME_FRACTION = 0.05
"""Where a line runs near 0 (a small batch on a worker without a fixed cost), a sample's
deviation is taken relative to this fraction of the row's mean time instead."""
_TINY = float(np.finfo(np.float64).tiny)
_PAIR_SHIFT = 2
# Most values in one (series, workers, points) array of the line fit, which fits its rows
# in blocks of at most this many: at n = 1024 (2 series, 65 points) one block took
# 16.5 ms, two of 512 rows 11.9 ms, three 12.4 ms, eight 15.0 ms alone (thread CPU time on
# this project's 2-core machine, whose cores have 2 MB of cache each). Within
# bench_planner's whole run three blocks (~0.35 MB arrays) made half the page faults of
# two and re-planned 1.5-2 ms faster.
_BLOCK_VALUES = 1 << 16


def masked_median(x: FloatArray, mask: BoolArray) -> FloatArray:
    """The median along the last axis of the masked-in values (NaN where there are none):
    the same value as ``np.median`` of them. ``mask`` broadcasts against ``x``."""
    masked = np.where(mask, x, np.nan)
    masked.sort(axis=-1)
    return _median_of_sorted(masked, mask.sum(axis=-1))


def _median_of_low(x: FloatArray, count: IntArray) -> FloatArray:
    """The median of the ``count`` lowest values along the last axis of ``x``, the others
    being NaN or +inf (a sort puts both last: a missing sample is NaN, so that arithmetic
    carries it instead of a mask); ``count`` broadcasts against ``x.shape[:-1]``."""
    return _median_of_sorted(np.sort(x, axis=-1), count)


def _median_of_sorted(ordered: FloatArray, count: IntArray) -> FloatArray:
    """:func:`_median_of_low` of values already sorted along the last axis."""
    width = ordered.shape[-1]
    flat = ordered.reshape(-1)
    count = np.broadcast_to(count, ordered.shape[:-1]).reshape(-1)
    base = np.arange(count.size) * width
    lo = flat[base + np.maximum((count - 1) // 2, 0)]
    hi = flat[base + np.minimum(count // 2, width - 1)]
    with np.errstate(invalid="ignore"):
        median: FloatArray = np.where(count > 0, (lo + hi) / 2, np.nan).reshape(
            ordered.shape[:-1])
    return median


def has_two_values(x: FloatArray, mask: BoolArray) -> BoolArray:
    """Whether the masked-in values along the last axis hold two different values: whether
    any differs from the first one (boolean passes, cheaper than a masked min and max)."""
    mask = np.broadcast_to(mask, np.broadcast_shapes(x.shape, mask.shape))
    first = np.take_along_axis(np.broadcast_to(x, mask.shape), mask.argmax(axis=-1)[..., None],
                               axis=-1)
    two: BoolArray = (mask & (x != first)).any(axis=-1)
    return two


def robust_lines(cfg: FitConfig, b: FloatArray, y: FloatArray, valid: BoolArray,
                 anchor_b: FloatArray, anchor_y: FloatArray, anchor_weight: FloatArray,
                 anchor_valid: BoolArray) -> tuple[FloatArray, FloatArray]:
    """``(intercept, slope)`` of ``y = intercept + slope*b`` fitted robustly, per row of ``b``
    (workers, samples) and per series of ``y`` (series, workers, samples): a worker's
    forward and backward times share its batch sizes. Each row's samples (``valid``) and
    anchors (``anchor_b``, ``anchor_y``, ``anchor_weight``, ``anchor_valid``; shaped as
    ``b`` and ``y``) together hold >= 2 distinct batch sizes.

    Outliers (stragglers) are samples whose deviation relative to the line lies beyond
    ``cfg.outlier_sigmas`` robust standard deviations of the row's (:func:`_inliers`), told
    in two rounds: first from a cheap robust line
    (:func:`_pair_slope`), then from the line fitted to the first round's inliers. The
    least-squares fit to the second round's inliers, its slope shrunk toward the
    proportional model (:func:`shrunk_lines`), is the estimate. Slope and intercept are
    kept >= 0 (physical times), refitting through the origin when the intercept would be
    negative. Anchors (medians at batch sizes the window no longer holds, see
    :class:`cannikin.perf.NodeFitter`; each worth ``anchor_weight`` samples) join the
    least squares but are never outliers: they are robust already, and a line from a
    narrow window would reject the far ones that carry the slope.

    Theil-Sen over all n^2/2 pairs as the only round was the rule before; at n = 1024
    workers its pairs alone cost ~100 ms a re-plan. The pairs' line alone moved more from
    one re-plan to the next under 25% noise (a held split changed 30 times in 500 steps,
    12-18 with Theil-Sen); the second round brings it back (planner runs over 20-30 seeds:
    the same plan quality and fit errors as Theil-Sen's).

    Rows are fitted in blocks of ``_BLOCK_VALUES`` (each row alone: the same result).
    """
    values = y.shape[0] * b.shape[0] * (b.shape[-1] + anchor_b.shape[-1])
    blocks = -(-values // _BLOCK_VALUES)
    if blocks <= 1:
        return _robust_lines_block(cfg, b, y, valid, anchor_b, anchor_y, anchor_weight,
                                   anchor_valid)
    rows = -(-b.shape[0] // blocks)  # as even as can be
    lines = [_robust_lines_block(cfg, b[block], y[:, block], valid[block], anchor_b[block],
                                 anchor_y[:, block], anchor_weight[block], anchor_valid[block])
             for block in (slice(start, start + rows) for start in range(0, b.shape[0], rows))]
    intercept, slope = (np.concatenate(part, axis=-1) for part in zip(*lines, strict=True))
    return intercept, slope


def _robust_lines_block(cfg: FitConfig, b: FloatArray, y: FloatArray, valid: BoolArray,
                        anchor_b: FloatArray, anchor_y: FloatArray, anchor_weight: FloatArray,
                        anchor_valid: BoolArray) -> tuple[FloatArray, FloatArray]:
    """:func:`robust_lines` of one block of rows."""
    series = y.shape[0]
    count = valid.sum(axis=-1)
    b_missing = np.where(valid, b, np.nan)  # NaN carries "no sample" through the arithmetic
    b_all = np.concatenate([b, anchor_b], axis=-1)
    y_all = np.concatenate([y, anchor_y], axis=-1)
    anchored = np.broadcast_to(anchor_valid, (series, *anchor_valid.shape))
    anchor_weights = np.broadcast_to(np.where(anchor_valid, anchor_weight, 0.0),
                                     anchored.shape)
    proportional = _median_per_sample(b_all, y_all, np.concatenate([valid, anchor_valid],
                                                                   axis=-1))
    slope = _pair_slope(b_missing, y, count)
    magnitude = np.abs(y)
    np.copyto(magnitude, 0.0, where=~valid)
    least = LEAST_TIME_FRACTION * magnitude.sum(axis=-1) / np.maximum(count, 1) + _TINY
    inlier = _inliers(cfg, b_missing, y, count, slope, least)
    used, spread, shrunk_slope, shrunk_intercept = _inlier_lines(
        b_all, y_all, inlier, anchored, anchor_weights, proportional, cfg.slope_prior_sd)
    slope = np.where(spread, shrunk_slope, slope)
    intercept = np.where(spread, shrunk_intercept, np.nan)  # NaN: the first line's, below
    # the second round: the rows whose inliers the first line moved are fitted again (the
    # others would give the same line: most rows at n = 1024 with 10% noise)
    again = _inliers(cfg, b_missing, y, count, slope, least)
    moved = (again != inlier).any(axis=-1)
    if moved.any():
        workers = np.nonzero(moved)[1]
        used[moved], spread, shrunk_slope, shrunk_intercept = _inlier_lines(
            b_all[workers], y_all[moved], again[moved], anchor_valid[workers],
            anchor_weights[moved], proportional[moved], cfg.slope_prior_sd)
        slope[moved] = np.where(spread, shrunk_slope, slope[moved])
        intercept[moved] = np.where(spread, shrunk_intercept, intercept[moved])
    unfitted = np.isnan(intercept)
    if unfitted.any():  # no round had two batch sizes: the first line's median intercept
        workers = np.nonzero(unfitted)[1]
        residual = y[unfitted] - slope[unfitted][:, None] * b_missing[workers]
        intercept[unfitted] = _median_of_low(residual, count[workers])

    negative = intercept < 0
    if negative.any():  # refitted through the origin
        workers = np.nonzero(negative)[1]
        b_used = np.where(used[negative], b_all[workers], 0.0)
        with np.errstate(invalid="ignore", divide="ignore"):
            slope[negative] = (b_used * y_all[negative]).sum(axis=-1) / (b_used * b_used).sum(
                axis=-1)
        intercept[negative] = 0.0
    floor = cfg.min_slope_fraction * proportional
    low = slope < floor
    if low.any():  # only the floored rows' intercepts are needed
        workers = np.nonzero(low)[1]
        at_floor = np.where(used[low], y_all[low] - floor[low][:, None] * b_all[workers], np.nan)
        intercept[low] = np.maximum(0.0, _median_of_low(at_floor, used[low].sum(axis=-1)))
        slope = np.where(low, floor, slope)
    return intercept, slope


def _median_per_sample(b: FloatArray, y: FloatArray, valid: BoolArray) -> FloatArray:
    """The median time per sample ``y / b`` of the valid points with ``b > 0``: the
    proportional model's slope. A function of its own so that its (series, rows, points)
    array is freed before the pair slopes take the most memory of the fit."""
    positive = valid & (b > 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_sample = y / np.where(positive, b, np.nan)
    per_sample.sort(axis=-1)
    return _median_of_sorted(per_sample, positive.sum(axis=-1))


def _inlier_lines(b: FloatArray, y: FloatArray, inlier: BoolArray, anchored: BoolArray,
                  anchor_weight: FloatArray, prior_slope: FloatArray, prior_sd: float) -> (
    tuple[BoolArray, BoolArray, FloatArray, FloatArray]
):
    """The points each line rests on (its inliers and anchors), whether they hold two batch
    sizes, and the :func:`shrunk_lines` through them."""
    used = np.concatenate([inlier, anchored], axis=-1)
    weight = np.concatenate([inlier.astype(np.float64), anchor_weight], axis=-1)
    slope, intercept = shrunk_lines(b, y, weight, prior_slope, prior_sd)
    return used, has_two_values(b, used), slope, intercept


def _inliers(cfg: FitConfig, b: FloatArray, y: FloatArray, count: IntArray,
             slope: FloatArray, least: FloatArray) -> BoolArray:
    """The samples within ``cfg.outlier_sigmas`` robust standard deviations of the median
    *relative* deviation from a line of this slope through the median residual; ``b`` is
    NaN where there is no sample. Relative, because timing noise scales with the time: a
    window of many short steps and a few long ones (a worker idle at 0 samples, then
    probed at 160 on a quarter of a core: ~1 ms against ~20 ms, each with its ~20%) has
    an absolute spread set by the short ones, and every long step fell outside it; the
    slope then rested on the short steps alone and ran 2-3x high at the probe's size. The
    line is taken as at least ``least`` (a small fraction of the row's mean time) where
    it runs near 0, and exact (noise-free) samples stay inliers through ``SCALE_FLOOR``."""
    line = np.multiply(slope[..., None], b)
    residual = np.subtract(y, line)
    centre = _median_of_low(residual, count)
    np.add(line, centre[..., None], out=line)
    size = np.maximum(np.abs(line), least[..., None])
    np.subtract(y, line, out=residual)
    np.divide(residual, size, out=residual)
    _, scale, deviation = _spread_in_place(residual, count)
    inlier: BoolArray = deviation <= cfg.outlier_sigmas * (scale + SCALE_FLOOR)[..., None]
    return inlier


def _pair_slope(b: FloatArray, y: FloatArray, count: IntArray) -> FloatArray:
    """A robust first slope (0 for a row at one batch size): the median of the slopes
    between samples about half a row apart in batch order, each paired with those
    ``_PAIR_SHIFT`` places nearer or further too. That is Theil-Sen on up to 6 samples and
    ~5 pairs per sample beyond (Theil-Sen: n/2). A pair is spoilt when either sample is,
    so, as for Theil-Sen, up to 29% of the samples can be stragglers at random before the
    median breaks, and the pairs span the row's batch range as its widest ones do. ``b``
    is NaN past each row's ``count`` samples."""
    series, rows = y.shape[:2]
    ordered = _in_batch_order(b, y)
    slope = np.zeros((series, rows))
    sizes, members = np.unique(count, return_counts=True)
    commonest = sizes[np.argsort(-members, kind="stable")].tolist()
    for size in commonest:
        # the commonest sample count pairs every row, the others are paired again alone (a
        # copy of the commonest rows cost more than pairing a few rows twice)
        same = slice(None) if size == commonest[0] else np.flatnonzero(count == size)
        half = (size + 1) // 2
        offsets = [h for h in range(half - _PAIR_SHIFT, half + _PAIR_SHIFT + 1) if 1 <= h < size]
        if not offsets:
            slope[:, same] = 0.0
            continue
        samples = ordered[:, same]
        diffs = np.empty((*samples.shape[:2], sum(size - h for h in offsets)))
        start = 0
        for h in offsets:  # the differences of samples h apart, side by side
            np.subtract(samples[..., h:size], samples[..., : size - h],
                        out=diffs[..., start:start + size - h])
            start += size - h
        db, dy = diffs[0], diffs[1:]
        pair = db != 0
        with np.errstate(invalid="ignore"):  # 0/NaN: no pair (equal batches), sorted last
            np.copyto(db, np.nan, where=~pair)
            slopes = np.divide(dy, db, out=dy)
        count_pairs = pair.sum(axis=-1)
        slopes.sort(axis=-1)
        slope[:, same] = np.where(count_pairs > 0, _median_of_sorted(slopes, count_pairs), 0.0)
    return slope


def _in_batch_order(b: FloatArray, y: FloatArray) -> FloatArray:
    """Each row's batch sizes and times sorted by batch size (NaN last), stacked: shape
    (1 + series, rows, width). A function of its own so that its index arrays are freed
    before the pairs take the most memory of the fit."""
    rows, width = b.shape
    series = y.shape[0]
    order = np.argsort(b, axis=-1, kind="stable")
    at = (order + width * np.arange(rows)[:, None]).reshape(-1)
    ordered = np.empty((1 + series, rows, width))
    np.take(b.reshape(-1), at, out=ordered[0].reshape(-1))
    np.take(y.reshape(series, -1), at, axis=1, out=ordered[1:].reshape(series, -1))
    return ordered


def shrunk_lines(b: FloatArray, y: FloatArray, weight: FloatArray, prior_slope: FloatArray,
                 prior_sd: float) -> tuple[FloatArray, FloatArray]:
    """Along the last axis, weighted least squares with a Gaussian prior N(prior_slope,
    (prior_sd*prior_slope)^2) on the slope (the posterior mean, a ridge toward the prior);
    NaN where the weighted points do not hold two batch sizes. The prior's weight is the
    residual variance over the prior's, so exact samples give the exact line and samples
    spread over a wide range of batches outweigh it, while a narrow range under noise
    cannot fit a slope near 0. ``weight`` (per point, in samples' worth; 0: left out) lets
    an anchor count as the measurements its median stands for."""
    total = weight.sum(axis=-1)
    scratch = np.empty(np.broadcast_shapes(weight.shape, b.shape, y.shape))
    with np.errstate(invalid="ignore", divide="ignore"):
        b_mean = _weighted_sum(weight, (b,), scratch) / total
        y_mean = _weighted_sum(weight, (y,), scratch) / total
        db, dy = b - b_mean[..., None], y - y_mean[..., None]
        sxx, sxy = _weighted_sum(weight, (db, db), scratch), _weighted_sum(weight, (db, dy),
                                                                          scratch)
        residual = np.subtract(dy, np.multiply((sxy / sxx)[..., None], db, out=db), out=dy)
        noise_var = _weighted_sum(weight, (residual, residual), scratch) / np.maximum(
            total - 2, 1.0)
        prior_var = (prior_sd * prior_slope) ** 2
        ridge = np.where(prior_var > 0, noise_var / prior_var, 0.0)
        slope = (sxy + ridge * prior_slope) / (sxx + ridge)
    return slope, y_mean - slope * b_mean


def _weighted_sum(weight: FloatArray, factors: tuple[FloatArray, ...],
                  scratch: FloatArray) -> FloatArray:
    """``(weight * factors[0] * factors[1] ...).sum(axis=-1)``, the products in ``scratch``:
    at n = 1024 a fresh (series, workers, points) array per product was a fifth of the
    line fit's time."""
    np.multiply(weight, factors[0], out=scratch)
    for factor in factors[1:]:
        np.multiply(scratch, factor, out=scratch)
    total: FloatArray = scratch.sum(axis=-1)
    return total


def robust_spread(x: FloatArray, valid: BoolArray) -> tuple[FloatArray, FloatArray]:
    """The median and the robust standard deviation (1.4826 MAD) along the last axis."""
    centre, scale, _ = _spread_in_place(np.where(valid, x, np.nan), valid.sum(axis=-1))
    return centre, scale


def _spread_in_place(x: FloatArray, count: IntArray) -> tuple[FloatArray, FloatArray,
                                                                 FloatArray]:
    """:func:`robust_spread` of the ``count`` values of ``x`` that are not NaN, and ``x``
    itself, overwritten by each value's absolute deviation from the median (NaN stays):
    a (workers, window) temporary less, which the fit's time at n = 1024 notices."""
    centre = _median_of_low(x, count)
    deviation = np.abs(np.subtract(x, centre[..., None], out=x), out=x)
    return centre, 1.4826 * _median_of_low(deviation, count), deviation


def change_points(log_ratio: FloatArray, valid: BoolArray, cfg: FitConfig,
                  spread: tuple[FloatArray, FloatArray]) -> IntArray:
    """Per row, where a lasting shift in measured/predicted time starts (0: none found);
    each row's samples are in time order, ``valid`` is a prefix of it and ``spread`` its
    :func:`robust_spread`.

    Stragglers are first clipped to ``cfg.outlier_sigmas`` robust deviations (at least
    ``cfg.drift_clip``); then, for every split with at least ``cfg.drift_min_segment``
    samples on each side, the mean shift is compared with its standard error (a
    two-sample z statistic, all splits at once). A split counts if its shift is a
    :func:`lasting_shift` (``cfg.drift_min_change``, ``cfg.drift_sigmas``); the change
    point is the split of largest z among those.
    """
    rows, width = log_ratio.shape
    segment = cfg.drift_min_segment
    if width < 2 * segment:
        return np.zeros(rows, dtype=np.intp)
    count = valid.sum(axis=1)
    centre, scale = spread
    reach = np.maximum(cfg.outlier_sigmas * scale, cfg.drift_clip)
    # split k: the first k samples against the rest; each array below is (rows, splits)
    before = np.arange(segment, width - segment + 1, dtype=np.float64)
    after = count[:, None] - before
    splits = slice(segment - 1, width - segment)  # the running sums up to each split (a
    # slice: a gather of them, and masks by np.where, cost 2 of 4 ms at n = 1024)
    # a row of unmodelled samples (log ratio inf or NaN) finds no change point, silently
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        x = np.clip(log_ratio, (centre - reach)[:, None], (centre + reach)[:, None])
        np.copyto(x, 0.0, where=~valid)
        sums = np.cumsum(x, axis=1)
        s1 = sums[:, splits]
        mean_a = s1 / before
        mean_b = sums[:, -1:] - s1
        mean_b /= after  # in place here and below: each (rows, splits) temporary is ~0.4 MB
        shift = mean_b - mean_a
        np.abs(shift, out=shift)
        # only rows with a shift large enough to count can have a change point: their
        # standard errors alone are needed (a few rows, unless the timing noise is large)
        large = (after >= segment) & large_shift(shift, cfg.drift_min_change)
        some = np.flatnonzero(large.any(axis=1))
        x, after, mean_a, mean_b, shift = x[some], after[some], mean_a[some], mean_b[some], shift[
            some]
        squares = np.cumsum(np.square(x, out=x), axis=1)
        s2 = squares[:, splits]
        within = (s2 - before * mean_a**2) + (squares[:, -1:] - s2 - after * mean_b**2)
        sd = np.sqrt(np.maximum(within, 0.0) / (count[some, None] - 2)) + SCALE_FLOOR
        standard_error = sd * np.sqrt(1.0 / before + 1.0 / after)
        z = shift / standard_error
    candidates = (after >= segment) & lasting_shift(shift, standard_error,
                                                    cfg.drift_min_change, cfg.drift_sigmas)
    best = np.argmax(np.where(candidates, z, 0.0), axis=1)
    found = np.zeros(rows, dtype=np.intp)
    found[some] = np.where(candidates.any(axis=1), segment + best, 0)
    return found


@overload
def lasting_shift(shift: float, standard_error: float, min_change: float,
                  sigmas: float) -> bool: ...
@overload
def lasting_shift(shift: FloatArray, standard_error: FloatArray, min_change: float,
                  sigmas: float) -> BoolArray: ...
def lasting_shift(shift: float | FloatArray, standard_error: float | FloatArray,
                  min_change: float, sigmas: float) -> bool | BoolArray:
    """Whether a shift of log(measured / predicted) compute time is a change of speed to
    act on: a relative change of more than ``min_change`` (:func:`large_shift`), and more
    than ``sigmas`` of its standard errors. The one rule of both drift detectors, each
    with its own statistic and constants: :func:`change_points` (the fitter: where in
    its window the speed changed, :class:`cannikin.perf.FitConfig`) and the planner's
    drift check (whether the latest steps left the model in force,
    :class:`cannikin.runtime.planner.PlannerConfig`)."""
    return large_shift(shift, min_change) & (shift > sigmas * standard_error)


@overload
def large_shift(shift: float, min_change: float) -> bool: ...
@overload
def large_shift(shift: FloatArray, min_change: float) -> BoolArray: ...
def large_shift(shift: float | FloatArray, min_change: float) -> bool | BoolArray:
    """The first half of :func:`lasting_shift`: the shift is a relative change of more than
    ``min_change``, whatever the noise (a cheap test before the standard error's)."""
    return shift > math.log1p(min_change)
