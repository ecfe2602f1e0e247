"""SummedLossCheck against a Monte Carlo of per-sample gradients at the model's output
(cannikin.losscheck)."""

from __future__ import annotations

import numpy as np
import pytest

from cannikin.losscheck import MIN_SAMPLES, SummedLossCheck

WORKERS, TOTAL = 3, 120


def _median_norm(rng: np.random.Generator, batch: int, spread: float, vanish: float,
                 divisor: float, min_samples: int) -> float:
    """What a worker sends: the median of its samples' gradient norms at the output that are
    not 0 (0: too few). Each sample's own norm is lognormal (``spread`` its sigma in log
    space) or 0 with probability ``vanish`` (a sample already fitted); the loss divides it
    by ``divisor`` (the local batch for a mean, a constant for a sum)."""
    norms = rng.lognormal(0.0, spread, batch)
    norms = norms[rng.random(batch) >= vanish] / divisor
    return float(np.median(norms)) if norms.size >= min_samples else 0.0


def _run(seed: int, loss: str, *, spread: float = 0.3, vanish: float = 0.0,
         batches: str = "wide", steps: int = 300, total: int = TOTAL,
         min_samples: int = MIN_SAMPLES) -> tuple[int | None, SummedLossCheck]:
    """Steps of uneven (``wide``: any split, ``narrow``: about 1.5x apart) or ``even``
    splits; each step's norms at a level of its own (training moves it by orders of
    magnitude). ``loss``: the mean over the local batch, the ``sum``, or a sum over a
    ``fixed`` per-rank batch size. The step where the check said "summed" (None: never)."""
    rng = np.random.default_rng(seed)
    check = SummedLossCheck()
    for step in range(steps):
        if batches == "even":
            split = np.full(WORKERS, total // WORKERS)
        elif batches == "narrow":
            split = np.array([48, 40, 32]) * total // 120 + rng.integers(-1, 2, size=WORKERS)
        else:
            split = np.maximum(1, np.round(rng.dirichlet(np.ones(WORKERS)) * total))
        level = np.exp(rng.normal(0.0, 3.0))
        divisors = {"mean": split, "sum": np.ones(WORKERS),
                    "fixed": np.full(WORKERS, total / WORKERS)}[loss]
        medians = [level * _median_norm(rng, int(b), spread, vanish, float(d), min_samples)
                   for b, d in zip(split, divisors, strict=True)]
        if check.add(medians, split.tolist()):
            return step, check
    return None, check


NEAR_CONVERGENCE = [(3.0, 0.0), (3.0, 0.5), (2.0, 0.8)]
"""Per-sample gradients spread over orders of magnitude, up to most of them 0, where the
squared norm of each worker's mean gradient grows with its batch for a mean loss too."""


@pytest.mark.parametrize(("spread", "vanish"), [(0.3, 0.0), *NEAR_CONVERGENCE])
@pytest.mark.parametrize("batches", ["wide", "narrow"])
def test_a_mean_loss_is_never_taken_for_a_sum(spread: float, vanish: float,
                                              batches: str) -> None:
    for seed in range(10):
        flagged, check = _run(seed, "mean", spread=spread, vanish=vanish, batches=batches)
        assert flagged is None, (seed, check.slope, check.slope_error)
        assert check.steps >= 50 and check.slope is not None
        assert check.slope < -0.25, (seed, check.slope)  # a sum's is 0
        if spread < 1.0:  # a mean's, -1, where medians are precise
            assert abs(check.slope + 1) < 0.1, (seed, check.slope)


def test_a_mean_loss_with_medians_of_two_samples_could_pass_for_a_sum() -> None:
    """Why a worker sends no median of fewer than MIN_SAMPLES: of 80 runs of 60 samples a
    step, 90% of the gradients 0, two passed for a sum."""
    runs = [_run(seed, "mean", spread=3.0, vanish=0.9, batches=batches, total=60,
                 min_samples=1)[0] for seed in range(40) for batches in ("wide", "narrow")]
    assert sum(flagged is not None for flagged in runs) == 2


@pytest.mark.parametrize("loss", ["sum", "fixed"])
def test_a_summed_loss_is_found_in_a_few_uneven_steps(loss: str) -> None:
    for seed in range(20):
        flagged, check = _run(seed, loss, batches="narrow")
        assert flagged is not None and check.steps <= 12, (seed, flagged, check.slope)
        assert -0.3 < check.slope < 0.3  # type: ignore[operator]
        # near convergence the medians are noisy: the evidence takes longer
        flagged, check = _run(seed, loss, spread=3.0, vanish=0.5)
        assert flagged is not None, (seed, check.slope, check.slope_error)


def test_even_steps_say_nothing() -> None:
    flagged, check = _run(0, "sum", batches="even", steps=50)
    assert flagged is None and check.steps == 0 and check.slope is None


def test_idle_workers_and_workers_without_a_median_are_left_out() -> None:
    check = SummedLossCheck(min_steps=1)
    assert not check.add([4.0, 0.0, 1.0], [10, 0, 30])  # a worker at 0 samples
    assert not check.add([0.0, 2.0], [10, 30])  # one worker left: nothing to compare
    assert check.steps == 1


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="2 medians for 3 batches"):
        SummedLossCheck().add([1.0, 2.0], [1, 2, 3])
    with pytest.raises(ValueError, match="min_steps must be >= 1, got 0"):
        SummedLossCheck(min_steps=0)
    with pytest.raises(ValueError, match=r"slope_above must lie in \(-1, 0\).*got 0.5"):
        SummedLossCheck(slope_above=0.5)
