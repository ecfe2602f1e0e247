"""Gradient noise scale from uneven local batches (DESIGN.md section 4).

Each step, worker i reports ``|g_i|^2``, the squared norm of its local mean gradient over
its ``b_i`` samples (before the all-reduce), and every worker knows ``|g|^2`` of the global
gradient ``g = sum_i (b_i / B) g_i``.  From these we estimate ``|G|^2`` (the squared norm
of the true gradient) and ``S = tr(Sigma)``, the trace of the PER-SAMPLE gradient
covariance, so that the noise scale is ``phi = S / |G|^2`` in samples.

Model and assumptions
---------------------
Per-sample gradients are i.i.d. with mean ``G`` and covariance ``Sigma``, so
``E|g_i|^2 = |G|^2 + S / b_i`` and ``E|g|^2 = |G|^2 + S / B``.  Then each worker gives the
unbiased estimates::

    S_i  = (|g_i|^2 - |g|^2) / (1/b_i - 1/B)
    G2_i = (B |g|^2 - b_i |g_i|^2) / (B - b_i)  =  |g|^2 - S_i / B

Unbiasedness needs only independence and a finite covariance.  The *covariance* of the
estimates (and so the optimal way to combine them) needs fourth moments: here we assume the
local means are Gaussian, ``g_i ~ N(G, Sigma / b_i)`` independently (exact for Gaussian
per-sample gradients, the central-limit approximation otherwise).  For jointly Gaussian
``u, v`` with mean ``G`` and ``Cov(u, v) = c Sigma``,
``Cov(|u|^2, |v|^2) = 2 c^2 tr(Sigma^2) + 4 c G' Sigma G``, with ``c = delta_ij / b_i`` for
``(g_i, g_j)`` and ``c = 1/B`` for ``(g_i, g)`` and ``(g, g)``.  Writing
``e(b) = 2 tr(Sigma^2) / b^2 + 4 G'Sigma G / b`` and ``a_i = 1/b_i - 1/B``::

    Cov(S_i, S_j)   = (delta_ij e(b_i) - e(B)) / (a_i a_j)
    Cov(G2_i, G2_j) = e(B) + Cov(S_i, S_j) / B^2        (because Cov(|g|^2, S_i) = 0)

(:func:`estimator_covariance`).  For ``S``, ``A = D - e(B) u u'`` with
``D = diag(e(b_i) / a_i^2)`` and ``u_i = 1 / a_i``; Sherman-Morrison gives
``A^-1 1 = D^-1 (1 + kappa u)`` with ``kappa = e(B) u'D^-1 1 / (1 - e(B) u'D^-1 u)``, which
(using ``sum_i b_i = B``) is ``kappa = 1/B + 2 G'Sigma G / tr(Sigma^2)``, so
``(A^-1 1)_i = a_i (a_i + kappa) / e(b_i) = (B - b_i) / (2 B tr(Sigma^2))``.  For ``G2``
the extra ``e(B) 1 1'`` does not move the optimum of weights summing to 1.  Hence, for BOTH
estimators and for EVERY ``G`` and ``Sigma``::

    w_i = (B - b_i) / ((n - 1) B)

(:func:`min_variance_weights`), i.e. the pooled estimates
``S* = sum_i b_i (|g_i|^2 - |g|^2) / (n - 1)`` and ``G2* = |g|^2 - S* / B``.  For equal
``b_i`` these are exactly AdaptDL/Pollux's estimators.  The tests confirm all of this by
Monte Carlo.

Heavy tails
-----------
With heavy-tailed per-sample gradients and tiny ``b_i`` (say 1-4), ``g_i`` is far from
Gaussian: ``Var|g_i|^2`` gains terms from the third and fourth cumulants of the per-sample
gradients, of order ``1 / b_i^2`` and ``1 / b_i^3``, largest for the smallest batches.  The
estimates stay unbiased, but the weights above (which lean on the small-batch workers) are
then no longer optimal and the per-step estimate is noisier than the Gaussian model says
(3.2x its variance in the tests: t with 10 degrees of freedom, ``b = 1, 2, 8, 20``).  For
multivariate t with ``nu`` degrees of freedom the extra term is ``2 tr(Sigma)^2 / ((nu - 4)
b_i^3)`` against the Gaussian ``2 tr(Sigma^2) / b_i^2``, so it grows with the dimension.
Against equal weights (``benchmarks/bench_gns.py --tail-truths 20``: variances pooled over
20 random ``G``, full ``Sigma``, of 20000 steps each; one truth alone moves a t5 ratio by
+-5%), at ``b = 1, 2, 8, 20`` in 30 dimensions and noise scale 10 the weights above have
0.56x the variance of ``S*`` for Gaussian gradients, 1.03x for t10 and 1.47x for t5
(issue 17 said 1.40x), and 0.96x, 1.00x and 1.17x for ``G2*``; in 100 dimensions at noise
scale 1000 the variance of ``log phi`` (to first order) is 0.93x, 1.36x and 1.84x, and at
a straggler's split ``b = 1, 1, 1, 29`` 0.56x, 1.54x and 2.80x.  No fallback to equal
weights for tiny batches is made: the batch sizes do not tell which side wins, and equal
weights lose as much or more where the tails are light (1.4x the variance of ``log phi``
for Gaussian gradients at ``b = 1, 2, 8, 20`` and noise scale 10, 6x at
``b = 1, 1, 1, 29``, and 1.8x there at noise scale 1000).  The tails would have to be read
from the spread of the per-worker estimates over many steps, not from one step's norms.
The smoothing in :class:`NoiseScaleTracker` absorbs the extra noise; do not read
single-step values.

Workers vs micro-batches
------------------------
Nothing here needs the groups to be workers: any partition of the step's batch into
disjoint groups works, e.g. the gradient-accumulation micro-batches of a single worker.
At least two non-empty groups are required; a single worker must report two or more
micro-batches (there is no spread to measure otherwise).  Groups with ``b_i = 0`` are
ignored.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

__all__ = [
    "MAX_NOISE_SCALE",
    "NoiseScaleTracker",
    "estimate",
    "estimator_covariance",
    "min_variance_weights",
    "per_worker_estimates",
]

logger = logging.getLogger(__name__)

Kind = Literal["sqr", "var"]
FloatArray = npt.NDArray[np.float64]

# A noise scale beyond any realistic batch size means "batch size costs no efficiency";
# capping it keeps efficiency (phi + B0) / (phi + B) finite when |G|^2 is estimated as 0.
MAX_NOISE_SCALE = 1e12

_STATE_VERSION = 3


def _all_finite_nonnegative(values: FloatArray) -> bool:
    """Every entry finite and >= 0, in two reductions (min and max propagate NaN): the
    runtime validates a few values per step, where numpy's per-call cost dominates."""
    return values.size == 0 or bool(values.min() >= 0.0 and values.max() < math.inf)


