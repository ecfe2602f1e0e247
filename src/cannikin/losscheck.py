"""Is the loss averaged over each worker's local batch, as the weighted all-reduce assumes?

Worker i's gradient is weighted by its share ``b_i / B`` (DESIGN.md §5): the mean over the
step's samples when each worker's loss is the *mean* over its own ``b_i`` samples. A loss
*summed* over them (``reduction="sum"``, pytorch/examples' VAE; or a sum over a fixed
per-rank batch size from a DDP script) then gets weights that grow like ``b_i^2``: a
biased update, silently. Plain DDP gives such a loss ``(1/n) grad(sum over all)`` with its
equal batches; nothing in the update can tell the two apart.

The gradients can. For a mean over ``b`` samples ``E|g_i|^2 = |G|^2 + S / b_i``, which falls
with ``b_i`` (a slope of -1 to 0 in ``log |g_i|^2`` against ``log b_i``); for a sum it is
``b_i^2 |G|^2 + b_i S``, a slope of 1 to 2. Within one step the workers share ``G`` and
``S``, so the slope is pooled over steps from each step's workers centred on their own
means, and a slope above the middle of the gap, by several of its standard errors, says
the loss is summed. Steps at an even split carry no information, and so none is drawn
before the split is uneven. Pure numpy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

MIN_STEP_SPREAD = 0.5 * math.log(1.5) ** 2
"""A step counts once its workers' ``log b_i`` spread as much as two workers 1.5x apart."""


@dataclass
class SummedLossCheck:
    """Pools each step's workers' ``(log b_i, log |g_i|^2)`` into one slope (see the module
    docstring); :attr:`summed` once ``min_steps`` informative steps give a slope above
    ``slope_above`` by ``sigmas`` of its standard errors."""

    min_steps: int = 8
    """Informative steps before deciding."""
    slope_above: float = 0.5
    """The middle of the gap between a mean's slope (at most 0) and a sum's (at least 1)."""
    sigmas: float = 3.0
    """Standard errors of the slope (from the spread of its residuals) it must clear
    ``slope_above`` by. A model of a few parameters has norms as noisy as a chi-square of
    a few degrees of freedom: without this margin a mean loss over two parameters, workers
    about 1.5x apart, passed for a sum in 10-13 of 40 runs of 300 steps (its slope up to
    3.4 at that point), and in none with it (``tests/test_losscheck.py``)."""
    _sxy: float = field(default=0.0, init=False)
    _sxx: float = field(default=0.0, init=False)
    _syy: float = field(default=0.0, init=False)
    _freedom: int = field(default=0, init=False)
    """The residuals' degrees of freedom: each step's points less its centring."""
    _steps: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.min_steps < 1:
            raise ValueError(f"min_steps must be >= 1, got {self.min_steps}")
        if not 0 < self.slope_above < 1:
            raise ValueError(f"slope_above must lie in (0, 1), between a mean's slope and a "
                             f"sum's, got {self.slope_above}")

    def add(self, sqnorms: Sequence[float], batches: Sequence[float]) -> bool:
        """Fold in one step's gradient groups (|g_i|^2 of each group's loss gradient and its
        batch); True on the step where :attr:`summed` becomes true."""
        if len(sqnorms) != len(batches):
            raise ValueError(f"{len(sqnorms)} squared norms for {len(batches)} batches")
        before = self.summed
        q, b = np.asarray(sqnorms, dtype=np.float64), np.asarray(batches, dtype=np.float64)
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
        """The pooled slope of ``log |g_i|^2`` against ``log b_i`` (None before any step)."""
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
