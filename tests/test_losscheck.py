"""SummedLossCheck against a Monte Carlo of workers' local gradients (cannikin.losscheck)."""

from __future__ import annotations

import numpy as np
import pytest

from cannikin.losscheck import SummedLossCheck

WORKERS, TOTAL = 3, 60


def _run(seed: int, dims: int, noise_scale: float, summed: bool, *, narrow: bool = False,
         even: bool = False, steps: int = 300) -> tuple[int | None, SummedLossCheck]:
    """Steps of Gaussian per-sample gradients (mean G with |G| = 1, trace of the covariance
    ``noise_scale``): each worker's loss over its local batch is the mean, or the sum
    (``summed``), its |g_i|^2 what the check gets. The step where it said "summed" (None:
    never), and the check."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(size=dims)
    mean /= np.linalg.norm(mean)
    sigma = np.sqrt(noise_scale / dims)
    check = SummedLossCheck()
    for step in range(steps):
        if even:
            batches = np.full(WORKERS, TOTAL // WORKERS)
        elif narrow:  # about 1.5x apart
            batches = np.array([24, 20, 16]) + rng.integers(-1, 2, size=WORKERS)
        else:
            batches = np.maximum(1, np.round(rng.dirichlet(np.ones(WORKERS)) * TOTAL))
        sqnorms = []
        for batch in batches:
            local = mean + sigma * rng.normal(size=dims) / np.sqrt(batch)  # the local mean
            if summed:
                local = local * batch
            sqnorms.append(float(local @ local))
        if check.add(sqnorms, batches.tolist()):
            return step, check
    return None, check


@pytest.mark.parametrize("dims", [2, 5, 1000])
@pytest.mark.parametrize("noise_scale", [0.1, 100.0, 1e5])
@pytest.mark.parametrize("narrow", [False, True])
def test_a_mean_loss_is_never_taken_for_a_sum(dims: int, noise_scale: float,
                                              narrow: bool) -> None:
    for seed in range(10):
        flagged, check = _run(seed, dims, noise_scale, summed=False, narrow=narrow)
        assert flagged is None, (seed, check.slope, check.slope_error)
        assert check.steps >= 100 and check.slope is not None and check.slope < 0.5


@pytest.mark.parametrize("noise_scale", [0.1, 100.0, 1e5])
def test_a_summed_loss_is_found_in_a_few_uneven_steps(noise_scale: float) -> None:
    for seed in range(20):
        flagged, check = _run(seed, 1000, noise_scale, summed=True, narrow=True)
        assert flagged is not None and check.steps < 10, (seed, flagged, check.slope)
        assert 0.8 < check.slope < 2.2  # type: ignore[operator]
        # a model of two parameters: its norms are noisy, the evidence takes longer
        flagged, check = _run(seed, 2, noise_scale, summed=True)
        assert flagged is not None and flagged < 100, (seed, flagged, check.slope)


def test_even_steps_say_nothing() -> None:
    flagged, check = _run(0, 1000, 100.0, summed=True, even=True, steps=50)
    assert flagged is None and check.steps == 0 and check.slope is None


def test_idle_workers_and_zero_norms_are_left_out() -> None:
    check = SummedLossCheck(min_steps=1)
    assert not check.add([4.0, 0.0, 1.0], [10, 0, 30])  # a worker at 0 samples
    assert not check.add([0.0, 2.0], [10, 30])  # one group left: nothing to compare
    assert check.steps == 1


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="2 squared norms for 3 batches"):
        SummedLossCheck().add([1.0, 2.0], [1, 2, 3])
    with pytest.raises(ValueError, match="min_steps must be >= 1, got 0"):
        SummedLossCheck(min_steps=0)
    with pytest.raises(ValueError, match="slope_above must lie in \\(0, 1\\).*got 1.5"):
        SummedLossCheck(slope_above=1.5)