def _as_batches(local_batches: Sequence[float] | npt.ArrayLike) -> FloatArray:
    b = np.asarray(local_batches, dtype=np.float64)
    if b.ndim != 1:
        raise ValueError(f"local_batches must be a 1-d sequence, got shape {b.shape}")
    if not _all_finite_nonnegative(b):
        raise ValueError(
            f"local_batches must be finite and >= 0, got {b.tolist()}"
        )
    if np.count_nonzero(b) < 2:
        raise ValueError(
            f"the noise scale needs at least 2 groups with a positive batch, got "
            f"local_batches={b.tolist()}; a single worker must report its gradient-"
            f"accumulation micro-batches (>= 2) as separate entries"
        )
    return b


def _as_inputs(
    local_sqnorms: Sequence[float] | npt.ArrayLike,
    local_batches: Sequence[float] | npt.ArrayLike,
    global_sqnorm: float,
) -> tuple[FloatArray, FloatArray, float]:
    b = _as_batches(local_batches)
    x = np.asarray(local_sqnorms, dtype=np.float64)
    if x.shape != b.shape:
        raise ValueError(
            f"local_sqnorms has shape {x.shape} but local_batches has shape {b.shape}; "
            f"pass one squared norm per group"
        )
    y = float(global_sqnorm)
    if not (_all_finite_nonnegative(x) and 0.0 <= y < math.inf):
        raise ValueError(
            f"squared norms must be finite and >= 0, got local_sqnorms={x.tolist()}, "
            f"global_sqnorm={y}"
        )
    return x, b, y


