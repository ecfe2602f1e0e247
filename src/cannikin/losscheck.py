"""Is the loss averaged over each worker's local batch, as the weighted all-reduce assumes?

Worker i's gradient is weighted by its share ``b_i / B`` (DESIGN.md §5): the mean over the
step's samples when each worker's loss is the *mean* over its own ``b_i`` samples. A loss
*summed* over them (``reduction="sum"``, pytorch/examples' VAE; or a sum over a fixed
per-rank batch size from a DDP script) then gets weights that grow like ``b_i^2``: a
biased update, silently. Plain DDP gives such a loss ``(1/n) grad(sum over all)`` with its
equal batches; nothing in the update can tell the two apart.

Each sample's gradient at the model's output can. A sample's own loss gives it the same
distribution on every worker; a mean over ``b_i`` samples divides it by ``b_i``, a sum does
not. So the median over a worker's samples of that gradient's norm (of those not 0) falls
like ``1 / b_i`` for a mean (a slope of -1 in ``log`` against ``log b_i``) and stays level
for a sum (0). The median, not the norm of the whole gradient: near convergence most
samples' gradients vanish and the rest spread over orders of magnitude, and the squared
norm of a worker's mean gradient, the statistic this check used before, then grows with
``b_i`` for a mean loss too (the larger batch more often holds one of the rare large
gradients): a mean loss trained to near 0 on a 6/20/34 split passed for a sum in 4 runs of
4 (its slope 9-11). Within one step the workers share the distribution, so the slope is
pooled over steps from each step's workers centred on their own means, and a slope above
the middle of the gap, by several of its standard errors, says the loss is summed. Steps
at an even split carry no information, and so none is drawn before the split is uneven. Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_STEP_SPREAD = 0.5 * math.log(1.5) ** 2
"""A step counts once its workers' ``log b_i`` spread as much as two workers 1.5x apart."""
MIN_SAMPLES = 3
"""Samples (with a gradient not 0) a worker's median is taken over, or it sends none. The
median of one or two is a sample of a spread of orders of magnitude, on the smallest
batches, where the slope is levered most: with them a mean loss passed for a sum in 2 of
80 Monte Carlo runs of gradients near convergence (90% of them 0, the rest lognormal of
sigma 3, 60 samples a step), in none of 720 runs of such regimes with this floor
(``tests/test_losscheck.py``)."""


@dataclass
class SummedLossCheck:
    """Pools each step's workers' ``(log b_i, log m_i)`` into one slope, ``m_i`` the median
    over worker i's samples of the norm of their loss's gradient at the model's output (see
    the module docstring); :attr:`summed` once ``min_steps`` informative steps give a slope
    above ``slope_above`` by ``sigmas`` of its standard errors."""

    min_steps: int = 8
    """Informative steps before deciding."""
    slope_above: float = -0.5
    """The middle of the gap between a mean's slope (-1) and a sum's (0)."""
    sigmas: float = 3.0
    """Standard errors of the slope (from the spread of its residuals) it must clear
    ``slope_above`` by: a median over a few samples of a gradient spread over orders of
    magnitude is itself noisy (``tests/test_losscheck.py``)."""
    _sxy: float = field(default=0.0, init=False)
    _sxx: float = field(default=0.0, init=False)
    _syy: float = field(default=0.0, init=False)
    _freedom: int = field(default=0, init=False)
    """The residuals' degrees of freedom: each step's points less its centring."""
    _steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {self.min_steps}")
        if not -1 < self.slope_above < 0:
            raise ValueError(f"slope_above must lie in (-1, 0), between a mean's slope and a "
                             f"sum's, got {self.slope_above}")

    def add(self, medians: Sequence[float], batches: Sequence[float]) -> bool:
        """Fold in one step's workers (the median norm of each one's per-sample output
        gradients, over at least :data:`MIN_SAMPLES` of them, 0 where not taken, and its
        local batch); True on the step where :attr:`summed` becomes true."""
        if len(medians) != len(batches):
            raise ValueError(f"{len(medians)} medians for {len(batches)} batches")
        before = self.summed
        q, b = np.asarray(medians, dtype=np.float64), np.asarray(batches, dtype=np.float64)
        kept = (q > 0) & np.isfinite(q) & (b > 0)
        if np.count_nonzero(kept) < 2:
            return False
        x, y = np.log(b[kept]), np.log(q[kept])
        x, y = x - x.mean(), y - y.mean()
        spread = float(x @ x)
        if spread < MIN_STEP_SPREAD:
            return False
        self._sxx += spread
        self._sxy += float(x @ y)
        self._syy += float(y @ y)
        self._freedom += x.size - 1
        self._steps += 1
        return self.summed and not before

    @property
    def steps(self) -> int:
        """Informative steps pooled so far."""
        return self._steps

    @property
    def slope(self) -> float | None:
        """The pooled slope of ``log m_i`` against ``log b_i`` (None before any step)."""
        return self._sxy / self._sxx if self._steps else None

    @property
    def slope_error(self) -> float:
        """The standard error of :attr:`slope` (inf until the residuals have a spread)."""
        freedom = self._freedom - 1  # the slope is fitted too
        if not self._steps or freedom < 1:
            return math.inf
        residual = max(self._syy - self._sxy ** 2 / self._sxx, 0.0) / freedom
        return math.sqrt(residual / self._sxx)

    @property
    def summed(self) -> bool:
        slope = self.slope
        return (self._steps >= self.min_steps and slope is not None
                and slope - self.sigmas * self.slope_error > self.slope_above)