def estimate(
    local_sqnorms: Sequence[float] | npt.ArrayLike,
    local_batches: Sequence[float] | npt.ArrayLike,
    global_sqnorm: float,
) -> tuple[float, float]:
    """One step's unbiased ``(grad_sqr, grad_var)``: ``|G|^2`` and per-sample ``tr(Sigma)``.

    The per-group estimates combined with :func:`min_variance_weights`, computed in the
    pooled form ``S* = sum_i b_i (|g_i|^2 - |g|^2) / (n - 1)``, ``G2* = |g|^2 - S*/B``
    (O(n), no matrix).  Either value may be negative on a single step: it is an unbiased
    estimate, not a clamped one.  Raises ValueError for fewer than two non-empty groups,
    mismatched lengths, or negative / non-finite inputs.
    """
    x, b, y = _as_inputs(local_sqnorms, local_batches, global_sqnorm)
    n = int(np.count_nonzero(b))
    total = float(b.sum())
    grad_var = float(np.dot(b, x - y)) / (n - 1)
    return y - grad_var / total, grad_var


def per_worker_estimates(
    local_sqnorms: Sequence[float] | npt.ArrayLike,
    local_batches: Sequence[float] | npt.ArrayLike,
    global_sqnorm: float,
) -> tuple[FloatArray, FloatArray]:
    """Each group's own unbiased ``(G2_i, S_i)``; NaN for groups with ``b_i = 0``.

    For diagnostics and for comparing weightings; :func:`estimate` is the combined value.
    """
    x, b, y = _as_inputs(local_sqnorms, local_batches, global_sqnorm)
    total = b.sum()
    pos = b > 0
    var = np.full_like(b, np.nan)
    var[pos] = (x[pos] - y) / (1.0 / b[pos] - 1.0 / total)
    return y - var / total, var


def _check_kind(kind: str) -> None:
    if kind not in ("sqr", "var"):
        raise ValueError(f"kind must be 'sqr' or 'var', got {kind!r}")


def min_variance_weights(
    local_batches: Sequence[float] | npt.ArrayLike, kind: Kind
) -> FloatArray:
    """Weights ``w = A^-1 1 / (1' A^-1 1)`` minimising the variance of ``sum_i w_i X_i``.

    ``X_i`` are the per-group estimates of ``|G|^2`` (kind ``"sqr"``) or ``tr(Sigma)``
    (kind ``"var"``), ``A`` their covariance under the Gaussian model of the module
    docstring (:func:`estimator_covariance`).  The solution is the same for both kinds
    and for every ``G``, ``Sigma``: ``w_i = (B - b_i) / ((n - 1) B)`` over the ``n`` groups
    with ``b_i > 0`` (weight 0 for empty groups).  The weights sum to 1.
    """
    _check_kind(kind)
    b = _as_batches(local_batches)
    n = int(np.count_nonzero(b))
    total = b.sum()
    return np.where(b > 0, (total - b) / ((n - 1) * total), 0.0)


def estimator_covariance(
    local_batches: Sequence[float] | npt.ArrayLike,
    kind: Kind,
    *,
    tr_sigma_sq: float = 1.0,
    g_sigma_g: float = 0.0,
) -> FloatArray:
    """Covariance matrix of the per-group estimates (non-empty groups only).

    Gaussian model of the module docstring; ``tr_sigma_sq = tr(Sigma^2)`` and
    ``g_sigma_g = G' Sigma G`` of the per-sample covariance.  The defaults give the
    noise-dominated shape (the matrix up to a constant).  Exposed so the derivation of
    :func:`min_variance_weights` can be checked numerically.
    """
    _check_kind(kind)
    if not (tr_sigma_sq > 0 and math.isfinite(tr_sigma_sq)):
        raise ValueError(f"tr_sigma_sq must be finite and > 0, got {tr_sigma_sq}")
    if not (g_sigma_g >= 0 and math.isfinite(g_sigma_g)):
        raise ValueError(f"g_sigma_g must be finite and >= 0, got {g_sigma_g}")
    b = _as_batches(local_batches)
    b = b[b > 0]
    total = float(b.sum())

    def e(batch: FloatArray | float) -> FloatArray:
        return np.asarray(2.0 * tr_sigma_sq / batch**2 + 4.0 * g_sigma_g / batch)

    a = 1.0 / b - 1.0 / total
    e_total = float(e(total))
    cov_var: FloatArray = (np.diag(e(b)) - e_total) / np.outer(a, a)
    if kind == "var":
        return cov_var
    cov_sqr: FloatArray = e_total + cov_var / total**2
    return cov_sqr


@dataclass
class _Average:
    """A bias-corrected exponential average of per-step ``(|G|^2, tr(Sigma))`` estimates,
    with the spread of the ``|G|^2`` ones for its standard error."""

    sqr: float = 0.0
    var: float = 0.0
    unbias: float = 0.0
    sqr2: float = 0.0  # the same average of |G|^2 estimates squared
    weight2: float = 0.0  # the sum of the squared weights (for the standard error)
    updates: int = 0

    def add(self, theta: float, grad_sqr: float, grad_var: float) -> None:
        self.sqr = theta * self.sqr + (1.0 - theta) * grad_sqr
        self.var = theta * self.var + (1.0 - theta) * grad_var
        self.unbias = theta * self.unbias + (1.0 - theta)
        self.sqr2 = theta * self.sqr2 + (1.0 - theta) * grad_sqr * grad_sqr
        self.weight2 = theta * theta * self.weight2 + (1.0 - theta) ** 2
        self.updates += 1

    def mean_sqr(self) -> float | None:
        return self.sqr / self.unbias if self.updates else None

    def mean_var(self) -> float | None:
        return self.var / self.unbias if self.updates else None

    def sqr_error(self) -> float:
        """Standard error of :meth:`mean_sqr`: the weighted variance of the estimates,
        corrected for the weights' bias, times the sum of the squared normalised weights;
        ``inf`` before two updates."""
        if self.updates < 2 or self.weight2 <= 0:
            return math.inf
        mean = self.sqr / self.unbias
        spread = max(self.sqr2 / self.unbias - mean * mean, 0.0)
        concentration = self.weight2 / (self.unbias * self.unbias)  # sum w_k^2, sum w_k = 1
        if concentration >= 1.0:
            return math.inf
        return math.sqrt(spread / (1.0 - concentration) * concentration)

    def state(self, prefix: str) -> dict[str, float | int]:
        return {f"{prefix}sqr_biased": self.sqr, f"{prefix}var_biased": self.var,
                f"{prefix}unbias": self.unbias, f"{prefix}sqr2_biased": self.sqr2,
                f"{prefix}weight2": self.weight2, f"{prefix}num_updates": self.updates}

    @classmethod
    def from_state(cls, state: dict[str, float | int], prefix: str) -> _Average:
        """The average saved by :meth:`state`; a version-1 state has no spread (its standard
        error is unknown, inf, from there). ValueError for invalid values."""
        values = [float(state[prefix + k]) for k in ("sqr_biased", "var_biased", "unbias")]
        if not all(math.isfinite(v) for v in values) or not 0.0 <= values[2] <= 1.0:
            raise ValueError(f"noise-scale state has invalid values: {state}")
        updates = state[prefix + "num_updates"]
        if int(updates) != updates or updates < 0 or (updates > 0) != (values[2] > 0):
            raise ValueError(
                f"noise-scale state {prefix}num_updates={updates} is inconsistent with "
                f"{prefix}unbias={values[2]}"
            )
        return cls(sqr=values[0], var=values[1], unbias=values[2],
                   sqr2=float(state.get(prefix + "sqr2_biased", 0.0)),
                   weight2=float(state.get(prefix + "weight2", 0.0)), updates=int(updates))


class NoiseScaleTracker:
    """Smoothed ``|G|^2``, ``tr(Sigma)`` and noise scale across steps.

    A bias-corrected exponential moving average of :func:`estimate`, as AdaptDL does: the
    average starts at zero and is divided by ``1 - theta^t`` so early values are not pulled
    towards zero.  ``theta = smoothing`` per step, or ``smoothing ** (B / init_batch)`` when
    ``init_batch`` is given, so a step of ``B`` samples counts as ``B / init_batch`` steps of
    the initial batch (AdaptDL's choice).  Before the first update :attr:`grad_sqr`,
    :attr:`grad_var` and :meth:`noise_scale` are ``None``.

    That average spans ~1000 steps, and in training ``|G|^2`` can fall 100x within a hundred
    (the demo's CNN on digits, ``benchmarks/bench_gns_lag.py``): the learning phase's values
    then hold the average up and the noise scale reads 10x low for hundreds of steps. So a
    short average (``restart_smoothing``) runs beside it, and when its ``|G|^2`` differs
    from the long one's by more than ``restart_sigmas`` of its own standard errors, the long
    average restarts from the short one (:attr:`restarts` counts them). None: never.
    """

    def __init__(self, smoothing: float = 0.999, *, init_batch: float | None = None,
                 restart_smoothing: float = 0.95, restart_sigmas: float | None = 4.0) -> None:
        for name, value in (("smoothing", smoothing), ("restart_smoothing", restart_smoothing)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if init_batch is not None and not (init_batch > 0 and math.isfinite(init_batch)):
            raise ValueError(f"init_batch must be finite and > 0 (or None), got {init_batch}")
        if restart_sigmas is not None and not (restart_sigmas > 0
                                               and math.isfinite(restart_sigmas)):
            raise ValueError(f"restart_sigmas must be finite and > 0 (or None), got "
                             f"{restart_sigmas}")
        self.smoothing = smoothing
        self.init_batch = init_batch
        self.restart_smoothing = restart_smoothing
        self.restart_sigmas = restart_sigmas
        self._long = _Average()
        self._short = _Average()
        self.restarts = 0

    @property
    def num_updates(self) -> int:
        """Steps folded in since the start or the last :meth:`reset` (the count of the short
        average, which is never restarted)."""
        return self._short.updates

    def reset(self) -> None:
        """Forget all updates, e.g. when the gradient space changes (see Preconditioner)."""
        self._long, self._short = _Average(), _Average()

    def update(
        self,
        local_sqnorms: Sequence[float] | npt.ArrayLike,
        local_batches: Sequence[float] | npt.ArrayLike,
        global_sqnorm: float,
    ) -> bool:
        """Fold in one step; returns False (and logs a warning) if the step was skipped.

        Steps with non-finite squared norms (e.g. an AMP overflow) are skipped rather than
        poisoning the average; invalid batch sizes still raise ValueError.
        """
        x = np.asarray(local_sqnorms, dtype=np.float64)
        if not math.isfinite(float(x.sum()) + float(global_sqnorm)):  # NaN or inf anywhere
            logger.warning(
                "skipping noise-scale update with non-finite squared norms "
                "(local=%s, global=%s)", x.tolist(), global_sqnorm,
            )
            _as_batches(local_batches)
            return False
        grad_sqr, grad_var = estimate(x, local_batches, global_sqnorm)
        steps = 1.0 if self.init_batch is None else float(np.sum(local_batches)) / self.init_batch
        self._long.add(self.smoothing ** steps, grad_sqr, grad_var)
        self._short.add(self.restart_smoothing ** steps, grad_sqr, grad_var)
        self._maybe_restart()
        return True

    def _maybe_restart(self) -> None:
        """Restart the long average from the short one when their |G|^2 disagree, once the
        short one spans its window (its spread is a standard error only then)."""
        short = self._short
        if self.restart_sigmas is None or short.updates * (1.0 - self.restart_smoothing) < 1.0:
            return
        short_sqr, long_sqr = short.mean_sqr(), self._long.mean_sqr()
        assert short_sqr is not None and long_sqr is not None
        if abs(short_sqr - long_sqr) > self.restart_sigmas * short.sqr_error():
            logger.debug("noise scale: |G|^2 of the last steps %.3g is off the long average "
                         "%.3g by more than %g standard errors; the average restarts from "
                         "them", short_sqr, long_sqr, self.restart_sigmas)
            self._long = _Average(**vars(short))
            self.restarts += 1

    @property
    def grad_sqr_error(self) -> float:
        """Standard error of :attr:`raw_grad_sqr` from the spread of the per-step estimates
        and the smoothing weights; ``inf`` before two updates. Far above B the noise scale is
        a ratio over a |G|^2 estimate that noise can drive to 0 or below."""
        return self._long.sqr_error()

    @property
    def raw_grad_sqr(self) -> float | None:
        """Smoothed ``|G|^2`` as averaged (may be negative while noise dominates)."""
        return self._long.mean_sqr()

    @property
    def raw_grad_var(self) -> float | None:
        """Smoothed per-sample ``tr(Sigma)`` as averaged (may be negative early on)."""
        return self._long.mean_var()

    @property
    def grad_sqr(self) -> float | None:
        """Smoothed ``|G|^2``, clamped at 0; None before the first update."""
        raw = self.raw_grad_sqr
        return None if raw is None else max(raw, 0.0)

    @property
    def grad_var(self) -> float | None:
        """Smoothed per-sample ``tr(Sigma)``, clamped at 0; None before the first update."""
        raw = self.raw_grad_var
        return None if raw is None else max(raw, 0.0)

    def noise_scale(self) -> float | None:
        """``grad_var / grad_sqr`` in samples, capped at :data:`MAX_NOISE_SCALE`.

        None before the first update (so a caller cannot mistake "unknown" for a value).
        """
        sqr, var = self.grad_sqr, self.grad_var
        if sqr is None or var is None:
            return None
        if var <= 0.0:
            return 0.0
        if sqr * MAX_NOISE_SCALE <= var:
            return MAX_NOISE_SCALE
        return var / sqr

    def cautious_noise_scale(self, sigmas: float) -> float | None:
        """tr(Sigma) over |G|^2 raised by ``sigmas`` of its standard errors, a low estimate
        that grows as the evidence does; None before an estimate, with |G|^2 <= 0 or the
        noise scale capped, where the gradient is not told from the noise yet."""
        raw, var, noise = self.raw_grad_sqr, self.grad_var, self.noise_scale()
        if raw is None or var is None or noise is None or not raw > 0 or (
                noise >= MAX_NOISE_SCALE):
            return None
        error = self.grad_sqr_error
        if not math.isfinite(error):
            return None
        return var / (raw + sigmas * error)

    def state_dict(self) -> dict[str, float | int]:
        """Plain numbers only (JSON / ``torch.load(weights_only=True)`` safe)."""
        return {"version": _STATE_VERSION, **self._long.state(""),
                **self._short.state(_SHORT), "restarts": self.restarts}

    def load_state_dict(self, state: dict[str, float | int]) -> None:
        """Restore :meth:`state_dict` (or an earlier version's: the short average then
        starts as a copy of the long one); raises ValueError for a malformed or foreign
        state."""
        version = state.get("version")
        if version not in _STATE_KEYS:
            raise ValueError(
                f"noise-scale state version {version} is not supported "
                f"(expected one of {sorted(_STATE_KEYS)})"
            )
        expected = _STATE_KEYS[int(version)]
        if set(state) != expected:
            raise ValueError(
                f"noise-scale state must have keys {sorted(expected)}, got {sorted(state)}"
            )
        long = _Average.from_state(state, "")
        short = (_Average.from_state(state, _SHORT) if version == _STATE_VERSION
                 else _Average(**vars(long)))
        self._long, self._short = long, short
        self.restarts = int(state.get("restarts", 0))


_SHORT = "short_"
_V1_KEYS = {"version", "sqr_biased", "var_biased", "unbias", "num_updates"}
_V2_KEYS = _V1_KEYS | {"sqr2_biased", "weight2"}
_STATE_KEYS = {1: _V1_KEYS, 2: _V2_KEYS,
               _STATE_VERSION: _V2_KEYS | {_SHORT + k for k in _V2_KEYS - {"version"}}
               | {"restarts"}}
